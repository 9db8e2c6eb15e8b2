"""Operating a job: its Prometheus metrics (scraped from the endpoint while it
runs), its heartbeat and ``twophase status`` (running, finished, failed, lost,
stuck, pending), and the progress of bounded pipelines."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lifecycle import Job, heartbeat
from lifecycle import status as status_view
from lifecycle.cli import main as twophase
from lifecycle.ledger import read_ledger
from lifecycle.metrics import JobMetrics
from lifecycle.state.store import LocalStore
from sinks import KafkaSink, PostgresSink, _faults
from tests.conftest import write_input
from tests.kafkacheck import assert_exactly_once as kafka_exactly_once
from tests.pgcheck import assert_exactly_once
from tests.procs import wait_for
from tests.test_lifecycle import create_tables

SCHEMA = "id long, name string, amount double"


def _scrape(address: tuple[str, int]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    host, port = address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Any, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    if isinstance(samples, list):  # Job.metrics()
        return sum(
            s.value for s in samples if s.name == name and labels.items() <= dict(s.labels).items()
        )
    return sum(
        v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()
    )


def test_metrics_scraped_during_a_run_and_read_after_it(  # type: ignore[no-untyped-def]
    spark, pg_dsn, kafka_bootstrap, kafka_topic, tmp_path
):
    """An unbounded pipeline to PostgreSQL and Kafka, with the endpoint on: a scrape
    while it runs shows checkpoints, rows and bytes committed, the Kafka
    transaction timeout, the state; after a drain, ``job.metrics()`` counts every
    row exactly once and the endpoint is gone."""
    create_tables(pg_dsn, "out")
    topic = kafka_topic(2)
    src_dir = tmp_path / "in"
    n = write_input(src_dir, 3, 50)
    src = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(src_dir))
    job = Job(spark, "metered", tmp_path / "state", checkpoint_interval=0.5, metrics_port=0)
    job.add_pipeline(
        "live",
        src,
        [
            PostgresSink(pg_dsn, "out", sink_id="pg"),
            KafkaSink(kafka_bootstrap, topic, key="id", sink_id="kafka"),
        ],
        trigger_interval=0.3,
    )
    box: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: box.update(result=job.run(handle_signals=False)))
    runner.start()
    try:
        wait_for(lambda: job.metrics_address is not None, 60, "the metrics endpoint")
        address = job.metrics_address
        assert address is not None and address[0] == "127.0.0.1"  # loopback unless told
        wait_for(
            lambda: _value(_scrape(address), "twophase_rows_committed_total", sink="pg") >= n,
            120,
            "the input to be committed",
        )
        scraped = _scrape(address)
        assert _value(scraped, "twophase_checkpoints_completed_total", kind="periodic") >= 1
        assert _value(scraped, "twophase_checkpoint_duration_seconds_count", job="metered") >= 1
        assert _value(scraped, "twophase_bytes_committed_total", pipeline="live", sink="pg") > 0
        assert _value(scraped, "twophase_bytes_committed_total", sink="kafka") > 0
        assert _value(scraped, "twophase_job_state", state="running") == 1
        assert _value(scraped, "twophase_job_state", state="finished") == 0
        assert _value(scraped, "twophase_pipeline_state", pipeline="live", state="RUNNING") == 1
        assert _value(scraped, "twophase_kafka_transaction_timeout_seconds", sink="kafka") == 900
        assert _value(scraped, "twophase_seconds_since_last_checkpoint") < 60
        assert _value(scraped, "twophase_last_checkpoint_timestamp_seconds") > time.time() - 120
        assert (
            "twophase_batches_pending",
            frozenset({("job", "metered"), ("pipeline", "live")}),
        ) in scraped
        # the heartbeat says running, and so does the status
        beat = heartbeat.read(LocalStore(tmp_path / "state"))
        assert beat is not None and beat["state"] == "running" and beat["job"] == "metered"
        doc = read_ledger(tmp_path / "state")
        assert doc is not None
        found = status_view.job_status(doc, beat)
        assert found["alive"] and found["state"] == "running" and found["exit_code"] == 0
        job.stop(drain=True)
        # Scraped during the run, the endpoint stays up at the end until one more
        # scrape has read the final state (metrics_linger): no work is pending in it.
        final = scraped
        while runner.is_alive() and _value(final, "twophase_job_state", state="finished") != 1:
            final = _scrape(address)
        assert _value(final, "twophase_job_state", state="finished") == 1
        assert _value(final, "twophase_committables_pending", pipeline="live") == 0
        runner.join(10)  # at once after that scrape, not at the end of the linger (15 s)
        assert not runner.is_alive()
    finally:
        job.stop(drain=False)
        runner.join(120)
    assert box["result"].committed
    assert_exactly_once(pg_dsn, "out", n)
    kafka_exactly_once(kafka_bootstrap, topic, n)
    after = job.metrics()
    assert _value(after, "twophase_rows_committed_total", sink="pg") == n
    assert _value(after, "twophase_rows_committed_total", sink="kafka") == n
    assert _value(after, "twophase_rows_prepared_total", sink="pg") == n
    assert _value(after, "twophase_checkpoints_completed_total", kind="final") == 1
    assert _value(after, "twophase_prepared_transactions_open") == 0
    assert _value(after, "twophase_kafka_oldest_transaction_age_seconds") == 0
    assert _value(after, "twophase_job_state", state="finished") == 1
    assert _value(after, "twophase_final_checkpoint_timestamp_seconds") > 0
    assert _value(after, "twophase_end_of_input_timestamp_seconds", pipeline="live") > 0
    with pytest.raises(urllib.error.URLError):
        _scrape(address)  # served while the job runs only
    beat = heartbeat.read(LocalStore(tmp_path / "state"))
    assert beat is not None and beat["state"] == "finished" and "ended_at" in beat
    assert twophase(["status", str(tmp_path / "state")]) == 0


def test_each_job_has_its_own_registry() -> None:
    a, b = JobMetrics("a"), JobMetrics("a")  # no "duplicated timeseries" between jobs
    a.prepared("p", {"s": [{"rows": 3}]})
    assert _value(a.samples(), "twophase_rows_prepared_total") == 3
    assert _value(b.samples(), "twophase_rows_prepared_total") == 0


def test_a_failed_run_then_its_recovery(spark, pg_dsn, tmp_path, capsys):  # type: ignore[no-untyped-def]
    """A checkpoint decided but not committed (the commit raises): the heartbeat
    says failed, ``twophase status`` exits 4 and shows the commit in progress; the
    next run finishes it, counted as a recovery action ``commit_decided``, and the
    status is healthy again."""
    create_tables(pg_dsn, "out")
    src_dir = tmp_path / "in"
    n = write_input(src_dir, 2, 20)
    state = tmp_path / "state"

    def job() -> Job:
        j = Job(spark, "fails", state, checkpoint_interval=30, progress="off")
        src = spark.readStream.schema(SCHEMA).json(str(src_dir))
        j.add_pipeline("load", src, [PostgresSink(pg_dsn, "out")], bounded=True)
        return j

    def boom() -> None:
        raise RuntimeError("injected: the commit fails")

    _faults.register("driver.before_commit", boom)
    first = job()
    with pytest.raises(RuntimeError, match="injected"):
        first.run(handle_signals=False)
    assert _value(first.metrics(), "twophase_job_state", state="failed") == 1
    beat = heartbeat.read(LocalStore(state))
    assert beat is not None and beat["state"] == "failed" and "injected" in beat["error"]
    assert twophase(["status", str(state)]) == 4
    out = capsys.readouterr().out
    assert "state: FAILED" in out and "COMMIT IN PROGRESS" in out and "health: failed" in out
    assert twophase(["status", "--json", str(state)]) == 4
    found = json.loads(capsys.readouterr().out)
    assert found["schema"] == "twophase.status/1" and found["decided"]["kind"] == "final"
    assert found["pipelines"]["load"]["pending_rows"] == n

    second = job()
    result = second.run(handle_signals=False)
    assert result.committed
    assert_exactly_once(pg_dsn, "out", n)
    samples = second.metrics()
    assert _value(samples, "twophase_recovery_actions_total", rule="commit_decided") >= 1
    assert _value(samples, "twophase_checkpoints_completed_total", kind="final") == 1
    assert twophase(["status", str(state)]) == 0
    assert "state: FINISHED" in capsys.readouterr().out


def _doc(pending_age: float | None = None, decided_age: float | None = None) -> dict[str, Any]:
    now = time.time()
    pending = {}
    if pending_age is not None:
        pending = {"p": {"3": {"s": [{"txn": "t", "rows": 5, "registered_at": now - pending_age}]}}}
    decided = None
    if decided_age is not None:
        decided = {"id": 4, "kind": "periodic", "cut": {"p": 3}, "decided_at": now - decided_age}
    return {
        "job": "j",
        "incarnation": "abc",
        "run": 2,
        "pending": pending,
        "decided": decided,
        "history": [
            {
                "id": 3,
                "kind": "periodic",
                "cut": {"p": 2},
                "committed_at": now - 5,
                "rows": {"p/s": 9},
            }
        ],
        "finished": [],
        "totals": {"p/s": 9},
        "committed_cut": {"p": 2},
    }


def _beat(state: str = "running", renewed_ago: float = 1.0, **extra: Any) -> dict[str, Any]:
    now = time.time()
    return {
        "job": "j",
        "incarnation": "abc",
        "pid": 1,  # alive on this host
        "host": "elsewhere",
        "state": state,
        "renewed_at": now - renewed_ago,
        "every_s": 5.0,
        "checkpoint_interval": 5.0,
        **extra,
    }


NONE = {"beat": None}


@pytest.mark.parametrize(
    ("doc", "beat", "state", "code"),
    [
        ({"pending_age": 2}, {}, "running", 0),
        ({"pending_age": 400}, {}, "running", 1),  # stuck: older than 300 s
        ({"decided_age": 400}, {}, "running", 1),  # a commit that does not end
        ({}, {"renewed_ago": 60}, "lost", 4),  # killed, nothing pending: it did not end
        ({"pending_age": 2}, {"renewed_ago": 60}, "lost", 3),  # killed with pending work
        ({"pending_age": 2}, {"state": "stopped", "ended_at": 1.0}, "stopped", 3),
        ({}, {"state": "finished", "ended_at": 1.0}, "finished", 0),
        ({}, {"state": "failed", "ended_at": 1.0, "error": "boom"}, "failed", 4),
        ({"pending_age": 2}, NONE, "unknown", 3),  # no heartbeat: an older version's run
        ({}, {"incarnation": "other"}, "unknown", 0),  # another state's heartbeat
    ],
)
def test_status_verdicts(doc: dict[str, Any], beat: dict[str, Any], state: str, code: int) -> None:
    ledger = _doc(**doc)
    found = status_view.job_status(ledger, None if beat is NONE else _beat(**beat))
    assert (found["state"], found["exit_code"]) == (state, code), found
    assert found["pipelines"]["p"]["last_committed_batch"] == 2
    assert found["pipelines"]["p"]["rows_committed"] == {"s": 9}
    assert "state:" in status_view.format_text(found, ledger)


def test_a_dead_job_reads_as_died_with_the_exit_code_its_pending_work_says() -> None:
    """A driver gone without a word (killed, as the demo does): the text says
    DIED, and the health line what the exit code means: 3 when work waits for
    the next start, 4 when nothing does. The JSON keeps its word (``lost``,
    ``twophase.status/1``). The getting-started page quotes the demo's line
    for it as the command prints it."""
    for doc, code in ((_doc(), 4), (_doc(pending_age=2), 3)):
        found = status_view.job_status(doc, _beat(renewed_ago=60))
        assert found["schema"] == "twophase.status/1" and found["state"] == "lost"
        assert found["exit_code"] == code and not found["alive"]
        text = status_view.format_text(found, doc)
        assert "state: DIED (the heartbeat of pid 1 on elsewhere lapsed" in text, text
        assert "LOST" not in text, text
        assert f"health: {found['health']} (exit {code}: " in text, text
    died = status_view.job_status(_doc(), _beat(renewed_ago=60))
    line = status_view.summary(died)
    assert (
        line
        == "DIED, failed (exit 4: it died, and nothing waits for the next start: start it again)"
    )
    waiting = status_view.job_status(_doc(pending_age=2), _beat(renewed_ago=60))
    assert status_view.summary(waiting) == (
        "DIED, pending (exit 3: not running, and work waits for the next start)"
    )
    page = (Path(__file__).resolve().parent.parent / "docs" / "getting-started.md").read_text()
    assert f"`twophase status: {line}`" in " ".join(page.split()), "the page quotes another line"


def test_status_stuck_after_is_the_operators_choice() -> None:
    assert status_view.job_status(_doc(pending_age=30), _beat(), stuck_after=10)["exit_code"] == 1
    assert status_view.job_status(_doc(pending_age=30), _beat(), stuck_after=60)["exit_code"] == 0


def test_a_dead_pid_on_this_host_is_lost_at_once(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = {"host": socket.gethostname(), "machine": heartbeat.machine()}
    found = status_view.job_status(_doc(), _beat(pid=gone.pid, **here))
    assert found["state"] == "lost" and "is gone" in found["why"]
    # the same host name in another pid namespace (a container): its pids are not ours
    elsewhere = {**here, "machine": "another-boot pid:[1]"}
    found = status_view.job_status(_doc(), _beat(pid=gone.pid, **elsewhere))
    assert found["state"] == "running", found


def test_a_held_lock_outweighs_a_lapsed_heartbeat() -> None:
    lapsed = _beat(renewed_ago=120)
    assert status_view.job_status(_doc(), lapsed)["state"] == "lost"
    found = status_view.job_status(_doc(pending_age=2), lapsed, locked=True)
    assert found["state"] == "running" and found["exit_code"] == 0
    assert "holds the ledger's lock" in found["why"] and "lapsed" in found["why"]


def test_a_heartbeat_of_a_newer_schema_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A downgrade: the heartbeat was written by a newer twophase (schema 2),
    whose states and rules this one may not know; ``twophase status`` refuses it
    (exit 2, naming the schema and the file) rather than judge it. This
    version's heartbeat (schema 1) and one without a schema (the first
    versions') read as before."""
    from lifecycle.state.file_ledger import FileLedger
    from sinks.versions import NewerVersionError

    state = tmp_path / "state"
    led = FileLedger(state / "ledger", "j")
    led.close()
    store = LocalStore(state)
    beat = heartbeat.Heartbeat(store, {"job": "j"}, lambda: "running", every=60)
    beat.start()
    beat.end("finished")
    written = heartbeat.read(store)
    assert written is not None and written["schema"] == heartbeat.SCHEMA == 1
    assert twophase(["status", str(state)]) == 0
    assert "state: FINISHED" in capsys.readouterr().out
    path = state / heartbeat.PATH
    del written["schema"]
    path.write_text(json.dumps(written))
    assert heartbeat.read(store) == written
    assert twophase(["status", str(state)]) == 0
    capsys.readouterr()

    path.write_text(json.dumps({**written, "schema": 2, "state": "hibernating"}))
    with pytest.raises(NewerVersionError) as err:
        heartbeat.read(store)
    assert (err.value.version, err.value.known) == (2, 1)
    assert twophase(["status", str(state)]) == 2
    said = capsys.readouterr().err
    assert f"the heartbeat {path} is of version 2, written by a newer version" in said, said
    assert "reads versions up to 1" in said, said


def test_status_of_no_ledger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert twophase(["status", "--json", str(tmp_path / "none")]) == 2
    assert json.loads(capsys.readouterr().out)["health"] == "not_found"


def test_progress_is_in_the_checkpoint_lines_off_a_terminal(  # type: ignore[no-untyped-def]
    spark, pg_dsn, tmp_path, caplog
):
    """Not on a terminal, ``progress="auto"`` adds the progress of each bounded
    pipeline, with the share of ``expected_rows`` done, to the one line each
    checkpoint logs."""
    create_tables(pg_dsn, "out")
    src_dir = tmp_path / "in"
    n = write_input(src_dir, 4, 25)
    caplog.set_level(logging.INFO, logger="lifecycle")
    job = Job(spark, "progress", tmp_path / "state", checkpoint_interval=0)
    src = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(src_dir))
    job.add_pipeline("load", src, [PostgresSink(pg_dsn, "out")], bounded=True, expected_rows=n)
    assert job.run(handle_signals=False).committed
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint ")]
    assert lines, "no checkpoint line"
    assert "progress: load 25 of 100 rows (25%), 1 batch(es)" in lines[0], lines
    assert any("load 75 of 100 rows (75%)" in line for line in lines), lines
    assert "load 100 of 100 rows (100%)" in lines[-1], lines  # the final checkpoint


def test_progress_bars_on_a_stream(tmp_path: Path) -> None:
    """``progress="bar"`` draws a tqdm bar per pipeline on the stream it is given."""
    import io

    from lifecycle.progress import Counts, ProgressView, Tracked

    out = io.StringIO()
    view = ProgressView("bar", [Tracked("load", 1000), Tracked("other")], stream=out)
    view.update({"load": Counts(batches=2, rows_prepared=400, rows_committed=200)})
    view.close()
    text = out.getvalue()
    assert "load" in text and "400/1.00k" in text and "other" in text, text
    assert ProgressView("auto", [Tracked("x")], stream=io.StringIO()).mode == "log"
    assert ProgressView("bar", [], stream=io.StringIO()).mode == "off"


def test_status_watch_refreshes_until_interrupted(tmp_path: Path) -> None:
    """``--watch S`` prints the status again every S seconds; Ctrl-C ends it with
    the last status's exit code (2 here: no ledger yet, then one appears)."""
    import signal
    import subprocess
    import sys

    from lifecycle.ledger import open_ledger

    state = tmp_path / "state"
    watch = subprocess.Popen(
        [sys.executable, "-m", "lifecycle.cli", "status", "--watch", "0.3", str(state)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: dict[str, list[str]] = {"out": [], "err": []}

    def read(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    readers = [
        threading.Thread(target=read, args=(watch.stdout, seen["out"]), daemon=True),
        threading.Thread(target=read, args=(watch.stderr, seen["err"]), daemon=True),
    ]
    for r in readers:
        r.start()
    # the watch's own pace, not a sleep that a slow start (a loaded machine) outruns
    wait_for(lambda: sum("no ledger in" in x for x in seen["err"]) >= 2, 60, "no ledger, twice")
    ledger = open_ledger(None, state, "watched")
    ledger.begin_run()
    wait_for(lambda: sum("job watched" in x for x in seen["out"]) >= 2, 60, "the job, twice")
    watch.send_signal(signal.SIGINT)
    watch.wait(timeout=30)
    for r in readers:
        r.join(10)
    out, err = "".join(seen["out"]), "".join(seen["err"])
    ledger.close()
    assert out.count("Ctrl-C to stop") >= 4, out
    assert "no ledger in" in err and "job watched" in out, (out, err)
    assert watch.returncode == 0, (watch.returncode, out[-500:], err[-500:])
