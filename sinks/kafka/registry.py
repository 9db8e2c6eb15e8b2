"""The transaction registry: where the driver learns which transactional ids exist.

Kafka has no cheap, portable "list the open transactions whose id starts with
X" (ListTransactions needs Kafka 3.0+ and DESCRIBE on every transactional id;
tansu does not implement it), and Spark task attempt ids, part of every
transactional id, cannot be enumerated from the driver. So every writer
announces its transactional id before it writes any data, in a small topic
(default ``_twophase_kafka_txns``, compacted):

* key: the transactional id; value: ``{"topic": ..., "v": 1}`` (JSON).
* The announcement is the first record of the writer's own transaction and is
  flushed before any data record is sent, so an id whose transaction holds
  data is always in the registry (an announcement is visible to a raw,
  read_uncommitted reader even while its transaction is open or after it was
  aborted).
* Once an id is resolved (committed and recorded by the ledger, or aborted),
  the driver writes a tombstone (null value) for its key; compaction then
  drops both, so the registry stays small.

The driver scans the registry incrementally: :class:`RegistryView` remembers
the next offset per partition and the ids announced and not yet tombstoned,
so each sweep reads only what was appended since the last one.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from typing import Any

import kafka.errors as Errors
from kafka import KafkaProducer

from sinks.kafka.wire import KafkaWire

log = logging.getLogger("sinks.kafka")

DEFAULT_TOPIC = "_twophase_kafka_txns"
TOPIC_CONFIG = {"cleanup.policy": "compact", "segment.ms": "3600000"}


def announcement(topic: str) -> bytes:
    """The value of a registry record announcing a transactional id."""
    return json.dumps({"topic": topic, "v": 1}).encode()


class RegistryView:
    """Driver-side, incrementally refreshed view of one registry topic."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self._next: dict[int, int] = {}
        self._live: set[str] = set()
        self._lock = threading.Lock()

    def refresh(self, wire: KafkaWire) -> set[str]:
        """Read what was appended since the last refresh; return the live ids."""
        with self._lock:
            try:
                self._read(wire)
            except Errors.OffsetOutOfRangeError:
                # the registry was deleted and re-created: read it again from the start
                log.warning("registry topic %s restarted; rescanning it", self.topic)
                self._next.clear()
                self._live.clear()
                self._read(wire)
            return set(self._live)

    def _read(self, wire: KafkaWire) -> None:
        leaders = wire.partition_leaders(self.topic)
        for partition, leader in sorted((leaders or {}).items()):
            start = self._next.get(partition, 0)
            # (records replayed after an error are harmless: the same adds and discards)
            for batch in wire.batches(leader, self.topic, partition, start):
                if not batch.is_control_batch:
                    self._apply(batch, start)
                start = batch.next_offset
            self._next[partition] = start

    def _apply(self, batch: Any, start: int) -> None:
        for record in batch:
            if record.offset < start or record.key is None:
                continue
            key = bytes(record.key).decode("utf-8", "replace")
            if record.value is None:
                self._live.discard(key)
            else:
                self._live.add(key)

    def forget(self, ids: Iterable[str]) -> None:
        """Drop ids locally (their tombstones were written)."""
        with self._lock:
            self._live.difference_update(ids)


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
