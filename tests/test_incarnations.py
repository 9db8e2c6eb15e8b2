"""State that outlives the host: incarnations, sink-side progress and claims.

Each measured failure of the issue becomes a test here:

* a job whose state_dir is lost runs again over the same targets: it refuses
  before any data moves (before: PostgreSQL and Kafka received rows a second
  time, then every start failed);
* the operator starts over deliberately; the old state, restored later, refuses;
* Spark's ``commits/N`` is lost: the replayed batch is recognised by its
  offsets and not committed again (before: committed twice);
* two jobs of one name, with their own state_dirs, writing one PostgreSQL server
  at once never touch each other's work; two claiming one target at the same
  instant: exactly one wins.
"""

from __future__ import annotations

import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from lifecycle.ledger import read_ledger
from sinks.base import JobScope
from sinks.delta import DeltaSink
from sinks.delta.storage import TableStorage
from sinks.postgres import PostgresSink
from sinks.progress import IncarnationConflictError, SinkProgress
from tests import deltacheck, tiers
from tests.conftest import write_input
from tests.jobs.multi_sink_job import SINK_IDS
from tests.kafkacheck import assert_exactly_once as kafka_exactly_once
from tests.multisink import Run
from tests.pgcheck import assert_exactly_once, job_prepared


def _create(dsn: str, table: str = "orders") -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            f"CREATE TABLE {table} (id bigint PRIMARY KEY, name text, amount float8, part bigint)"
        )


def _pg_count(dsn: str, table: str = "orders") -> int:
    with psycopg.connect(dsn) as c:
        return int(c.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


@pytest.mark.crash
def test_lost_state_refuses_start_over_is_explicit_and_the_old_state_then_refuses(
    pg_dsn: str, kafka_bootstrap: str, kafka_topic: Callable[[int], str], tmp_path: Path
) -> None:
    """The measured failure: 600 rows to PostgreSQL, Kafka and Delta, exit 0, state
    lost, the same job again: it used to write 200 rows twice to PostgreSQL and
    Kafka, then fail at every start."""
    n = write_input(tmp_path / "in", files=3, rows_per_file=200)
    _create(pg_dsn)
    topic = kafka_topic(3)
    run = Run(tmp_path, pg_dsn, kafka_bootstrap, topic)
    assert run.start().proc.returncode == 0
    run.check(n)
    old = read_ledger(run.state)
    assert old is not None
    versions = len(deltacheck.versions(run.delta))
    saved = tmp_path / "saved-state"
    shutil.copytree(run.state, saved)

    # the state is lost; the same job runs again over the same targets
    shutil.rmtree(run.state)
    again = run.start()
    assert again.proc.returncode not in (0, -signal.SIGKILL), again.tail()
    out = again.output()
    assert f"from incarnation {old['incarnation']}" in out, again.tail()
    assert "Nothing was written" in out and "start_over_from=" in out
    assert_exactly_once(pg_dsn, "orders", n)  # nothing moved
    kafka_exactly_once(kafka_bootstrap, topic, n)
    assert job_prepared(pg_dsn, run.job) == []
    deltacheck.assert_exactly_once(str(run.delta), n)
    deltacheck.assert_nothing_staged(str(run.delta))
    assert len(deltacheck.versions(run.delta)) == versions  # not even a claim
    refused = read_ledger(run.state)
    assert refused is not None and refused["history"] == [] and refused["totals"] == {}

    # starting over deliberately, with new input (the old rows stay committed)
    m = write_input(tmp_path / "in2", files=2, rows_per_file=200, start=n)
    over = run.start(
        extra=["--input", str(tmp_path / "in2"), "--start-over-from", old["incarnation"]]
    )
    assert over.proc.returncode == 0, over.tail()
    assert_exactly_once(pg_dsn, "orders", n + m)
    kafka_exactly_once(kafka_bootstrap, topic, n + m)
    deltacheck.assert_exactly_once(str(run.delta), n + m)
    deltacheck.assert_nothing_staged(str(run.delta))
    new = read_ledger(run.state)
    assert new is not None and new["incarnation"] != old["incarnation"]
    pg = PostgresSink(pg_dsn, "orders", sink_id=SINK_IDS["pg"])
    scope = JobScope(run.job, "load", SINK_IDS["pg"], new["incarnation"])
    found = pg.committer().progress(scope)
    assert found == SinkProgress(owner=new["incarnation"], batch=1, previous=old["incarnation"])

    # the old state comes back (a restored backup, a second copy): it refuses
    shutil.rmtree(run.state)
    shutil.copytree(saved, run.state)
    third = run.start(extra=["--input", str(tmp_path / "in2")])
    assert third.proc.returncode not in (0, -signal.SIGKILL), third.tail()
    assert f"from incarnation {new['incarnation']}" in third.output()
    assert_exactly_once(pg_dsn, "orders", n + m)
    kafka_exactly_once(kafka_bootstrap, topic, n + m)
    deltacheck.assert_exactly_once(str(run.delta), n + m)


@pytest.mark.crash
@tiers.SLOW
def test_a_lost_spark_commit_entry_replays_a_batch_recognised_as_done(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Spark's ``commits/N`` is written without an fsync: after a host crash it
    can be gone while the batch is committed. Spark replays N; the coordinator
    recognises it (same offsets) and commits it no second time."""
    n = write_input(tmp_path / "in", files=4, rows_per_file=100)
    _create(pg_dsn)
    run = Run(tmp_path, pg_dsn, None, None, sinks="delta,pg")
    first = run.start(fault="driver.before_record@2=kill")
    assert first.killed(), first.tail()
    doc = read_ledger(run.state)
    assert doc is not None
    cut = max(cp["cut"].get("load", -1) for cp in doc["history"])
    assert cut >= 0, doc["history"]
    spark = run.state / "pipelines" / "load" / "spark"
    # a host crash loses the entry of the last completed batch (and the plan of
    # the one after it, written later): Spark then replays that batch
    for f in [spark / "commits" / str(cut), spark / "commits" / f".{cut}.crc"]:
        f.unlink()
    for f in (spark / "offsets").iterdir():
        batch = f.name.removeprefix(".").removesuffix(".crc")
        if batch.isdigit() and int(batch) > cut:
            f.unlink()
    second = run.start()
    assert second.proc.returncode == 0, second.tail()
    assert "recognised as done" in second.output()
    run.check(n)


def _race(sinks: list[PostgresSink] | list[DeltaSink]) -> tuple[list[str], list[str]]:
    """Two sinks claim one scope for two incarnations at the same instant:
    (incarnations that won, owners named by the refusals)."""
    go = threading.Barrier(len(sinks))
    won: list[str] = []
    lost: list[str] = []

    def claim(s: PostgresSink | DeltaSink, inc: str) -> None:
        go.wait()
        try:
            s.committer().claim(JobScope("twin", "p", "o", inc))
            won.append(inc)
        except IncarnationConflictError as e:
            lost.append(e.owner)

    incs = ["aaaaaaaaaaaa", "bbbbbbbbbbbb"]
    threads = [threading.Thread(target=claim, args=a) for a in zip(sinks, incs, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, lost


def test_two_claims_at_the_same_instant_exactly_one_wins(pg_dsn: str, tmp_path: Path) -> None:
    _create(pg_dsn)
    schema = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64())])
    pg = [PostgresSink(pg_dsn, "orders", sink_id="o") for _ in range(2)]
    delta = [DeltaSink(str(tmp_path / "orders"), sink_id="o") for _ in range(2)]
    for sinks in (pg, delta):
        for s in sinks:
            s.preflight(schema)
        won, lost = _race(sinks)
        assert len(won) == 1 and lost == won, (won, lost)
        assert sinks[0].committer().progress(JobScope("twin", "p", "o", won[0])).owner == won[0]


@pytest.mark.crash
@tiers.SLOW
def test_two_jobs_of_one_name_on_one_server_never_touch_each_others_work(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Same job name, pipeline and sink id, two state_dirs (two incarnations),
    two tables of one PostgreSQL server, at once: both commit exactly once, and
    neither sweeps the other's prepared transactions."""
    runs = []
    for name in ("a", "b"):
        write_input(tmp_path / name / "in", files=4, rows_per_file=100)
        _create(pg_dsn, f"orders_{name}")
        run = Run(tmp_path / name, pg_dsn, None, None, sinks="pg")
        run.job = "twin"
        runs.append(run)
    procs = [
        r.start(wait=False, files_per_batch=1, extra=["--table", f"orders_{n}"])
        for r, n in zip(runs, "ab", strict=True)
    ]
    for p in procs:
        p.wait(300)
        assert p.proc.returncode == 0, p.tail()
    for n in "ab":
        assert_exactly_once(pg_dsn, f"orders_{n}", 400)
    assert job_prepared(pg_dsn, "twin") == []
    a, b = (read_ledger(r.state) for r in runs)
    assert a and b and a["incarnation"] != b["incarnation"]


def test_staged_files_are_created_exclusively(tmp_path: Path) -> None:
    storage = TableStorage(str(tmp_path))
    storage.put("part-a", b"committed rows")
    with pytest.raises(FileExistsError):
        storage.put("part-a", b"another incarnation's rows")
    with pytest.raises(FileExistsError):
        storage.open_output("part-a")
    assert (tmp_path / "part-a").read_bytes() == b"committed rows"


def test_a_name_parses_only_with_an_incarnation_of_twelve_hex_digits() -> None:
    """Every version that wrote ``tp2.`` names made the incarnation 12 lowercase
    hex digits (``new_incarnation``): a name with any other length was written
    by none, so it is not one of ours (``parse`` says None, ``require`` raises);
    ``tp1.`` names, which have none, still parse."""
    from lifecycle.state.protocol import new_incarnation
    from sinks.naming import TxnName

    for inc in ("0123456789ab", new_incarnation()):
        text = f"tp2.j.p.s.i{inc}.r1.b2.p3.a4"
        assert TxnName.parse(text) == TxnName("j", "p", "s", 1, 2, 3, 4, inc)
        assert str(TxnName.require(text)) == text
    for inc in ("0", "abc", "0123456789a", "0123456789abc", "0123456789ab0123456789ab"):
        text = f"tp2.j.p.s.i{inc}.r1.b2.p3.a4"
        assert TxnName.parse(text) is None, text
        with pytest.raises(ValueError, match="not a transaction name of this project"):
            TxnName.require(text)
    assert TxnName.parse("tp1.j.p.s.r1.b2.p3.a4") == TxnName("j", "p", "s", 1, 2, 3, 4)
