"""The lifecycle manager: finished pipelines in checkpoints, ending input,
one shared final checkpoint, mixed jobs, drain, savepoint and resume, signals.

Jobs that are crashed, signalled or stopped from another terminal run as real
driver processes (``tests/jobs/lifecycle_job.py``); the others run in-process.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable
from pyspark.sql import DataFrame

from lifecycle import Job, JobResult, PipelineState
from lifecycle.ledger import read_ledger
from lifecycle.pipeline import Pipeline
from sinks import DeltaSink, KafkaSink, PostgresSink
from tests import tiers
from tests.conftest import write_input
from tests.jobs.lifecycle_job import windowed
from tests.kafkacheck import assert_exactly_once as kafka_exactly_once
from tests.kafkacheck import assert_nothing_open
from tests.pgcheck import assert_exactly_once, job_prepared
from tests.procs import JobProcess, run_job, twophase, wait_for
from tests.sparkutil import EVENT_SCHEMA
from tests.tiers import SLOW

T0 = datetime(2024, 1, 1, 0, 0, 0)


def write_events(directory: Path, first: int, count: int, files: int) -> None:
    """Events every 30 s from T0 + first*30s: ids first..first+count-1.

    The files get modification times a second apart, in event order: Spark's
    file source reads files in modification-time order, ties in any order, and
    a later file read first would make the earlier files' events late (dropped
    by the watermark)."""
    directory.mkdir(parents=True, exist_ok=True)
    per = max(1, count // files)
    now = time.time()
    for f in range(files):
        ids = range(first + f * per, first + (count if f == files - 1 else (f + 1) * per))
        text = "".join(
            json.dumps(
                {"id": i, "ts": (T0 + timedelta(seconds=30 * i)).isoformat(), "amount": float(i)}
            )
            + "\n"
            for i in ids
        )
        tmp = directory / f".ev-{first}-{f}.tmp"
        tmp.write_text(text)
        mtime = now - files + f
        os.utime(tmp, (mtime, mtime))
        tmp.rename(directory / f"ev-{first}-{f:03d}.json")


def expected_windows(ids: range) -> dict[datetime, tuple[int, float]]:
    out: dict[datetime, tuple[int, float]] = {}
    for i in ids:
        ts = T0 + timedelta(seconds=30 * i)
        start = ts.replace(minute=ts.minute - ts.minute % 10, second=0)
        n, total = out.get(start, (0, 0.0))
        out[start] = (n + 1, total + float(i))
    return out


def window_rows(dsn: str, table: str = "windows") -> dict[datetime, tuple[int, float]]:
    with psycopg.connect(dsn) as c:
        c.execute("SET TIME ZONE 'UTC'")
        rows = c.execute(f"SELECT window_start, n, total FROM {table}").fetchall()
    out: dict[datetime, tuple[int, float]] = {}
    for start, n, total in rows:
        key = start.replace(tzinfo=None)
        assert key not in out, f"window {key} written twice"
        out[key] = (n, total)
    return out


def create_tables(dsn: str, *tables: str, windows: bool = False) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        for t in tables:
            c.execute(f"CREATE TABLE {t} (id bigint PRIMARY KEY, name text, amount float8)")
        if windows:
            c.execute(
                "CREATE TABLE windows (window_start timestamptz PRIMARY KEY, "
                "window_end timestamptz, n bigint, total float8)"
            )


def ledger_kinds(state: Path) -> list[str]:
    doc = read_ledger(state)
    assert doc is not None
    return [cp["kind"] for cp in doc["history"]]


def run_until(job: Job, stop_when: Callable[[], object], drain: bool) -> JobResult:
    """Run ``job`` in a thread; once ``stop_when()`` holds, stop it (with or
    without drain) and return its result."""
    out: dict[str, JobResult] = {}
    t = threading.Thread(target=lambda: out.setdefault("r", job.run()), daemon=True)
    t.start()
    wait_for(stop_when, 120, "the job to commit its first windows")
    job.stop(drain=drain)
    t.join(120)
    assert not t.is_alive()
    return out["r"]


# -- in-process ------------------------------------------------------------------------


def test_windowed_bounded_input_emits_every_window_at_end(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """Without the end-of-input flush the last windows (within the watermark
    delay of the last event) would stay in Spark state and never reach the sink."""
    write_events(tmp_path / "ev", 0, 200, files=4)  # 100 minutes of events
    create_tables(pg_dsn, windows=True)
    src = (
        spark.readStream.schema(EVENT_SCHEMA)
        .option("maxFilesPerTrigger", 2)
        .json(str(tmp_path / "ev"))
    )
    job = Job(spark, "win", tmp_path / "state", checkpoint_interval=0)
    job.add_pipeline(
        "agg",
        src,
        [PostgresSink(pg_dsn, "windows")],
        bounded=True,
        transform=windowed,
        event_time="ts",
    )
    result = job.run()
    assert result.committed and result.pipelines == {"agg": PipelineState.FINISHED}
    assert window_rows(pg_dsn) == expected_windows(range(200))
    assert ledger_kinds(tmp_path / "state")[-1] == "final"
    # the marker came from no file: the driver's flag and the Spark checkpoint are
    # all there is under the pipeline's location (no end_of_input/ for executors)
    location = tmp_path / "state" / "pipelines" / "agg"
    assert sorted(p.name for p in location.iterdir()) == ["ending_input.json", "spark"]


@pytest.mark.parametrize("mode", ["update", "complete"])
def test_no_end_of_input_marker_in_update_or_complete_mode(spark, pg_dsn, tmp_path, mode):  # type: ignore[no-untyped-def]
    """Update and complete modes emit every changed window as data arrives and
    hold nothing back for the end of input, so no marker is fed: fed, it was
    aggregated into a window of 9999-12-31 (n = 1) that reached the sink."""
    write_events(tmp_path / "ev", 0, 200, files=4)
    create_tables(pg_dsn, windows=True)
    src = (
        spark.readStream.schema(EVENT_SCHEMA)
        .option("maxFilesPerTrigger", 2)
        .json(str(tmp_path / "ev"))
    )
    job = Job(spark, f"win{mode}", tmp_path / "state", checkpoint_interval=0)
    job.add_pipeline(
        "agg",
        src,
        [PostgresSink(pg_dsn, "windows", key=["window_start"])],  # windows are re-emitted
        bounded=True,
        transform=windowed,
        event_time="ts",
        output_mode=mode,
    )
    result = job.run()
    assert result.committed and result.pipelines == {"agg": PipelineState.FINISHED}
    assert window_rows(pg_dsn) == expected_windows(range(200))  # and no window at 9999


def test_three_pipelines_share_one_final_checkpoint(  # type: ignore[no-untyped-def]
    spark, pg_dsn, kafka_bootstrap, kafka_topic, tmp_path
):
    """Three bounded pipelines of very different sizes, to PostgreSQL, Kafka and
    Delta: one final checkpoint commits the rest of all of them together."""
    topic = kafka_topic(3)
    delta = tmp_path / "delta"
    sizes = {"small": (1, 40), "medium": (3, 400), "large": (8, 1500)}
    create_tables(pg_dsn, "small")
    sinks = {
        "small": PostgresSink(pg_dsn, "small"),
        "medium": KafkaSink(kafka_bootstrap, topic, key="id"),
        "large": DeltaSink(str(delta)),
    }
    job = Job(spark, "three", tmp_path / "state", checkpoint_interval=30)
    n = {}
    for name, (files, per) in sizes.items():
        n[name] = write_input(tmp_path / name, files, per, start=0)
        src = (
            spark.readStream.schema("id long, name string, amount double")
            .option("maxFilesPerTrigger", 1)
            .json(str(tmp_path / name))
        )
        job.add_pipeline(name, src, [sinks[name]], bounded=True)
    result = job.run()
    assert result.committed and result.final_checkpoint is not None
    assert result.end_of_input_to_exit is not None and result.end_of_input_to_exit < 30
    print(f"end of input to exit: {result.end_of_input_to_exit:.2f} s")
    assert_exactly_once(pg_dsn, "small", n["small"])
    kafka_exactly_once(kafka_bootstrap, topic, n["medium"])
    assert_nothing_open(kafka_bootstrap, topic, "three")
    ids = sorted(DeltaTable(str(delta)).to_pyarrow_table(columns=["id"])["id"].to_pylist())
    assert ids == list(range(n["large"]))
    doc = read_ledger(tmp_path / "state")
    assert doc is not None
    assert [cp["kind"] for cp in doc["history"]] == ["final"], doc["history"]
    final = doc["history"][0]
    # the interval is 30 s: everything went into the one shared final checkpoint
    assert final["finished"] == sorted(sizes) and set(final["cut"]) == set(sizes)
    assert sorted(final["rows"].values()) == sorted(n.values())
    assert job_prepared(pg_dsn, "three") == []


def test_per_pipeline_final_checkpoints_for_comparison(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    create_tables(pg_dsn, "a", "b")
    job = Job(
        spark,
        "cascade",
        tmp_path / "state",
        checkpoint_interval=30,
        final_checkpoint="per-pipeline",
    )
    for name in ("a", "b"):
        write_input(tmp_path / name, 2, 100)
        src = spark.readStream.schema("id long, name string, amount double").json(
            str(tmp_path / name)
        )
        job.add_pipeline(name, src, [PostgresSink(pg_dsn, name)], bounded=True)
    result = job.run()
    assert result.committed
    assert ledger_kinds(tmp_path / "state") == ["final", "final"]
    for name in ("a", "b"):
        assert_exactly_once(pg_dsn, name, 200)


def unbounded_windowed_job(spark, dsn: str, tmp_path: Path, name: str) -> Job:  # type: ignore[no-untyped-def]
    """Job ``name``: an unbounded pipeline ``agg`` of event windows from
    ``tmp_path/ev`` into the PostgreSQL table ``windows``."""
    src = spark.readStream.schema(EVENT_SCHEMA).json(str(tmp_path / "ev"))
    job = Job(spark, name, tmp_path / "state", checkpoint_interval=0.5)
    job.add_pipeline(
        "agg",
        src,
        [PostgresSink(dsn, "windows")],
        bounded=False,
        trigger_interval=0.5,
        transform=windowed,
        event_time="ts",
    )
    return job


def test_savepoint_keeps_windows_open_and_resume_drains_them(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """stop() without drain: complete batches commit, open windows stay in state.
    Running again resumes; stop(drain=True) then emits every window exactly once."""
    create_tables(pg_dsn, windows=True)
    write_events(tmp_path / "ev", 0, 100, files=2)

    first = run_until(
        unbounded_windowed_job(spark, pg_dsn, tmp_path, "save"),
        lambda: len(window_rows(pg_dsn)) >= 4,
        drain=False,
    )
    assert first.stopped and first.committed
    assert first.pipelines == {"agg": PipelineState.STOPPED}
    seen = window_rows(pg_dsn)
    all_windows = expected_windows(range(100))
    last = max(all_windows)
    assert last not in seen  # the last window is still open in Spark state
    assert ledger_kinds(tmp_path / "state")[-1] == "savepoint"

    write_events(tmp_path / "ev", 100, 60, files=1)  # more input while stopped
    second = run_until(
        unbounded_windowed_job(spark, pg_dsn, tmp_path, "save"), lambda: True, drain=True
    )
    assert second.drained and second.committed
    assert window_rows(pg_dsn) == expected_windows(range(160))
    assert ledger_kinds(tmp_path / "state")[-1] == "final"
    assert job_prepared(pg_dsn, "save") == []


def test_a_savepoint_of_the_file_marker_version_resumes(  # type: ignore[no-untyped-def]
    spark, pg_dsn, tmp_path, monkeypatch
):
    """Versions before the marker source fed the marker from a file stream
    source on ``<pipeline>/end_of_input/`` at the same place of the union. A
    savepoint taken by such a version resumes with the marker source: Spark
    hands it the file source's offset, and the drain emits every window once."""
    create_tables(pg_dsn, windows=True)
    write_events(tmp_path / "ev", 0, 100, files=2)

    def file_marker_dataframe(self: Pipeline) -> DataFrame:  # the former _dataframe
        eoi = Path(self.store.uri(f"{self.location}/end_of_input"))
        eoi.mkdir(parents=True, exist_ok=True)
        marker = self.source.sparkSession.readStream.schema(self.source.schema).json(str(eoi))
        return self._output(self.source.unionByName(marker))

    with monkeypatch.context() as m:
        m.setattr(Pipeline, "query_dataframe", file_marker_dataframe)
        first = run_until(
            unbounded_windowed_job(spark, pg_dsn, tmp_path, "upgrade"),
            lambda: len(window_rows(pg_dsn)) >= 4,
            drain=False,
        )
    assert first.stopped and first.committed
    assert max(expected_windows(range(100))) not in window_rows(pg_dsn)  # still in state
    location = tmp_path / "state" / "pipelines" / "agg"
    sources = location / "spark" / "offsets"
    last = max((p for p in sources.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert last.read_text().splitlines()[-1] in ("-", '{"logOffset":-1}')  # the file source's

    write_events(tmp_path / "ev", 100, 60, files=1)
    second = run_until(
        unbounded_windowed_job(spark, pg_dsn, tmp_path, "upgrade"), lambda: True, drain=True
    )
    assert second.drained and second.committed
    assert window_rows(pg_dsn) == expected_windows(range(160))
    assert ledger_kinds(tmp_path / "state")[-1] == "final"
    assert list((location / "end_of_input").iterdir()) == []  # the new version wrote nothing
    assert job_prepared(pg_dsn, "upgrade") == []


# -- driver processes --------------------------------------------------------------------


def _args(dsn: str, state: Path, *pipelines: str, interval: float = 1.0) -> list[str]:
    args = ["--dsn", dsn, "--state", str(state), "--interval", str(interval)]
    for p in pipelines:
        args += ["--pipeline", p]
    return args


@pytest.mark.crash
def test_mixed_job_finished_pipeline_is_not_rerun_after_a_crash(pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    n_load = write_input(tmp_path / "load", 3, 100)
    n_live = write_input(tmp_path / "live", 2, 100, start=10_000)
    create_tables(pg_dsn, "load_t", "live_t")
    state = tmp_path / "state"
    args = _args(
        pg_dsn,
        state,
        f"name=load,input={tmp_path / 'load'},table=load_t,kind=bounded",
        f"name=live,input={tmp_path / 'live'},table=live_t,kind=unbounded",
    )
    job = JobProcess("lifecycle_job.py", args, tmp_path / "job.log")
    try:
        # the bounded pipeline finishes and is recorded as finished by a checkpoint
        wait_for(
            lambda: "load" in ((read_ledger(state) or {}).get("finished") or []),
            180,
            "the bounded pipeline to be recorded as finished",
            job,
        )
        # ... while the unbounded one goes on checkpointing new input
        n_live += write_input(tmp_path / "live", 1, 50, start=20_000)
        wait_for(lambda: _count(pg_dsn, "live_t") == n_live, 120, "the live pipeline", job)
        # input the finished pipeline must never read: a re-run would write it
        write_input(tmp_path / "load", 1, 7, start=30_000)
        job.proc.send_signal(signal.SIGKILL)
        assert job.wait() == -signal.SIGKILL
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    again = JobProcess("lifecycle_job.py", args, tmp_path / "job.log")
    wait_for(lambda: (read_ledger(state) or {}).get("run") == 2, 120, "the restart", again)
    n_live += write_input(tmp_path / "live", 1, 30, start=40_000)
    wait_for(lambda: _count(pg_dsn, "live_t") == n_live, 120, "the live pipeline", again)
    stop = twophase("stop", "--drain", str(state))
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert again.wait(120) == 0, again.tail()
    assert "pipeline load finished in an earlier run: not run again" in again.output()
    assert_exactly_once(pg_dsn, "load_t", n_load)
    with psycopg.connect(pg_dsn) as c:
        ids = [r[0] for r in c.execute("SELECT id FROM live_t")]
    assert len(ids) == len(set(ids)) == n_live
    assert job_prepared(pg_dsn, "life") == []


@pytest.mark.crash
def test_crash_in_the_middle_of_the_final_checkpoint(pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    n = {name: write_input(tmp_path / name, 2, 120) for name in ("a", "b")}
    create_tables(pg_dsn, "a", "b")
    state = tmp_path / "state"
    args = _args(
        pg_dsn,
        state,
        *(f"name={p},input={tmp_path / p},table={p},kind=bounded" for p in ("a", "b")),
        interval=60,
    )
    first = run_job("lifecycle_job.py", args, tmp_path / "job.log", fault="driver.mid_commit=kill")
    assert first.proc.returncode == -signal.SIGKILL, first.tail()
    doc = read_ledger(state)
    assert doc is not None and doc["decided"]["kind"] == "final"  # decided, half committed
    second = run_job("lifecycle_job.py", args, tmp_path / "job.log")
    assert second.proc.returncode == 0, second.tail()
    assert second.result()["committed"] is True
    for p in ("a", "b"):
        assert_exactly_once(pg_dsn, p, n[p])
    assert ledger_kinds(state).count("final") == 1
    assert job_prepared(pg_dsn, "life") == []


@pytest.mark.crash
def test_sigterm_drains_and_exits_zero(pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    n = write_input(tmp_path / "live", 4, 100)
    create_tables(pg_dsn, "live_t")
    state = tmp_path / "state"
    args = _args(pg_dsn, state, f"name=live,input={tmp_path / 'live'},table=live_t,kind=unbounded")
    job = JobProcess("lifecycle_job.py", args, tmp_path / "job.log")
    wait_for(lambda: _count(pg_dsn, "live_t") > 0, 180, "a first commit", job)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(120) == 0, job.tail()
    result = job.result()
    assert result["drained"] and result["committed"]
    assert result["pipelines"] == {"live": "FINISHED"}
    assert_exactly_once(pg_dsn, "live_t", n)
    assert ledger_kinds(state)[-1] == "final"
    assert job_prepared(pg_dsn, "life") == []


@pytest.mark.crash
@tiers.SLOW
def test_drain_while_a_batch_is_prepared_in_flight(pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """SIGTERM while batch 1's tasks hold prepared transactions (stalled after
    PREPARE): the drain stops the query and restarts it available-now, which
    replays batch 1 in the same run. The interrupted attempt's prepared rows must
    not block the replay on the table's primary key, nor be committed."""
    n = write_input(tmp_path / "live", 4, 100)
    create_tables(pg_dsn, "live_t")
    state = tmp_path / "state"
    args = _args(pg_dsn, state, f"name=live,input={tmp_path / 'live'},table=live_t,kind=unbounded")
    args += ["--stop-grace", "1"]  # shorter than the stall: the drain interrupts the batch
    job = JobProcess("lifecycle_job.py", args, tmp_path / "job.log", "executor.prepared@1=stall:8")
    wait_for(lambda: [g for g in job_prepared(pg_dsn, "life") if ".b1." in g], 180, "batch 1", job)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(120) == 0, job.tail()
    assert "interrupting the micro-batch in flight" in job.output()
    result = job.result()
    assert result["drained"] and result["committed"]
    assert_exactly_once(pg_dsn, "live_t", n)
    assert ledger_kinds(state)[-1] == "final"
    assert job_prepared(pg_dsn, "life") == []


@pytest.mark.crash
def test_crash_during_a_drain_resumes_the_drain(pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """SIGTERM starts a drain; the driver is SIGKILLed right after the pipeline
    recorded that its input ends. Started again (no stop asked), the job resumes
    the drain instead of reading on: it ends with one final checkpoint, exit 0,
    every row exactly once, even a file that arrived after the crash (the drain
    processes what is available when it runs)."""
    n = write_input(tmp_path / "live", 4, 100)
    create_tables(pg_dsn, "live_t")
    state = tmp_path / "state"
    args = _args(pg_dsn, state, f"name=live,input={tmp_path / 'live'},table=live_t,kind=unbounded")
    log = tmp_path / "job.log"
    job = JobProcess("lifecycle_job.py", args, log, "driver.ending_input=kill")
    wait_for(lambda: _count(pg_dsn, "live_t") > 0, 180, "a first commit", job)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(120) == -signal.SIGKILL, job.tail()
    assert (state / "pipelines" / "live" / "ending_input.json").exists()
    n += write_input(tmp_path / "live", 1, 50, start=n)
    again = run_job("lifecycle_job.py", args, log)
    assert again.proc.returncode == 0, again.tail()
    assert "was ending its input: resuming that" in again.output()
    result = again.result()
    assert result["committed"] and result["pipelines"] == {"live": "FINISHED"}
    assert_exactly_once(pg_dsn, "live_t", n)
    assert ledger_kinds(state)[-1] == "final"
    assert job_prepared(pg_dsn, "life") == []


@pytest.mark.crash
@pytest.mark.parametrize(
    "fault",
    [
        pytest.param("driver.ending_input=kill", id="before the end-of-input query", marks=SLOW),
        pytest.param(
            "driver.before_record_ending_input=kill", id="in the batch carrying the marker"
        ),
    ],
)
def test_crash_while_ending_windowed_input_resumes_and_flushes(pg_dsn, tmp_path, fault):  # type: ignore[no-untyped-def]
    """A bounded windowed pipeline consumed its input and recorded
    that it ends; the driver is SIGKILLed before the end-of-input query ran, or
    in the first batch of that query, which carries the marker, before it was
    recorded (Spark then replays that batch from its offset log, with nothing
    prefetched: the source must still answer from the driver's side). The restart (a new driver
    process, new Python workers) feeds the marker from the driver's flag alone
    and emits every window exactly once; no end_of_input/ file exists."""
    write_events(tmp_path / "ev", 0, 200, files=4)
    create_tables(pg_dsn, windows=True)
    state = tmp_path / "state"
    args = _args(pg_dsn, state, f"name=agg,input={tmp_path / 'ev'},table=windows,kind=windowed")
    log = tmp_path / "job.log"
    first = run_job("lifecycle_job.py", args, log, fault=fault)
    assert first.proc.returncode == -signal.SIGKILL, first.tail()
    location = state / "pipelines" / "agg"
    assert (location / "ending_input.json").exists()
    assert max(expected_windows(range(200))) not in window_rows(pg_dsn)  # still in state
    again = run_job("lifecycle_job.py", args, log)
    assert again.proc.returncode == 0, again.tail()
    assert "was ending its input: resuming that" in again.output()
    assert again.result()["pipelines"] == {"agg": "FINISHED"}
    assert window_rows(pg_dsn) == expected_windows(range(200))
    assert sorted(p.name for p in location.iterdir()) == ["ending_input.json", "spark"]
    assert ledger_kinds(state)[-1] == "final"
    assert job_prepared(pg_dsn, "life") == []


def test_twophase_stop_without_a_running_job_says_so(tmp_path: Path) -> None:
    proc = twophase("stop", str(tmp_path))
    assert proc.returncode == 2 and "no job is running" in proc.stderr


def _count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as c:
        return int(c.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
