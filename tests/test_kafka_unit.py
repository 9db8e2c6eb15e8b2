"""The Kafka sink and the log checker against a real broker (tansu), without Spark.

A session-wide tansu broker is started from ``lifecycle/testing/kafka_broker.py``; every test
uses fresh topics. Nothing is mocked: transactions, markers and fencing are the
broker's; the checker (``sinks/kafka/log.py``) resolves every transactional
record from the control markers in the raw log.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic
from kafka.partitioner.default import murmur2

from lifecycle.testing.kafka_broker import KafkaBroker
from lifecycle.testing.services import free_port
from sinks.base import Committable, JobScope, WriteContext
from sinks.errors import (
    CommitError,
    ConfigError,
    PreflightError,
    TransactionLostError,
    UnconfirmedWriteError,
)
from sinks.kafka import KafkaSink
from sinks.kafka.encode import json_rows
from sinks.kafka.log import TopicLog, read_topic
from sinks.kafka.produce import TxnProducer
from sinks.kafka.registry import DEFAULT_TOPIC, RegistryView
from sinks.kafka.wire import KafkaWire

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64())])
INC = "a1b2c3d4e5f6"
"""the incarnation (a ledger's random id) the tests write as, unless they say otherwise"""


@pytest.fixture(scope="module")
def broker() -> Iterator[KafkaBroker]:
    b = KafkaBroker()
    b.start()
    try:
        yield b
    finally:
        b.cleanup()


@pytest.fixture
def bootstrap(broker: KafkaBroker) -> str:
    return broker.bootstrap


@pytest.fixture
def new_sink(bootstrap: str) -> Iterator[Callable[..., KafkaSink]]:
    """Build sinks on the test broker; their driver connections close after the test."""
    made: list[KafkaSink] = []

    def build(topic: str, **kw: Any) -> KafkaSink:
        sink = KafkaSink(kw.pop("servers", bootstrap), topic, **kw)
        made.append(sink)
        return sink

    yield build
    for sink in made:
        sink.close()


def make_topic(bootstrap: str, partitions: int = 1) -> str:
    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        admin.close()
    return name


def rows(start: int, n: int) -> pa.RecordBatch:
    ids = list(range(start, start + n))
    return pa.record_batch(
        [pa.array(ids), pa.array([f"name-{i}" for i in ids]), pa.array([i * 0.5 for i in ids])],
        schema=SCHEMA,
    )


def ctx(
    job: str,
    partition: int,
    *,
    batch: int = 0,
    attempt: int | None = None,
    run: int = 1,
    pipeline: str = "p",
    sink_id: str = "k",
    incarnation: str | None = INC,
) -> WriteContext:
    return WriteContext(
        JobScope(job, pipeline, sink_id, incarnation),
        run=run,
        batch_id=batch,
        partition=partition,
        attempt=attempt if attempt is not None else 100 + partition,
    )


def scope(job: str, pipeline: str = "p", sink_id: str = "k", incarnation: str = INC) -> JobScope:
    return JobScope(job, pipeline, sink_id, incarnation)


def write_task(
    sink: KafkaSink, c: WriteContext, batches: list[pa.RecordBatch], close: bool = True
) -> Committable | None:
    """What a Spark task does: write, prepare, close."""
    w = sink.open_writer(c, SCHEMA)
    for b in batches:
        w.write(b)
    committable = w.prepare()
    if close:
        w.close()
    return committable


def committed_ids(log: TopicLog) -> list[int]:
    return sorted(json.loads(r.value)["id"] for r in log.committed if r.value is not None)


def job_name() -> str:
    return f"j{uuid.uuid4().hex[:8]}"


# -- the checker on its own ----------------------------------------------------------------


def test_reader_resolves_markers_per_producer(bootstrap: str) -> None:
    topic = make_topic(bootstrap)

    def txn(tid: str) -> KafkaProducer:
        p = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=tid)
        p.init_transactions()
        p.begin_transaction()
        return p

    opened = txn(f"open-{topic}")  # left open, interleaved with everything else
    opened.send(topic, key=b"o", value=b"open-1")
    opened.flush()
    committed = txn(f"commit-{topic}")
    committed.send(topic, value=b"commit-1", headers=[("h", b"v")])
    opened.send(topic, value=b"open-2")
    opened.flush()
    committed.send(topic, value=b"commit-2")
    committed.commit_transaction()
    plain = KafkaProducer(bootstrap_servers=bootstrap)
    plain.send(topic, key=b"k", value=b"plain-1")
    plain.flush()
    aborted = txn(f"abort-{topic}")
    aborted.send(topic, value=b"abort-1")
    aborted.flush()
    aborted.abort_transaction()
    plain.send(topic, value=b"plain-2")
    plain.flush()
    for p in (committed, aborted, plain):
        p.close()
    opened.close(timeout=0)  # no EndTxn: stays open

    log = read_topic(bootstrap, topic)
    assert log.values() == [b"commit-1", b"commit-2", b"plain-1", b"plain-2"]
    assert [r.value for r in log.aborted] == [b"abort-1"]
    assert sorted(r.value for r in log.open) == [b"open-1", b"open-2"]
    assert log.markers == 2
    c1 = log.committed[0]
    assert c1.transactional and c1.headers == (("h", b"v"),)
    p1 = next(r for r in log.committed if r.value == b"plain-1")
    assert not p1.transactional and p1.key == b"k"
    assert log.duplicates() == {}


def test_a_fetch_answered_without_the_partition_is_empty_not_an_error(bootstrap: str) -> None:
    """tansu answers a Fetch that may not wait (and, loaded, one that may wait 1 ms)
    with no partition at all: that is an empty answer, which the log reader asks
    again with a longer wait, not a protocol error that fails a sweep."""
    topic = make_topic(bootstrap)
    plain = KafkaProducer(bootstrap_servers=bootstrap)
    plain.send(topic, partition=0, value=b"v").get(timeout=30)
    plain.close()
    with KafkaWire(bootstrap) as wire:
        leader = (wire.partition_leaders(topic) or {})[0]
        assert wire.fetch(leader, topic, 0, 1, max_wait_ms=0) is None  # nothing at offset 1
        assert [b.base_offset for b in wire.batches(leader, topic, 0)] == [0]


# -- encoding ------------------------------------------------------------------------------


def test_json_rows_types() -> None:
    import datetime
    import decimal

    batch = pa.record_batch(
        {
            "i": pa.array([1, None]),
            "s": pa.array(['a"b\\c', "x\ny"]),
            "f": pa.array([1.5, float("nan")]),
            "b": pa.array([True, None]),
            "d": pa.array([datetime.date(2024, 1, 2), None]),
            "t": pa.array(
                [datetime.datetime(2024, 1, 2, 3, 4, 5, 6)] * 2, pa.timestamp("us", "UTC")
            ),
            "bin": pa.array([b"\x00\xff", None]),
            "dec": pa.array([decimal.Decimal("1.50"), None], pa.decimal128(5, 2)),
            "l": pa.array([[1, 2], None]),
        }
    )
    out = [json.loads(v) for v in json_rows(batch)]
    assert out[0] == {
        "i": 1,
        "s": 'a"b\\c',
        "f": 1.5,
        "b": True,
        "d": "2024-01-02",
        "t": "2024-01-02T03:04:05.000006Z",
        "bin": "AP8=",
        "dec": "1.50",
        "l": [1, 2],
    }
    assert out[1] == {
        "i": None,
        "s": "x\ny",
        "f": "NaN",
        "b": None,
        "d": None,
        "t": "2024-01-02T03:04:05.000006Z",
        "bin": None,
        "dec": None,
        "l": None,
    }
    assert b'"dec":"1.50"' in json_rows(batch)[0]  # decimals: exact text, as strings
    # every rule, nested types included: tests/test_kafka_json.py


# -- the sink: prepare, commit, re-commit ----------------------------------------------------


def test_prepare_then_commit_exactly_once(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap, partitions=3)
    sink = new_sink(topic, key="id", headers=["name"], sink_id="k")
    sink.preflight(SCHEMA)
    job = job_name()
    cs = [
        write_task(sink, ctx(job, 0), [rows(0, 50), rows(50, 50)]),
        write_task(sink, ctx(job, 1), [rows(100, 30)]),
        write_task(sink, ctx(job, 2), [rows(0, 0)]),  # empty partition
    ]
    assert cs[2] is None
    committables = [c for c in cs if c is not None]
    first = committables[0]
    assert first["txn"] == str(ctx(job, 0).txn_name()) == first["transactional_id"]
    assert first["rows"] == 100 and first["topic"] == topic
    assert len(first["partitions"]) > 1  # one task, several Kafka partitions
    assert json.loads(json.dumps(committables)) == committables  # JSON-serialisable

    log = read_topic(bootstrap, topic)
    assert log.committed == [] and log.n_open == 130  # invisible until the commit

    sink.committer().commit(committables)
    log = read_topic(bootstrap, topic)
    assert committed_ids(log) == list(range(130))
    assert log.n_open == 0 and log.n_aborted == 0
    for r in log.committed:  # keyed like Kafka's default partitioner, header from a column
        assert r.partition == (murmur2(r.key) & 0x7FFFFFFF) % 3
        assert r.headers == (("name", f"name-{int(r.key)}".encode()),)
        assert json.loads(r.value)["name"] == f"name-{int(r.key)}"
    markers = log.markers

    sink.committer().commit(committables)  # again: harmless
    sink.committer().commit(committables[:1])
    log = read_topic(bootstrap, topic)
    assert committed_ids(log) == list(range(130)) and log.markers == markers
    sink.committer().forget(committables)


def test_recommit_after_the_id_was_fenced_reads_the_log(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    """EndTxn with a stale epoch is refused (tansu: connection closed; Kafka:
    PRODUCER_FENCED); the marker in the log proves the commit happened."""
    topic = make_topic(bootstrap)
    sink = new_sink(topic, sink_id="k")
    sink.preflight(SCHEMA)
    c = write_task(sink, ctx(job_name(), 0), [rows(0, 10)])
    assert c is not None
    sink.committer().commit([c])
    with KafkaWire(bootstrap) as wire:  # bump the epoch of the committed id
        coordinator = wire.find_coordinators([c["transactional_id"]])[c["transactional_id"]]
        wire.init_producer_id(coordinator, c["transactional_id"], 60000)
    sink.committer().commit([c])
    assert committed_ids(read_topic(bootstrap, topic)) == list(range(10))


def test_commit_of_a_fenced_open_transaction_is_lost(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    sink = new_sink(topic, sink_id="k", commit_timeout=20)
    sink.preflight(SCHEMA)
    c = write_task(sink, ctx(job_name(), 0), [rows(0, 10)])
    assert c is not None
    intruder = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=c["transactional_id"])
    intruder.init_transactions()  # what init_transactions() does to a prepared transaction
    intruder.close()
    with pytest.raises(TransactionLostError, match="was aborted"):
        sink.committer().commit([c])
    log = read_topic(bootstrap, topic)
    assert log.committed == [] and log.n_aborted == 10


# -- abort and close ---------------------------------------------------------------------------


def test_abort_is_idempotent_and_final(bootstrap: str, new_sink: Callable[..., KafkaSink]) -> None:
    topic = make_topic(bootstrap, partitions=2)
    sink = new_sink(topic, key="id", sink_id="k", commit_timeout=20)
    sink.preflight(SCHEMA)
    job = job_name()
    cs = [write_task(sink, ctx(job, p), [rows(p * 100, 20)]) for p in range(2)]
    committables = [c for c in cs if c is not None]
    sink.committer().abort(committables)
    sink.committer().abort(committables)  # again: harmless
    log = read_topic(bootstrap, topic)
    assert log.committed == [] and log.n_open == 0 and log.n_aborted == 40
    with pytest.raises(TransactionLostError):
        sink.committer().commit(committables)


def test_close_after_prepare_keeps_the_transaction_open(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    sink = new_sink(topic, sink_id="k")
    sink.preflight(SCHEMA)
    w = sink.open_writer(ctx(job_name(), 0), SCHEMA)
    w.write(rows(0, 5))
    c = w.prepare()
    w.close()
    log = read_topic(bootstrap, topic)
    assert log.n_open == 5 and log.n_aborted == 0
    assert c is not None
    sink.committer().commit([c])
    assert committed_ids(read_topic(bootstrap, topic)) == list(range(5))


def test_close_failed_after_prepare_and_close_before_prepare_abort(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    sink = new_sink(topic, sink_id="k")
    sink.preflight(SCHEMA)
    job = job_name()
    w = sink.open_writer(ctx(job, 0), SCHEMA)
    w.write(rows(0, 5))
    assert w.prepare() is not None
    w.close(failed=True)  # the task failed after prepare
    w2 = sink.open_writer(ctx(job, 1), SCHEMA)
    w2.write(rows(5, 5))
    w2.close()  # never prepared
    empty = sink.open_writer(ctx(job, 2), SCHEMA)
    empty.close()
    log = read_topic(bootstrap, topic)
    # w2's records may have been dropped unsent by the abort: never more than 10
    assert log.committed == [] and log.n_open == 0 and 5 <= log.n_aborted <= 10


# -- sweeping lingering transactions -------------------------------------------------------


def test_the_sweep_aborts_only_unowned_of_the_scope(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap, partitions=2)
    sink = new_sink(topic, key="id", sink_id="k", commit_timeout=30)
    sink.preflight(SCHEMA)
    job = job_name()
    owned = write_task(sink, ctx(job, 0), [rows(0, 10)])
    failed_attempt = write_task(sink, ctx(job, 1, attempt=7), [rows(10, 10)])  # lost committable
    retry = write_task(sink, ctx(job, 1, attempt=8), [rows(10, 10)])
    late_batch = write_task(sink, ctx(job, 0, batch=5), [rows(20, 10)])
    other_pipeline = write_task(sink, ctx(job, 0, pipeline="q"), [rows(30, 10)])
    empty = write_task(sink, ctx(job, 3), [rows(0, 0)])
    legacy = write_task(sink, ctx(job, 0, batch=6, incarnation=None), [rows(40, 10)])  # tp1.
    other_inc = write_task(sink, ctx(job, 0, batch=6, incarnation="00000000ffff"), [rows(50, 10)])
    assert None not in (owned, failed_attempt, retry, late_batch, other_pipeline, legacy)
    assert other_inc is not None
    assert empty is None
    keep = {owned["txn"], retry["txn"]}  # type: ignore[index]

    aborted = sink.committer().sweep(scope(job), lambda n: str(n) not in keep and n.batch_id <= 0)
    assert aborted == [failed_attempt["txn"]]  # type: ignore[index]
    log = read_topic(bootstrap, topic)
    assert log.n_aborted == 10 and committed_ids(log) == []
    assert log.n_open == 60  # owned, retry, the later batch, the other pipeline, tp1, other inc

    # an empty partition opened nothing: no id was announced for it
    with KafkaWire(bootstrap) as wire:
        announced = RegistryView(sink.registry_topic or "").refresh(wire)
    assert str(ctx(job, 3).txn_name()) not in announced
    assert str(ctx(job, 1, attempt=8).txn_name()) in announced

    assert (
        sink.committer().sweep(scope(job), lambda n: str(n) not in keep and n.batch_id <= 0) == []
    )  # tombstoned: not seen again
    sink.committer().commit([owned, retry])  # type: ignore[list-item]
    sink.committer().forget([owned, retry])  # type: ignore[list-item]
    # recovery: everything of the scope that the ledger does not own
    # (first-format names of the scope too; never another incarnation's)
    aborted = sink.committer().sweep(scope(job), lambda n: True)
    assert aborted == [legacy["txn"], late_batch["txn"]]  # type: ignore[index]
    assert legacy["txn"].startswith("tp1.")  # type: ignore[index]
    log = read_topic(bootstrap, topic)
    assert committed_ids(log) == list(range(20))
    assert log.n_aborted == 30 and log.n_open == 20  # the other pipeline, the other incarnation
    assert sink.committer().sweep(scope(job, incarnation="00000000ffff"), lambda n: True) == [
        other_inc["txn"]
    ]
    assert sink.committer().sweep(scope(job, "q"), lambda n: True) == [
        other_pipeline["txn"]  # type: ignore[index]
    ]
    # a fresh driver (new sink object) rescans the registry from the start
    fresh = new_sink(topic, key="id", sink_id="k")
    assert fresh.committer().sweep(scope(job), lambda n: True) == []


def test_two_sinks_two_topics_prefixed_ids(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    t1, t2 = make_topic(bootstrap, 2), make_topic(bootstrap, 1)
    a = new_sink(t1, key="name", sink_id="a", transactional_id_prefix="app1-")
    b = new_sink(t2, value="name", sink_id="b")
    job = job_name()
    for s in (a, b):
        s.preflight(SCHEMA)
    ca = write_task(a, ctx(job, 0, sink_id="a"), [rows(0, 10)])
    cb = write_task(b, ctx(job, 0, sink_id="b"), [rows(0, 10)])
    assert ca is not None and cb is not None
    assert ca["transactional_id"] == "app1-" + ca["txn"]
    a.committer().commit([ca])
    assert read_topic(bootstrap, t2).n_open == 10  # b untouched
    assert b.committer().sweep(scope(job, sink_id="a"), lambda n: True) == []  # not b's scope
    b.committer().commit([cb])
    assert committed_ids(read_topic(bootstrap, t1)) == list(range(10))
    assert read_topic(bootstrap, t2).values() == [f"name-{i}".encode() for i in range(10)]
    # committed but not yet forgotten (a crash before forget): the sweep does not fence
    # it; it records its progress and tombstones it, as forget would have done
    assert a.committer().sweep(scope(job, sink_id="a"), lambda n: True) == []
    assert committed_ids(read_topic(bootstrap, t1)) == list(range(10))
    with KafkaWire(bootstrap) as wire:
        assert ca["transactional_id"] not in RegistryView(DEFAULT_TOPIC).refresh(wire)
    b.committer().forget([cb])
    assert b.committer().sweep(scope(job, sink_id="b"), lambda n: True) == []


# -- preflight and configuration ---------------------------------------------------------------


def test_preflight_errors(bootstrap: str, new_sink: Callable[..., KafkaSink]) -> None:
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(PreflightError, match="does not exist"):
        new_sink(missing).preflight(SCHEMA)
    created = new_sink(missing, create_topic=True, partitions=3)
    created.preflight(SCHEMA)
    with KafkaWire(bootstrap) as wire:
        assert len(wire.partition_leaders(missing) or {}) == 3
    with pytest.raises(PreflightError, match="value column 'amount' has type double"):
        new_sink(missing, value="amount").preflight(SCHEMA)
    with pytest.raises(PreflightError, match="key column 'nope' is not in the DataFrame"):
        new_sink(missing, key="nope").preflight(SCHEMA)
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(PreflightError, match=f"cannot reach Kafka at {dead}"):
        KafkaSink(dead, missing, connect_timeout=3).preflight(SCHEMA)


def test_configuration_errors_and_timeout_check() -> None:
    with pytest.raises(ConfigError, match="transactional_id"):
        KafkaSink("h:1", "t", producer_config={"transactional_id": "x"})
    with pytest.raises(ConfigError, match="not a valid Kafka topic"):
        KafkaSink("h:1", "bad topic")
    sink = KafkaSink("h:1", "t", transaction_timeout_ms=60_000, commit_timeout=60)
    assert KafkaSink.min_safe_timeout_ms(5.0) == (60 + 5 + 300 + 300) * 1000
    with pytest.raises(PreflightError, match="too small for checkpoint_interval=5s"):
        sink.check_checkpoint_interval(5.0)
    KafkaSink("h:1", "t").check_checkpoint_interval(5.0)  # the default 15 min is enough
    assert KafkaSink("h:1", "t").sink_id.startswith("kafka-t-")


def test_commit_retries_while_the_broker_is_down_then_gives_up(
    new_sink: Callable[..., KafkaSink],
) -> None:
    """A dropped connection with no broker behind it is transient, not 'lost'."""
    with KafkaBroker() as own:
        topic = make_topic(own.bootstrap)
        sink = new_sink(topic, servers=own.bootstrap, sink_id="k", commit_timeout=4)
        sink.preflight(SCHEMA)
        c = write_task(sink, ctx(job_name(), 0), [rows(0, 5)])
        assert c is not None
        own.stop()
        with pytest.raises(CommitError, match="did not succeed within 4s"):
            sink.committer().commit([c])


_KILLED_TASK = """
import os, signal, sys
import pyarrow as pa
from sinks.base import JobScope, WriteContext
from sinks.kafka import KafkaSink
bootstrap, topic, job, partition, prepare, incarnation = sys.argv[1:7]
schema = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64())])
sink = KafkaSink(bootstrap, topic, sink_id="k")
ctx = WriteContext(JobScope(job, "p", "k", incarnation), 1, 0, int(partition), 500 + int(partition))
w = sink.open_writer(ctx, schema)
ids = list(range(int(partition) * 10, int(partition) * 10 + 10))
w.write(pa.record_batch([pa.array(ids), pa.array([str(i) for i in ids]),
                         pa.array([0.5] * 10)], schema=schema))
if prepare == "1":
    w.prepare()
else:
    w._producer.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sweep_aborts_the_work_of_killed_tasks(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    """Tasks SIGKILLed mid-write and after prepare leave open transactions that
    only the registry knows of; the recovery sweep aborts them."""
    import subprocess
    import sys

    topic = make_topic(bootstrap)
    sink = new_sink(topic, sink_id="k")
    sink.preflight(SCHEMA)
    job = job_name()
    for partition, prepare in ((0, "1"), (1, "0")):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _KILLED_TASK,
                *(bootstrap, topic, job, str(partition), prepare, INC),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parents[1],  # the repository root, for `import sinks`
        )
        assert proc.returncode == -9, proc.stderr
    log = read_topic(bootstrap, topic)
    assert log.n_open == 20 and log.committed == []
    aborted = sink.committer().sweep(scope(job), lambda n: True)
    assert aborted == [str(ctx(job, p, attempt=500 + p).txn_name()) for p in (0, 1)]
    log = read_topic(bootstrap, topic)
    assert log.n_open == 0 and log.n_aborted == 20 and log.committed == []


def test_null_value_without_key_is_refused_and_aborted(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    sink = new_sink(topic, value="name", sink_id="k")
    sink.preflight(SCHEMA)
    w = sink.open_writer(ctx(job_name(), 0), SCHEMA)
    w.write(rows(0, 3))
    bad = pa.record_batch([pa.array([3]), pa.array([None], pa.string()), pa.array([1.0])], SCHEMA)
    with pytest.raises(ValueError, match="null value column 'name' and no key"):
        w.write(bad)
    w.close(failed=True)
    log = read_topic(bootstrap, topic)
    assert log.committed == [] and log.n_open == 0


def _take_sequence(bootstrap: str, producer: TxnProducer, tid: str, topic: str, n: int) -> None:
    """Append ``n`` foreign records to ``topic``/0 under the writer's producer id,
    epoch and next sequence numbers (0..n-1), as a raw Produce request: the
    broker then holds the sequence the writer is about to use, but not its rows.
    That is what tansu on S3 is left with when it is killed between persisting a
    producer's new sequence number and storing the batch."""
    from kafka.protocol.producer import ProduceRequest
    from kafka.record.default_records import DefaultRecordBatchBuilder

    pid, epoch = producer.producer_id, producer.epoch
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=1,
        producer_id=pid,
        producer_epoch=epoch,
        base_sequence=0,
        batch_size=1 << 20,
    )
    for i in range(n):
        builder.append(i, timestamp=None, key=None, value=b"foreign", headers=[])
    topic_data = ProduceRequest.TopicProduceData
    request = ProduceRequest(
        transactional_id=tid,
        acks=-1,
        timeout_ms=10_000,
        topic_data=[
            topic_data(
                name=topic,
                partition_data=[
                    topic_data.PartitionProduceData(index=0, records=bytes(builder.build()))
                ],
            )
        ],
        min_version=3,
        max_version=9,
    )
    with KafkaWire(bootstrap) as wire:
        leader = (wire.partition_leaders(topic) or {})[0]
        response = wire.send(request, leader)
    assert response.responses[0].partition_responses[0].error_code == 0


def test_records_acknowledged_without_an_offset_fail_the_task(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    """A produce that the broker answers DUPLICATE_SEQUENCE_NUMBER comes with no
    offset, whether the broker stored it or not. After a tansu crash it may not
    have (see ``_take_sequence``): a commit would then miss the rows. The writer
    refuses to prepare, names the cause, and its transaction is aborted; Spark's
    next attempt writes the partition."""
    topic = make_topic(bootstrap)
    sink = new_sink(topic, sink_id="k", commit_timeout=20)
    sink.preflight(SCHEMA)
    c = ctx(job_name(), 0)
    w = sink.open_writer(c, SCHEMA)
    producer = w._begin()  # open and announced, no data yet
    _take_sequence(bootstrap, producer, sink.transactional_id(c), topic, 10)
    w.write(rows(0, 10))
    with pytest.raises(UnconfirmedWriteError, match=r"10 record\(s\) without an offset"):
        w.prepare()
    w.close(failed=True)
    log = read_topic(bootstrap, topic)
    assert log.committed == [] and log.n_open == 0 and log.n_aborted == 10  # the foreign ones
