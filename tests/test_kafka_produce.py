"""The writers' own producer (:mod:`sinks.kafka.produce` + :mod:`sinks.kafka.records`)
against a real broker, read back by a consumer that is not ours.

librdkafka (confluent-kafka) with ``check.crcs=true`` reads what the writers
produce: keys, values, headers and partitions must be exactly what
:mod:`sinks.kafka.encode` and Kafka's default partitioner say, whatever the
compression, batch and request sizes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pytest
from kafka.partitioner.default import murmur2

from lifecycle.testing import verify
from sinks.base import JobScope, WriteContext
from sinks.kafka import KafkaSink, encode
from sinks.kafka.log import read_topic
from sinks.kafka.produce import ProduceError
from sinks.kafka.wire import KafkaWire

confluent_kafka = pytest.importorskip("confluent_kafka")

SCHEMA = pa.schema(
    [("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64()), ("tag", pa.string())]
)


@pytest.fixture
def new_sink(kafka_bootstrap: str) -> Iterator[Callable[..., KafkaSink]]:
    made: list[KafkaSink] = []

    def build(topic: str, **kw: Any) -> KafkaSink:
        sink = KafkaSink(kafka_bootstrap, topic, sink_id="k", **kw)
        made.append(sink)
        return sink

    yield build
    for sink in made:
        sink.close()


def _batch(start: int, n: int, *, null_keys: bool = False) -> pa.RecordBatch:
    ids = [None if null_keys and i % 7 == 0 else i for i in range(start, start + n)]
    return pa.record_batch(
        [
            pa.array(ids, pa.int64()),
            pa.array([f"näme-{i}" * (1 + i % 5) for i in range(start, start + n)]),
            pa.array([i * 0.25 for i in range(start, start + n)]),
            pa.array([None if i % 3 == 0 else f"t{i % 4}" for i in range(start, start + n)]),
        ],
        schema=SCHEMA,
    )


def _ctx(partition: int = 0) -> WriteContext:
    job = f"j{uuid.uuid4().hex[:8]}"
    return WriteContext(JobScope(job, "p", "k", "a1b2c3d4e5f6"), 1, 0, partition, 100 + partition)


def _consume(bootstrap: str, topic: str, partitions: int, expected: int) -> list[Any]:
    """Every record of ``topic``, read by librdkafka with CRC checks on."""
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"g-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "check.crcs": True,
            # seen: after tests/test_kafka_progress.py left transactions open on the
            # broker (in other topics), a read_committed consumer read nothing here
            # from tansu; the commit is checked from the control markers instead
            # (_write_and_commit)
            "isolation.level": "read_uncommitted",
        }
    )
    tp = confluent_kafka.TopicPartition
    consumer.assign([tp(topic, p, confluent_kafka.OFFSET_BEGINNING) for p in range(partitions)])
    got: list[Any] = []
    idle = 0
    try:
        while len(got) < expected and idle < 20:
            msgs = consumer.consume(num_messages=10_000, timeout=0.5)
            if not msgs:
                idle += 1
            for m in msgs:
                if m.error() is not None:
                    if m.error().code() == confluent_kafka.KafkaError._PARTITION_EOF:
                        continue
                    raise AssertionError(f"consumer error: {m.error()}")
                got.append(m)
    finally:
        consumer.close()
    return got


def _expected(sink: KafkaSink, batches: list[pa.RecordBatch], partitions: int) -> list[tuple]:
    """(partition, key, value, headers) per row, as encode and the default partitioner say."""
    out = []
    for b in batches:
        keys = encode.to_bytes(b.column("id"))
        values = encode.json_rows(b)
        tags = encode.to_bytes(b.column("tag"))
        for k, v, t in zip(keys, values, tags, strict=True):
            part = None if k is None else (murmur2(k) & 0x7FFFFFFF) % partitions
            out.append((part, k, v, [("tag", t)] if t is not None else []))
    return out


def _received(msgs: list[Any]) -> list[tuple]:
    return [(m.partition(), m.key(), m.value(), list(m.headers() or [])) for m in msgs]


def _write_and_commit(sink: KafkaSink, batches: list[pa.RecordBatch]) -> None:
    sink.preflight(SCHEMA)
    w = sink.open_writer(_ctx(), SCHEMA)
    for b in batches:
        w.write(b)
    c = w.prepare()
    w.close()
    assert c is not None
    sink.committer().commit([c])
    # Apache Kafka answers EndTxn before it writes the markers (asynchronously)
    log = verify.read_settled(sink.bootstrap_servers, sink.topic)
    assert log.n_open == 0 and log.n_aborted == 0
    assert len(log.committed) == sum(b.num_rows for b in batches)


@pytest.mark.parametrize("compression", [None, "gzip", "snappy", "lz4", "zstd"])
def test_librdkafka_reads_what_the_writer_produced(
    kafka_bootstrap: str,
    kafka_topic: Callable[..., str],
    new_sink: Callable[..., KafkaSink],
    compression: str | None,
) -> None:
    from kafka import codec

    has = {None: True, "gzip": True, "snappy": codec.has_snappy(), "lz4": codec.has_lz4()}
    if not has.get(compression, codec.has_zstd()):
        pytest.skip(f"no {compression} library installed")
    topic = kafka_topic(4)
    # small batches and requests: many batches per partition, several requests in flight
    config = {"batch_size": 4096, "max_request_size": 64 * 1024}
    if compression:
        config["compression_type"] = compression
    sink = new_sink(topic, key="id", headers=["tag"], producer_config=config)
    batches = [_batch(0, 3000), _batch(3000, 1), _batch(3001, 2500)]
    _write_and_commit(sink, batches)
    want = _expected(sink, batches, 4)
    got = _received(_consume(kafka_bootstrap, topic, 4, len(want)))
    assert len(got) == len(want)
    # per partition, records keep the task's order
    for p in range(4):
        assert [g[1:] for g in got if g[0] == p] == [w[1:] for w in want if w[0] == p]


def test_keyless_rows_go_round_robin_per_arrow_batch(
    kafka_bootstrap: str, kafka_topic: Callable[..., str], new_sink: Callable[..., KafkaSink]
) -> None:
    topic = kafka_topic(3)
    sink = new_sink(topic, key="id", headers=["tag"])
    batches = [_batch(0, 50, null_keys=True), _batch(50, 50, null_keys=True)]
    _write_and_commit(sink, batches)
    want = _expected(sink, batches, 3)
    got = _received(_consume(kafka_bootstrap, topic, 3, len(want)))
    assert sorted(map(repr, (g[1:] for g in got))) == sorted(map(repr, (w[1:] for w in want)))
    keyless = [g[0] for g in got if g[1] is None]
    assert len(keyless) == sum(1 for w in want if w[1] is None) and len(set(keyless)) == 2


def test_values_from_a_column_and_tombstones(
    kafka_bootstrap: str, kafka_topic: Callable[..., str], new_sink: Callable[..., KafkaSink]
) -> None:
    topic = kafka_topic(1)
    sink = new_sink(topic, key="id", value="tag")
    b = _batch(0, 30)
    _write_and_commit(sink, [b])
    got = _received(_consume(kafka_bootstrap, topic, 1, 30))
    assert [g[2] for g in got] == encode.to_bytes(b.column("tag"))
    assert sum(1 for g in got if g[2] is None) == 10  # null values are tombstones


def test_a_fenced_writer_fails_its_attempt_with_nothing_committed(
    kafka_bootstrap: str, kafka_topic: Callable[..., str], new_sink: Callable[..., KafkaSink]
) -> None:
    """The driver fences a transactional id (InitProducerId bumps the epoch) while
    its writer still produces: the writer's next batches are refused and its
    prepare fails; the fenced transaction was aborted by the fence."""
    topic = kafka_topic(2)
    sink = new_sink(topic, key="id")
    sink.preflight(SCHEMA)
    c = _ctx()
    w = sink.open_writer(c, SCHEMA)
    w.write(_batch(0, 100))
    tid = sink.transactional_id(c)
    with KafkaWire(kafka_bootstrap) as wire:
        coordinator = wire.find_coordinators([tid])[tid]
        wire.init_producer_id(coordinator, tid, 60_000)
    # Apache Kafka writes the fence's abort markers after it answers; until they
    # land, a partition leader still takes the old epoch (and the markers then
    # abort those records too): wait for them, so the leader knows the new epoch
    assert verify.read_settled(kafka_bootstrap, topic).n_open == 0
    w.write(_batch(100, 100))
    with pytest.raises(ProduceError, match=r"Fenced|Epoch"):
        w.prepare()
    w.close(failed=True)
    log = read_topic(kafka_bootstrap, topic)
    assert log.committed == [] and log.n_open == 0


def test_json_values_equal_what_the_old_producer_sent(
    kafka_bootstrap: str, kafka_topic: Callable[..., str], new_sink: Callable[..., KafkaSink]
) -> None:
    """The values are :func:`sinks.kafka.encode.json_rows`, byte for byte."""
    topic = kafka_topic(1)
    sink = new_sink(topic, key="id")
    b = _batch(0, 10)
    _write_and_commit(sink, [b])
    got = _received(_consume(kafka_bootstrap, topic, 1, 10))
    assert [g[2] for g in got] == encode.json_rows(b)
    assert json.loads(got[0][2])["name"] == "näme-0"
