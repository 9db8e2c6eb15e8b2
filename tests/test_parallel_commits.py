"""Commits in parallel: sinks of a checkpoint at once, a sink's transactions over
several connections, and the order and failure rules that must survive it.

The coordinator tests use sinks of our own protocol that record when they
commit (what is observed is the coordinator's scheduling); the PostgreSQL and
Kafka tests run against the real server and broker.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from lifecycle.coordinator import Coordinator
from lifecycle.errors import CheckpointCommitError
from lifecycle.job_sinks import PipelineSinks
from lifecycle.ledger import FileLedger
from lifecycle.spark_log import SparkCommitLog
from sinks import KafkaSink, PostgresSink, _faults
from sinks._parallel import slices
from sinks.base import REPAYS, Committable, JobScope, OrphanTest, WriteContext
from sinks.errors import ConfigError, TransactionLostError
from sinks.kafka.log import read_topic
from sinks.naming import TxnName
from tests.memory_sink import MemorySink
from tests.pgcheck import job_prepared

SCHEMA = pa.schema([("id", pa.int64())])


# -- the coordinator: sinks at once, one target at a time ---------------------------------


class TimedSink(MemorySink):
    """Records the interval of each of its commits; ``meet`` (a barrier shared
    with other sinks) makes a commit wait until the others' are under way."""

    kind = "timed"

    def __init__(
        self,
        sid: str,
        target: str,
        meet: threading.Barrier | None = None,
        fail: bool = False,
        sweep_meet: threading.Barrier | None = None,
    ) -> None:
        super().__init__(sid)
        self.target, self.meet, self.fail = target, meet, fail
        self.sweep_meet = sweep_meet
        self.commits: list[tuple[float, float, list[str]]] = []

    def describe(self) -> str:
        return self.target

    def commit(self, committables: Sequence[Committable]) -> None:
        start = time.monotonic()
        if self.meet is not None:
            self.meet.wait()  # BrokenBarrierError after its timeout: not concurrent
        time.sleep(0.2)
        if self.fail:
            raise TransactionLostError(f"{self.target}: lost on purpose")
        self.commits.append((start, time.monotonic(), [c["txn"] for c in committables]))

    def sweep(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        if self.sweep_meet is not None:
            self.sweep_meet.wait()
        return []


def _coordinator(tmp_path: Path, sinks: list[TimedSink]) -> tuple[Coordinator, FileLedger]:
    spark = tmp_path / "spark"
    (spark / "commits").mkdir(parents=True)
    (spark / "metadata").write_text("{}")
    (spark / "commits" / "0").write_text("v1\n{}")
    ledger = FileLedger(tmp_path / "ledger", "j")
    ledger.begin_run()
    coord = Coordinator(
        "j", ledger, [PipelineSinks("p", {s.sink_id: s for s in sinks}, SparkCommitLog(spark))]
    )
    names = {
        s.sink_id: str(TxnName("j", "p", s.sink_id, 1, 0, 0, 0, ledger.incarnation)) for s in sinks
    }
    coord.register("p", 0, {sid: [{"txn": n, "rows": 1}] for sid, n in names.items()})
    return coord, ledger


def test_sinks_of_different_targets_commit_at_once(tmp_path: Path) -> None:
    meet = threading.Barrier(3, timeout=10)
    sinks = [TimedSink(f"s{i}", f"target {i}", meet) for i in range(3)]
    coord, ledger = _coordinator(tmp_path, sinks)
    cp = coord.checkpoint()
    assert cp is not None and cp.committed_at is not None
    assert all(len(s.commits) == 1 for s in sinks)
    assert ledger.pending() == {} and ledger.decided() is None
    ledger.close()


def test_sinks_of_different_targets_sweep_at_once(tmp_path: Path) -> None:
    """After the commit, each sink's forget and sweep run beside the others'."""
    meet = threading.Barrier(3, timeout=10)
    sinks = [TimedSink(f"s{i}", f"target {i}", sweep_meet=meet) for i in range(3)]
    coord, ledger = _coordinator(tmp_path, sinks)
    assert coord.checkpoint() is not None
    assert not meet.broken
    ledger.close()


def test_sinks_of_one_target_commit_one_after_another(tmp_path: Path) -> None:
    sinks = [TimedSink(f"s{i}", "one table") for i in range(3)]
    coord, ledger = _coordinator(tmp_path, sinks)
    assert coord.checkpoint() is not None
    spans = sorted((s.commits[0][0], s.commits[0][1]) for s in sinks)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, f"commits of one target overlapped: {spans}"
    ledger.close()


def test_a_failing_sink_does_not_stop_the_others(tmp_path: Path) -> None:
    meet = threading.Barrier(3, timeout=10)
    sinks = [
        TimedSink("a", "target a", meet),
        TimedSink("bad", "target bad", meet, fail=True),
        TimedSink("c", "target c", meet),
    ]
    coord, ledger = _coordinator(tmp_path, sinks)
    with pytest.raises(CheckpointCommitError) as e:
        coord.checkpoint()
    assert "p/bad" in str(e.value) and list(e.value.failed) == ["p/bad"]
    assert len(sinks[0].commits) == len(sinks[2].commits) == 1
    assert ledger.decided() is not None  # kept: the next start finishes it
    ledger.close()


def test_slices_and_the_option() -> None:
    assert slices([]) == []
    assert slices(list(range(7))) == [list(range(7))]  # a few: one connection
    assert slices(list(range(10))) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert [len(s) for s in slices(list(range(100)))] == [25, 25, 25, 25]
    assert [len(s) for s in slices(list(range(100)), most=1)] == [100]
    with pytest.raises(ConfigError, match="commit_connections"):
        PostgresSink("host=127.0.0.1", "t", commit_connections=0)
    with pytest.raises(ConfigError, match="commit_connections"):
        KafkaSink("127.0.0.1:9092", "t", commit_connections=True)  # type: ignore[arg-type]


# -- PostgreSQL: COMMIT PREPARED over several connections ---------------------------------


@pytest.fixture
def pg_sink(pg_dsn: str) -> PostgresSink:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY)")
    sink = PostgresSink(pg_dsn, "t", commit_connections=4)
    sink.preflight(SCHEMA)
    return sink


def _prepare_pg(sink: PostgresSink, job: str, n: int) -> list[Committable]:
    scope = JobScope(job, "p", sink.sink_id, "0123456789ab")
    sink.committer().claim(scope)
    out = []
    for part in range(n):
        w = sink.open_writer(WriteContext(scope, 1, 0, part, part), SCHEMA)
        w.write(pa.RecordBatch.from_pydict({"id": [part]}, schema=SCHEMA))
        c = w.prepare()
        w.close()
        assert c is not None
        out.append(c)
    return out


def test_postgres_commits_over_several_connections(pg_sink: PostgresSink, pg_dsn: str) -> None:
    """24 transactions, 4 connections of 6: the first connection is held after its
    first COMMIT PREPARED until the three others have committed all of theirs,
    which only concurrent connections can do (one connection would wait for
    ever: the hold gives up after 20 s and the test fails)."""
    job = f"par{uuid.uuid4().hex[:6]}"
    cs = _prepare_pg(pg_sink, job, 24)
    seen: list[int] = []

    def hold() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            left = len(job_prepared(pg_dsn, job))
            if left == 5:  # the held connection's own five
                seen.append(left)
                return
            time.sleep(0.02)

    _faults.register("driver.mid_commit", hold)
    try:
        pg_sink.committer().commit(cs)
    finally:
        _faults.clear()
    assert seen == [5]
    assert job_prepared(pg_dsn, job) == []
    pg_sink.committer().commit(cs)  # again: recognised from the markers
    with psycopg.connect(pg_dsn) as c:
        assert c.execute("SELECT count(*) FROM t").fetchone() == (24,)


def test_postgres_a_lost_transaction_fails_the_commit_and_the_rest_commits_after(
    pg_sink: PostgresSink, pg_dsn: str
) -> None:
    job = f"par{uuid.uuid4().hex[:6]}"
    cs = _prepare_pg(pg_sink, job, 16)
    lost = cs[5]["txn"]
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f"ROLLBACK PREPARED '{lost}'")
    with pytest.raises(TransactionLostError, match=lost):
        pg_sink.committer().commit(cs)
    pg_sink.committer().commit([c for c in cs if c["txn"] != lost])  # what an abandon leads to
    assert job_prepared(pg_dsn, job) == []
    with psycopg.connect(pg_dsn) as c:
        assert c.execute("SELECT count(*) FROM t").fetchone() == (15,)


@pytest.mark.parametrize("repays", [True, False], ids=["repayment", "replay"])
def test_postgres_work_that_repays_a_batch_commits_though_the_sink_holds_it(
    pg_sink: PostgresSink, pg_dsn: str, repays: bool
) -> None:
    """A transaction of batch 0 is lost in the middle of its commit: the rest
    committed, and the sink's progress holds batch 0. The lost task's share
    written again is marked a repayment (``REPAYS``, rule 5) and commits;
    the same work unmarked is a replay of a batch the sink holds, and is
    rolled back."""
    job = f"par{uuid.uuid4().hex[:6]}"
    cs = _prepare_pg(pg_sink, job, 2)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(cs[1]["txn"])))
    pg_sink.committer().commit(cs[:1])
    pg_sink.committer().forget(cs[:1])
    scope = JobScope(job, "p", pg_sink.sink_id, "0123456789ab")
    w = pg_sink.open_writer(WriteContext(scope, 2, 0, 1, 99), SCHEMA)  # run 2, partition 1
    w.write(pa.RecordBatch.from_pydict({"id": [1]}, schema=SCHEMA))
    again = w.prepare()
    w.close()
    assert again is not None
    if repays:
        again[REPAYS] = True
    pg_sink.committer().commit([again])
    assert job_prepared(pg_dsn, job) == []
    with psycopg.connect(pg_dsn) as c:
        ids = [r[0] for r in c.execute("SELECT id FROM t ORDER BY id")]
    assert ids == ([0, 1] if repays else [0])


# -- Kafka: EndTxn over several connections -----------------------------------------------


@pytest.fixture
def kafka_sink(kafka_bootstrap: str) -> Iterator[KafkaSink]:
    """A sink of 3 commit connections on a new topic, preflighted, closed after."""
    topic = f"t-{uuid.uuid4().hex[:10]}"
    sink = KafkaSink(
        kafka_bootstrap,
        topic,
        create_topic=True,
        partitions=2,
        sink_id="k",
        commit_connections=3,
        commit_timeout=20,
    )
    sink.preflight(SCHEMA)
    yield sink
    sink.close()


def _prepare_kafka(sink: KafkaSink, start: int, n: int, batch: int = 0) -> list[Committable]:
    scope = JobScope(f"j{uuid.uuid4().hex[:6]}", "p", "k", "0123456789ab")
    out = []
    for part in range(n):
        w = sink.open_writer(WriteContext(scope, 1, batch, part, 1000 * batch + part), SCHEMA)
        w.write(pa.RecordBatch.from_pydict({"id": [start + part]}, schema=SCHEMA))
        c = w.prepare()
        w.close()
        assert c is not None
        out.append(c)
    return out


def _committed(bootstrap: str, topic: str) -> list[int]:
    log = read_topic(bootstrap, topic)
    assert log.n_open == 0
    return sorted(json.loads(r.value)["id"] for r in log.committed if r.value is not None)


def test_kafka_commits_over_several_connections_and_a_lost_one_is_named(
    kafka_bootstrap: str, kafka_sink: KafkaSink
) -> None:
    """12 transactions over 3 connections, one fenced by an intruder (its
    EndTxn is refused, tansu closes that connection): the error names it; the
    commit of the 11 others (as after an operator's abandon) and the next
    commit (new transactions, the spare connections again) go through."""
    from kafka import KafkaProducer

    sink = kafka_sink
    cs = _prepare_kafka(sink, 0, 12)
    lost = cs[4]["transactional_id"]
    intruder = KafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=lost)
    intruder.init_transactions()  # aborts the prepared transaction
    intruder.close()
    with pytest.raises(TransactionLostError, match=lost):
        sink.committer().commit(cs)
    sink.committer().commit([c for c in cs if c["transactional_id"] != lost])
    assert _committed(kafka_bootstrap, sink.topic) == [i for i in range(12) if i != 4]
    more = _prepare_kafka(sink, 100, 12, batch=1)
    sink.committer().commit(more)
    sink.committer().commit(more)  # again: harmless
    expected = [i for i in range(12) if i != 4] + list(range(100, 112))
    assert _committed(kafka_bootstrap, sink.topic) == expected


def test_a_fault_point_can_name_the_kind_of_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sinks commit at once, so a crash test that means one sink's commit names it."""
    monkeypatch.setenv(_faults.ENV, "driver.mid_commit.delta=raise")
    _faults.hit("driver.mid_commit", sink="kafka")
    _faults.hit("driver.mid_commit")
    with pytest.raises(_faults.InjectedFault):
        _faults.hit("driver.mid_commit", sink="delta")
    monkeypatch.setenv(_faults.ENV, "driver.mid_commit=raise")  # any sink
    with pytest.raises(_faults.InjectedFault):
        _faults.hit("driver.mid_commit", sink="kafka")
    monkeypatch.delenv(_faults.ENV)
    fired: list[str] = []
    _faults.register("driver.mid_commit.postgres", lambda: fired.append("postgres"))
    _faults.hit("driver.mid_commit", sink="kafka")
    _faults.hit("driver.mid_commit", sink="postgres")
    assert fired == ["postgres"]  # a registered callback names its sink the same way


def test_kafka_sends_the_end_txns_of_a_connection_without_waiting_for_each(
    kafka_bootstrap: str, kafka_sink: KafkaSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 transactions over 3 connections: each connection commits its
    first alone (a crash just after it leaves only that one decided: the crash
    tests count on it), then sends the others' EndTxn a few at a time, before
    their answers; every one commits, and a commit again is harmless."""
    from kafka.protocol.producer import EndTxnRequest

    from sinks.kafka.wire import KafkaWire

    lock = threading.Lock()
    in_flight = 0
    most = 0
    sent = 0
    submit = KafkaWire.submit

    def counting(self: KafkaWire, request: Any, node_id: Any) -> Any:
        nonlocal in_flight, most, sent
        future = submit(self, request, node_id)
        if isinstance(request, EndTxnRequest):
            with lock:
                sent += 1
                in_flight += 1
                most = max(most, in_flight)

            def answered(_: Any) -> None:
                nonlocal in_flight
                with lock:
                    in_flight -= 1

            future.add_both(answered)
        return future

    monkeypatch.setattr(KafkaWire, "submit", counting)
    sink = kafka_sink
    cs = _prepare_kafka(sink, 0, 16)
    sink.committer().commit(cs)
    parts = slices(range(16), most=sink.commit_connections)  # 3 connections
    assert sent == 16 - len(parts), sent  # each part's first alone, the rest pipelined
    assert most >= 3, most
    sink.committer().commit(cs)  # again: harmless
    assert _committed(kafka_bootstrap, sink.topic) == list(range(16))
