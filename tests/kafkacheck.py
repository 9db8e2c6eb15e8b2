"""Assertions on Kafka topics shared by the Spark-level Kafka tests (like pgcheck.py).

Everything is decided from the raw log with :mod:`sinks.kafka.log` (through the
test kit, :mod:`lifecycle.testing.verify`), which
resolves each transactional record from the control markers (COMMIT / ABORT /
none yet), never with a ``read_committed`` consumer (tansu does not send the
aborted-transactions list such a consumer relies on). So the same assertions
hold against tansu and against Apache Kafka.

* "exactly once": what a read_committed consumer would see (the committed
  records) holds every input id once, and nothing else;
* "nothing left open": no record of the topic is in a transaction without a
  marker, and no transaction of the job announced in the sink's registry topic
  (where every writer announces its transactional id inside its own
  transaction, before any data) is still open, so even a transaction that
  wrote no data record yet is seen.
"""

from __future__ import annotations

import json
import time

from kafka.partitioner.default import murmur2

from lifecycle.testing import verify
from sinks.kafka.log import Record, TopicLog, read_topic
from sinks.kafka.registry import DEFAULT_TOPIC
from sinks.kafka.wire import KafkaWire
from sinks.naming import TxnName

SETTLE_S = verify.SETTLE_S
read_settled = verify.read_settled


def row_id(record: Record) -> int:
    """The ``id`` of a record written by KafkaSink with the default JSON value."""
    assert record.value is not None, f"record at {record.partition}/{record.offset} has no value"
    return int(json.loads(record.value)["id"])


def committed_ids(log: TopicLog) -> list[int]:
    """Ids of the committed records (what a read_committed consumer reads), sorted."""
    return sorted(row_id(r) for r in log.committed)


def assert_exactly_once(
    bootstrap: str, topic: str, n: int, start: int = 0, *, keyed: bool = True
) -> TopicLog:
    """Every id in [start, start+n) is committed in ``topic`` exactly once, nothing
    else is committed, and no record is left in an open transaction.

    With ``keyed``, each record's key is its id and it sits in the partition
    Kafka's default partitioner (murmur2) gives that key. Returns the log."""
    log = verify.assert_exactly_once_kafka(bootstrap, topic, range(start, start + n), key_of=row_id)
    assert all(r.transactional for r in log.committed), "a record was written outside a txn"
    if keyed:
        with KafkaWire(bootstrap) as wire:
            partitions = len(wire.partition_leaders(topic) or {})
        for r in log.committed:
            assert r.key == str(row_id(r)).encode(), f"key {r.key!r} of id {row_id(r)}"
            assert r.partition == (murmur2(r.key) & 0x7FFFFFFF) % partitions
    return log


def txn_outcomes(
    bootstrap: str, job: str, registry: str = DEFAULT_TOPIC, *, settle: float = 0.0
) -> dict[str, str]:
    """``{transaction name: "committed" | "aborted" | "open"}`` for every
    transaction of ``job``, from how its announcement in the registry topic was
    resolved (the announcement is the first record of the writer's own
    transaction, and names it: a pooled transactional id is reused). With
    ``settle``, re-read for up to that many seconds while one is still open."""
    deadline = time.monotonic() + settle
    while True:
        out = _outcomes(bootstrap, job, registry)
        if "open" not in out.values() or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def _outcomes(bootstrap: str, job: str, registry: str) -> dict[str, str]:
    prefix = TxnName.job_prefixes(job)
    log = read_topic(bootstrap, registry)
    out: dict[str, str] = {}
    for verdict, records in (
        ("committed", log.committed),
        ("aborted", log.aborted),
        ("open", log.open),
    ):
        for r in records:
            name = verify.announced_txn(r)
            if name is not None and name.startswith(prefix):
                assert name not in out, f"{name} announced twice"
                out[name] = verdict
    return out


def open_txns(
    bootstrap: str, job: str, registry: str = DEFAULT_TOPIC, *, settle: float = 0.0
) -> list[str]:
    """Transactional ids of ``job`` whose transaction is still open (neither
    committed nor aborted), from their announcements in the registry topic."""
    if registry == DEFAULT_TOPIC:
        return verify.open_transactions_kafka(bootstrap, job, settle=settle)
    outcomes = txn_outcomes(bootstrap, job, registry, settle=settle)
    return sorted(t for t, v in outcomes.items() if v == "open")


def assert_nothing_open(bootstrap: str, topic: str, job: str) -> None:
    """No record of ``topic`` and no transaction of ``job`` is left open."""
    verify.assert_nothing_left_kafka(bootstrap, topic, job)


def consume_records(
    bootstrap: str, topic: str, isolation: str, config: dict[str, str] | None = None
) -> list[tuple[int | None, bytes | None]]:
    """(key as an int, value) of every record a librdkafka consumer reads from
    the start, with ``isolation.level`` ``isolation``: how users read the sink's
    topic (``config``: more librdkafka settings, such as security)."""
    import uuid

    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(
        {
            **(config or {}),
            "bootstrap.servers": bootstrap,
            "group.id": f"g-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "isolation.level": isolation,
        }
    )
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {}
        for p in parts:
            _, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            ends[p] = high
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        got: list[tuple[int | None, bytes | None]] = []
        idle = 0
        while idle < 5:
            msgs = c.consume(500, timeout=1.0)
            idle = idle + 1 if not msgs else 0
            got += [
                (int(m.key()) if m.key() is not None else None, m.value())
                for m in msgs
                if not m.error()
            ]
        return got
    finally:
        c.close()


def consume_ids(
    bootstrap: str, topic: str, isolation: str, config: dict[str, str] | None = None
) -> list[int]:
    """The ``id`` of every record :func:`consume_records` reads."""
    records = consume_records(bootstrap, topic, isolation, config)
    return [json.loads(v)["id"] for _, v in records if v]


def job_transactional_ids(bootstrap: str, job: str) -> list[str] | None:
    """The transactional ids of ``job`` that the brokers' transaction
    coordinators hold (ListTransactions; None on a broker without it, tansu)."""
    from kafka.protocol.admin import ListTransactionsRequest

    from sinks.kafka.wire import KafkaWire

    with KafkaWire(bootstrap) as wire:
        if wire.api_version(ListTransactionsRequest) < 0:
            return None
        return [t for t in wire.list_transactions() if f".{job}." in t]
