"""The transaction registry: where the driver learns which transactional ids exist.

Kafka has no cheap, portable "list the open transactions whose id starts with
X" (ListTransactions needs Kafka 3.0+ and DESCRIBE on every transactional id;
tansu does not implement it), and Spark task attempt ids, part of every
transactional id, cannot be enumerated from the driver. So every writer
announces its transactional id before it writes any data, in a small topic
(default ``_twophase_kafka_txns``, compacted):

* key: the transactional id; value: ``{"topic": ..., "txn": NAME, "v": 2}``
  (JSON): the target topic and the transaction's name (its batch, partition,
  attempt, run and incarnation), which a pooled id (:mod:`sinks.kafka.pool`)
  does not tell. Announcements of version 1 have no ``txn``: their id is the
  name (after ``transactional_id_prefix``). One of a later version (a newer
  twophase wrote it) for the sink's target topic, or naming no topic, is
  refused when the view reads it (:class:`~sinks.versions.NewerVersionError`),
  never taken for one of these; those of other topics are not the sink's.
* The announcement is the first record of the writer's own transaction and is
  flushed before any data record is sent, so an id whose transaction holds
  data is always in the registry (an announcement is visible to a raw,
  read_uncommitted reader even while its transaction is open or after it was
  aborted).
* The announcement ends with the transaction: the COMMIT or ABORT marker of
  its producer id that follows it on its registry partition resolves it, as
  it resolves the data records (the registry partition is part of the
  transaction). A committed announcement thus proves that its transaction,
  hence its batch, committed; the view resolves it from the control markers in
  the raw log, never with a read_committed consumer (tansu's returns aborted
  records too).
* Once an id is resolved (committed and recorded by the ledger, or aborted),
  the driver writes a tombstone (null value) for its key (a committed one only
  after the progress record that replaces it, :mod:`sinks.kafka.progress`);
  compaction then drops both, so the registry stays small.

The registry also holds the sink's own non-transactional records (claims and
progress, :mod:`sinks.kafka.progress`); the view hands them, in log order, to
a :class:`RecordHandler`.

The driver scans the registry incrementally: :class:`RegistryView` remembers
the next offset per partition, the ids announced and not yet tombstoned and
how each one ended, so each refresh reads only what was appended since the
last one.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import kafka.errors as Errors
from kafka import KafkaProducer

from sinks.kafka.wire import KafkaWire
from sinks.naming import TxnName
from sinks.versions import check_version

log = logging.getLogger("sinks.kafka")

DEFAULT_TOPIC = "_twophase_kafka_txns"
TOPIC_CONFIG = {"cleanup.policy": "compact", "segment.ms": "3600000"}

ANNOUNCEMENT_VERSION = 2
"""the version of the announcements this one writes, and the newest it reads"""

OPEN = "open"
COMMITTED = "committed"
ABORTED = "aborted"


def announcement(topic: str, txn: str) -> bytes:
    """The value of a registry record announcing a transactional id that writes
    transaction ``txn`` into ``topic``."""
    return json.dumps({"topic": topic, "txn": txn, "v": ANNOUNCEMENT_VERSION}).encode()


@dataclass
class Announcement:
    """An announced transactional id, as the registry's log tells it."""

    topic: str | None
    """the target topic named in the announcement (None if unreadable)"""
    partition: int
    producer_id: int
    state: str = OPEN
    """OPEN, COMMITTED or ABORTED: the marker that followed it, if any"""
    epoch: int = -1
    """the producer epoch of the announcing transaction"""
    txn: str | None = None
    """the transaction's name (None in a version-1 announcement: the id names it)"""

    def own_epoch(self) -> tuple[int, int]:
        """(producer id, epoch) of the announcing transaction."""
        return self.producer_id, self.epoch


def announced_name(tid: str, a: Announcement, id_prefix: str) -> TxnName | None:
    """The name of the transaction announced for ``tid``: the announcement's own
    (version 2), else the id's after ``id_prefix`` (version 1); None if neither
    is one of ours."""
    if a.txn is not None:
        return TxnName.parse(a.txn)
    if not tid.startswith(id_prefix):
        return None
    return TxnName.parse(tid[len(id_prefix) :])


class RecordHandler(Protocol):
    """Receives the registry's non-transactional records with a value, in log
    order per partition (claims and progress records), with the offset each was
    read at (None: a record the driver applies as it writes it)."""

    def apply(self, partition: int, key: str, value: bytes, offset: int | None = None) -> None: ...

    def reset(self) -> None: ...


class RegistryView:
    """Driver-side, incrementally refreshed view of one registry topic.

    ``target``: the topic of the sink the view serves; an announcement of a
    later version than :data:`ANNOUNCEMENT_VERSION` is refused when it names
    ``target`` (or no topic, or the view serves every topic: ``None``), and the
    refresh that meets it raises, every time, before it reads past it."""

    def __init__(
        self, topic: str, handler: RecordHandler | None = None, target: str | None = None
    ) -> None:
        self.topic = topic
        self._handler = handler
        self._target = target
        self._next: dict[int, int] = {}
        self._live: dict[str, Announcement] = {}
        self._pending: dict[tuple[int, int], set[str]] = {}  # (partition, pid) -> open ids
        self._lock = threading.Lock()

    def refresh(self, wire: KafkaWire) -> dict[str, Announcement]:
        """Read what was appended since the last refresh; return the live ids
        (announced, not tombstoned) and how their transactions ended so far."""
        with self._lock:
            try:
                self._read(wire)
            except Errors.OffsetOutOfRangeError:
                # the registry was deleted and re-created: read it again from the start
                log.warning("registry topic %s restarted; rescanning it", self.topic)
                self._next.clear()
                self._live.clear()
                self._pending.clear()
                if self._handler is not None:
                    self._handler.reset()
                self._read(wire)
            return dict(self._live)

    def live(self) -> dict[str, Announcement]:
        """The live ids as of the last refresh (no I/O)."""
        with self._lock:
            return dict(self._live)

    def next_offset(self, partition: int) -> int:
        """The offset up to which ``partition`` has been read."""
        with self._lock:
            return self._next.get(partition, 0)

    def _read(self, wire: KafkaWire) -> None:
        leaders = wire.partition_leaders(self.topic)
        for partition, leader in sorted((leaders or {}).items()):
            start = self._next.get(partition, 0)
            # (records replayed after an error are harmless: the same adds and discards;
            # the handler ignores a claim it has seen)
            for batch in wire.batches(leader, self.topic, partition, start):
                if batch.is_control_batch:
                    self._resolve(partition, batch)
                else:
                    self._apply(partition, batch, start)
                start = batch.next_offset
                self._next[partition] = start

    def _resolve(self, partition: int, batch: Any) -> None:
        ids = self._pending.pop((partition, batch.producer_id), set())
        if not ids:
            return
        state = COMMITTED if next(iter(batch)).commit else ABORTED
        for tid in ids:
            found = self._live.get(tid)
            if found is not None and found.state == OPEN:
                found.state = state

    def _apply(self, partition: int, batch: Any, start: int) -> None:
        for record in batch:
            if record.offset < start or record.key is None:
                continue
            key = bytes(record.key).decode("utf-8", "replace")
            if record.value is None:
                self._discard(key)
            elif batch.is_transactional:
                at = (partition, record.offset)
                self._announce(
                    key, bytes(record.value), at, batch.producer_id, batch.producer_epoch
                )
            elif self._handler is not None:
                self._handler.apply(partition, key, bytes(record.value), record.offset)

    def _announce(
        self, tid: str, value: bytes, at: tuple[int, int], producer_id: int, epoch: int
    ) -> None:
        partition, offset = at
        try:
            doc = json.loads(value)
            topic, txn, version = doc.get("topic"), doc.get("txn"), doc.get("v")
        except (ValueError, AttributeError):
            topic = txn = version = None
        if self._target is None or topic == self._target or not isinstance(topic, str):
            check_version(
                version,
                ANNOUNCEMENT_VERSION,
                f"the announcement of transactional id {tid} (registry topic {self.topic}, "
                f"partition {partition}, offset {offset})",
            )
        self._discard(tid)  # a reused id: its previous transaction ended
        self._live[tid] = Announcement(
            topic if isinstance(topic, str) else None,
            partition,
            producer_id,
            epoch=epoch,
            txn=txn if isinstance(txn, str) else None,
        )
        self._pending.setdefault((partition, producer_id), set()).add(tid)

    def _discard(self, tid: str) -> None:
        found = self._live.pop(tid, None)
        if found is not None:
            where = (found.partition, found.producer_id)
            pending = self._pending.get(where)
            if pending is not None:
                pending.discard(tid)
                if not pending:
                    del self._pending[where]

    def forget(self, ids: Iterable[str]) -> None:
        """Drop ids locally (their tombstones were written)."""
        with self._lock:
            for tid in ids:
                self._discard(tid)


def write_tombstones(
    producer: KafkaProducer, topic: str, ids: Iterable[str], timeout_s: float
) -> None:
    """Mark ``ids`` resolved in the registry (null-valued records), durably."""
    futures = [producer.send(topic, key=tid.encode(), value=None) for tid in ids]
    if not futures:
        return
    producer.flush(timeout=timeout_s)
    for f in futures:
        f.get(timeout=timeout_s)
