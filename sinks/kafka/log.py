"""A Kafka topic read raw and resolved by its control markers.

A ``read_committed`` consumer relies on the broker's aborted-transactions list,
which tansu does not send; this reader instead applies the control markers
itself, as the consumer's record-batch logic does:

* every partition is read raw (Fetch at read_uncommitted, control batches
  included) from its log start to its high watermark;
* a non-transactional data record is committed when written;
* a transactional data record joins the open set of its producer id;
* a control batch of a producer id resolves every open record of that id on
  that partition: COMMIT makes them committed, ABORT aborted;
* what is still open at the end has no marker yet.

Nothing here is specific to tansu, so the same reads work unchanged against
Apache Kafka. Used by the audit (:mod:`sinks.kafka.audit`) and by the test
kit's verifiers (:mod:`lifecycle.testing`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sinks.kafka.wire import KafkaWire


@dataclass(frozen=True)
class Record:
    """A data record of the log."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    producer_id: int
    transactional: bool
    producer_epoch: int = -1
    """with ``producer_id``, the transaction (a pooled transactional id keeps its
    producer id from one transaction to the next, and bumps the epoch)"""


@dataclass
class TopicLog:
    """A topic's records, classified by how their transaction ended."""

    topic: str
    committed: list[Record] = field(default_factory=list)
    aborted: list[Record] = field(default_factory=list)
    open: list[Record] = field(default_factory=list)
    markers: int = 0
    """control records seen (COMMIT and ABORT markers)"""

    @property
    def n_aborted(self) -> int:
        return len(self.aborted)

    @property
    def n_open(self) -> int:
        return len(self.open)

    def values(self) -> list[bytes | None]:
        """Values of the committed records, in (partition, offset) order."""
        return [r.value for r in self.committed]

    def duplicates(self) -> dict[bytes | None, int]:
        """Committed values that occur more than once, with their counts."""
        return {v: n for v, n in Counter(self.values()).items() if n > 1}


def _record(partition: int, batch: Any, rec: Any) -> Record:
    headers = tuple((k, None if v is None else bytes(v)) for k, v in rec.headers)
    key = rec.key
    value = rec.value
    return Record(
        partition=partition,
        offset=rec.offset,
        key=None if key is None else bytes(key),
        value=None if value is None else bytes(value),
        headers=headers,
        producer_id=batch.producer_id,
        transactional=batch.is_transactional,
        producer_epoch=batch.producer_epoch,
    )


def read_topic(
    bootstrap_servers: str, topic: str, config: dict[str, Any] | None = None
) -> TopicLog:
    """Read every partition of ``topic`` and classify each data record
    (``config``: kafka-python settings such as security)."""
    out = TopicLog(topic)
    with KafkaWire(bootstrap_servers, config=config) as wire:
        leaders = wire.partition_leaders(topic)
        if leaders is None:
            raise LookupError(f"topic {topic!r} does not exist at {bootstrap_servers}")
        for partition, leader in sorted(leaders.items()):
            _read_partition(wire, leader, topic, partition, out)
    out.committed.sort(key=lambda r: (r.partition, r.offset))
    return out


def _read_partition(
    wire: KafkaWire, leader: Any, topic: str, partition: int, out: TopicLog
) -> None:
    pending: dict[int, list[Record]] = {}
    for batch in wire.batches(leader, topic, partition):
        if batch.is_control_batch:
            for control in batch:
                out.markers += 1
                resolved = pending.pop(batch.producer_id, [])
                (out.committed if control.commit else out.aborted).extend(resolved)
            continue
        for rec in batch:
            r = _record(partition, batch, rec)
            if batch.is_transactional:
                pending.setdefault(batch.producer_id, []).append(r)
            else:
                out.committed.append(r)
    for records in pending.values():
        out.open.extend(records)
