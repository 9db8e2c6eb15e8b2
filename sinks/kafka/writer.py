"""Executor side of the Kafka sink: one transaction per task attempt.

Life of a writer (nothing is opened for an empty partition):

1. first non-empty batch, once its records are encoded: a
   :class:`~sinks.kafka.produce.TxnProducer` with ``transactional_id`` = the
   task's transaction name (deterministic, optionally prefixed) takes a producer
   id (DescribeTransactions first for a pooled id, then InitProducerId: each
   needs the answer before it), over a connection an earlier task of this
   Python worker left (:mod:`sinks.kafka.task_wires`); the leaders of the topic
   and the registry are asked for beside them, in one request. Then one
   AddPartitionsToTxn adds the registry's partition and the partitions the
   batch writes, and the id is announced in the registry
   (:mod:`sinks.kafka.registry`); the batch's records are framed while the
   announcement is on its way, and sent only once it is acknowledged, so no
   data is sent before it;
2. ``write``: keys, values and headers are built column-wise from Arrow
   (:mod:`sinks.kafka.encode`) before anything of the batch is sent, so a value
   the JSON encoding refuses fails the task with nothing of that batch in the
   transaction; rows are partitioned column-wise (murmur2 of the key, as Kafka's
   default partitioner, or round-robin per Arrow batch for keyless rows), each
   partition's rows become v2 record batches (:mod:`sinks.kafka.records`) and
   go out pipelined, without waiting for the answers;
3. ``prepare``: wait for every answer, fail if any batch was not written or was
   acknowledged as a duplicate without an offset, and return the committable
   with the producer id and epoch, without committing or aborting. A broker
   answers a produce DUPLICATE_SEQUENCE_NUMBER when it already has the batch's
   sequence numbers (a produce resent across a broker restart). Apache Kafka
   holds such a batch; tansu on S3 persists a producer's new sequence number
   before it stores the batch, so a SIGKILL between the two loses the batch
   while its resend is acknowledged. The task cannot tell which, so it fails
   (:class:`~sinks.errors.UnconfirmedWriteError`), its transaction is aborted,
   and Spark's next attempt writes the partition again;
4. ``close``: after ``prepare`` nothing else is sent (the producer never ends
   a transaction on its own) and the connection is left for the worker's next
   task. ``close(failed=True)`` after ``prepare``, and any close before it,
   abort the transaction (best effort, bounded; the driver's sweep aborts what
   this misses) and close the connection.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from kafka.errors import MessageSizeTooLargeError
from kafka.partitioner.default import murmur2

from sinks import _faults
from sinks.base import Committable, SinkWriter, WriteContext
from sinks.errors import RecordTooLargeError, UnconfirmedWriteError
from sinks.kafka import encode, partitioner, records, task_wires
from sinks.kafka.checks import is_compacted
from sinks.kafka.produce import ProducerOptions, TxnProducer
from sinks.kafka.registry import announcement
from sinks.kafka.wire import KafkaWire
from sinks.keys import KeyedWrite, NullValueError
from sinks.last_write import LastWriteWins, Winners

log = logging.getLogger("sinks.kafka")

_ABORT_TIMEOUT_S = 30.0
# what a record adds to its key, value and headers in a batch, at most (the batch
# header is 61 bytes; a record's varints and attributes take at most 21 more)
_BATCH_HEADER = 61
_RECORD_OVERHEAD = _BATCH_HEADER + 21


@dataclass(frozen=True)
class WriterSettings:
    """What a writer needs of its sink, handed over by ``KafkaSink.open_writer``
    (the writer never reaches back into the driver-side sink)."""

    where: str
    """the sink, for messages (``KafkaSink.describe()``)"""
    bootstrap_servers: str | list[str]
    producer_config: dict[str, Any]
    topic: str
    key: str | None
    value: str | None
    headers: tuple[str, ...]
    rules: KeyedWrite | None
    """a changelog's keyed-write options (``order_by`` / ``delete_when``); None:
    every row is a record"""
    registry_topic: str | None
    transaction_timeout_ms: int
    topic_max_bytes: int | None = None
    """the topic's ``max.message.bytes`` read at preflight (None: unknown)"""
    topic_cleanup_policy: str | None = None
    """the topic's ``cleanup.policy`` read at preflight (None: unknown)"""


class KafkaWriter(SinkWriter):
    """Writes one task's partition into one Kafka transaction (``transactional_id``)
    and prepares it."""

    def __init__(self, settings: WriterSettings, ctx: WriteContext, transactional_id: str) -> None:
        self._settings = settings
        self._txn = str(ctx.txn_name())
        self._tid = transactional_id
        self._spark_partition = ctx.partition
        self._pooled = ctx.lease is not None  # the id is reused: never abort another's work
        self._options = ProducerOptions.of(settings.producer_config)
        self._wire: KafkaWire | None = None
        self._producer: TxnProducer | None = None
        self._partitions: list[int] = []
        self._round_robin = 0
        self._rows = 0
        self._bytes = 0  # record batches sent, as framed on the wire
        self._prepared = False
        self._announced = False
        self._opened_at: float | None = None
        self._last_write = (
            LastWriteWins(settings.rules, ctx.batch_id) if settings.rules is not None else None
        )

    # -- opening ----------------------------------------------------------------------

    def _begin(self) -> TxnProducer:
        cfg = self._settings
        timeout_s = self._options.request_timeout_ms / 1000
        wire = task_wires.take(cfg.bootstrap_servers, cfg.producer_config, timeout_s)
        self._wire = wire
        try:
            producer = TxnProducer(
                wire,
                self._tid,
                transaction_timeout_ms=cfg.transaction_timeout_ms,
                options=self._options,
            )
            # the leaders go out beside the coordinator's requests: nothing waits for them
            topics = [cfg.topic] + ([cfg.registry_topic] if cfg.registry_topic else [])
            producer.prefetch_leaders(topics)
            producer.begin(guard=self._pooled)
            _faults.hit("executor.producer_id")
            self._partitions = sorted(producer.leaders(cfg.topic))
        except BaseException:
            self._wire = None
            with contextlib.suppress(Exception):
                wire.close()
            raise
        self._producer = producer
        self._opened_at = time.time()  # the broker's timer starts with the first record
        self._round_robin = self._spark_partition % len(self._partitions)
        return producer

    def _announce(self, producer: TxnProducer, registry: str, data: list[int]) -> None:
        """Send the transaction's first record: its id in the registry, without
        waiting (the caller waits for its acknowledgement before it sends any
        data). The registry's partition and ``data`` (the partitions of the
        topic the first batch writes) join the transaction in one request."""
        key = self._tid.encode()
        partitions = sorted(producer.leaders(registry))
        partition = partitions[(murmur2(key) & 0x7FFFFFFF) % len(partitions)]
        producer.add_to_txn({registry: [partition], self._settings.topic: data})
        batches = records.record_batches(
            pa.array([key], pa.large_binary()),
            pa.array([announcement(self._settings.topic, self._txn)], pa.large_binary()),
            producer_id=producer.producer_id,
            producer_epoch=producer.epoch,
            base_sequence=producer.next_sequence(registry, partition),
            transactional=True,
            timestamp_ms=int(time.time() * 1000),
        )
        producer.send(registry, {partition: batches})

    # -- writing ----------------------------------------------------------------------

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if self._last_write is None:
            self._send(batch)
        else:  # a changelog: the last row of each key whose rows are over
            self._send_winners(self._last_write.feed(batch))

    def _send_winners(self, winners: Winners | None) -> None:
        if winners is None:
            return
        self._send(winners.rows, pa.array(winners.deletes) if winners.deletes.any() else None)

    def _send(self, batch: pa.RecordBatch, tombstones: pa.BooleanArray | None = None) -> None:
        """Send ``batch`` as records (``tombstones``: rows whose value is null)."""
        cfg = self._settings
        # encode first: a value the encoding refuses fails the task before anything
        # of this batch is sent (and before a producer is opened for the first one)
        keys = encode.to_binary(batch.column(cfg.key)) if cfg.key else None
        values = encode.to_binary(batch.column(cfg.value)) if cfg.value else self._json(batch)
        if cfg.value and cfg.rules is not None and values.null_count:
            self._check_changelog_nulls(batch, values, tombstones)
        if tombstones is not None:
            values = pc.if_else(tombstones, pa.scalar(None, values.type), values)
        elif cfg.value and values.null_count:
            self._check_nulls(batch, keys, values)
        headers = [(name, encode.to_binary(batch.column(name))) for name in cfg.headers]
        self._check_sizes(keys, values, headers)
        producer = self._producer or self._begin()
        n = len(self._partitions)
        indexes = partitioner.partition_indexes(keys, n, self._round_robin, rows=batch.num_rows)
        self._round_robin = (self._round_robin + 1) % n
        topic = cfg.topic
        announcing = cfg.registry_topic is not None and not self._announced
        if announcing:
            assert cfg.registry_topic is not None
            used = np.flatnonzero(np.bincount(indexes, minlength=n))
            self._announce(producer, cfg.registry_topic, [self._partitions[i] for i in used])
        by_partition = records.batches_by_partition(
            indexes,
            self._partitions,
            keys,
            values,
            headers,
            sequence=lambda partition: producer.next_sequence(topic, partition),
            producer_id=producer.producer_id,
            producer_epoch=producer.epoch,
            transactional=True,
            timestamp_ms=int(time.time() * 1000),
            compression=self._options.compression,
            max_batch_bytes=self._batch_limit(),
        )
        if announcing:  # framed while the announcement was on its way
            producer.flush()  # acknowledged before any data is sent
            self._check_unconfirmed(producer)
            self._announced = True
        producer.send(topic, by_partition)
        self._rows += batch.num_rows
        self._bytes += sum(len(b.data) for bs in by_partition.values() for b in bs)

    def _json(self, batch: pa.RecordBatch) -> pa.Array:
        rules = self._settings.rules
        if rules is not None and rules.delete_when is not None:  # not written
            batch = batch.drop_columns([rules.delete_when.column])
        try:
            return encode.json_values(batch)
        except encode.JSONEncodeError as e:
            raise encode.JSONEncodeError(
                f"{self._settings.where}: batch rows {self._rows} to "
                f"{self._rows + batch.num_rows - 1} of this task: {e}"
            ) from e

    def _check_changelog_nulls(
        self, batch: pa.RecordBatch, values: pa.Array, tombstones: pa.BooleanArray | None
    ) -> None:
        """A changelog's write (a row ``delete_when`` does not mark) must have a
        value: a null one would be a tombstone, a delete after compaction, where
        PostgreSQL and Delta keep the row. Refuse it, naming the key."""
        nulls = pc.is_null(values)
        if tombstones is not None:
            nulls = pc.and_(nulls, pc.invert(tombstones))
        hits = np.flatnonzero(nulls.to_numpy(zero_copy_only=False))
        if len(hits):
            cfg = self._settings
            assert cfg.rules is not None
            row = int(hits[0])
            key = {k: batch.column(k)[row].as_py() for k in cfg.rules.key}
            raise NullValueError(
                f"{cfg.where}: the write of key {key} has a null value column {cfg.value!r}; "
                "in a changelog a null value is a tombstone, which deletes the key, so a "
                "write needs a value (mark deletes with delete_when, or fill the value)"
            )

    def _check_nulls(self, batch: pa.RecordBatch, keys: pa.Array | None, values: pa.Array) -> None:
        """An event (no changelog rules) with a null value: refused without a key
        (a Kafka record needs a key or a value); with a key it is a tombstone,
        refused on a compacted topic (it would delete the key there) and
        written as it is elsewhere (a legal record, which deletes nothing)."""
        cfg = self._settings
        both = pc.is_null(values) if keys is None else pc.and_(pc.is_null(keys), pc.is_null(values))
        hits = np.flatnonzero(both.to_numpy(zero_copy_only=False))
        if len(hits):
            raise ValueError(
                f"{cfg.where}: a row (number {self._rows + int(hits[0])} of this "
                f"task) has a null value column {cfg.value!r} and no key; a Kafka "
                "record needs a key or a value (a null value with a key is a tombstone)"
            )
        if keys is None or cfg.key is None or not is_compacted(cfg.topic_cleanup_policy):
            return
        hits = np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))
        if len(hits):
            row = int(hits[0])
            key = {cfg.key: batch.column(cfg.key)[row].as_py()}
            raise NullValueError(
                f"{cfg.where}: the row of key {key} (number {self._rows + row} of this task) "
                f"has a null value column {cfg.value!r}; topic {cfg.topic!r} is compacted "
                f"(cleanup.policy={cfg.topic_cleanup_policy}), where a record with a key and a "
                "null value is a tombstone that deletes the key. Fill the value or filter the "
                "row out; to delete keys on purpose, write a changelog (order_by or delete_when)"
            )

    def _batch_limit(self) -> int:
        """The most bytes a record batch holds: the sink's ``batch_size`` and
        ``max_request_size``, and the topic's ``max.message.bytes`` (as the Java
        producer sizes batches)."""
        limits = [self._options.batch_size, self._options.max_request_size]
        if self._settings.topic_max_bytes:
            limits.append(self._settings.topic_max_bytes - _BATCH_HEADER)
        return max(1, min(limits))

    def _check_sizes(
        self, keys: pa.Array | None, values: pa.Array, headers: list[tuple[str, pa.Array]]
    ) -> None:
        """Refuse a record larger than ``max_request_size`` or the topic's
        ``max.message.bytes`` before anything is sent (the task fails: nothing
        of the batch commits), naming its key and size and both limits."""
        size = _lengths(values)
        if keys is not None:
            size = size + _lengths(keys)
        for name, col in headers:
            size = size + _lengths(col) + len(name.encode())
        at = int(np.argmax(size))
        largest = int(size[at]) + _RECORD_OVERHEAD
        limit = self._options.max_request_size
        topic_limit = self._settings.topic_max_bytes
        if largest > limit:
            raise MessageSizeTooLargeError(
                f"The message is {largest} bytes when serialized which is larger than the "
                f"maximum request size you have configured with the max_request_size "
                f"configuration ({limit})"
            )
        if topic_limit and largest > topic_limit:
            key = keys[at].as_py() if keys is not None else None
            if isinstance(key, bytes):
                key = key.decode("utf-8", "replace")  # as the key column gave it
            raise RecordTooLargeError(
                f"{self._settings.where}: the record of key {key} (row {self._rows + at} of "
                f"this task) is {largest} bytes, more than topic {self._settings.topic!r} "
                f"takes (max.message.bytes={topic_limit}; the sink's max_request_size is "
                f"{limit}): raise the topic's max.message.bytes, or make the record smaller"
            )

    def _check_unconfirmed(self, producer: TxnProducer) -> None:
        if producer.unconfirmed:
            raise UnconfirmedWriteError(
                f"{self._settings.where}: Kafka transaction {self._tid}: the broker "
                f"acknowledged {producer.unconfirmed} record(s) without an offset "
                "(DUPLICATE_SEQUENCE_NUMBER: a produce resent after the broker restarted or "
                "lost a request), so this transaction cannot be shown to hold them. The task "
                "fails and its transaction is aborted; Spark's next attempt writes the "
                "partition again"
            )

    # -- prepare / close ------------------------------------------------------------

    def prepare(self) -> Committable | None:
        if self._last_write is not None:
            self._send_winners(self._last_write.finish())
        producer = self._producer
        if producer is None:
            return None
        spans = producer.flush()
        self._check_unconfirmed(producer)
        topic = self._settings.topic
        offsets = {
            str(p): [first, last] for (t, p), (first, last) in sorted(spans.items()) if t == topic
        }
        self._prepared = True
        return {
            "txn": self._txn,
            "transactional_id": self._tid,
            "producer_id": producer.producer_id,
            "epoch": producer.epoch,
            "rows": self._rows,
            "bytes": self._bytes,
            "topic": topic,
            "partitions": offsets,
            "opened_at": round(self._opened_at or time.time(), 3),
        }

    def close(self, failed: bool = False) -> None:
        producer, self._producer = self._producer, None
        wire, self._wire = self._wire, None
        ended_well = not failed and (producer is None or self._prepared)
        try:
            if producer is not None and not (self._prepared and not failed):
                self._abort(producer)
        finally:
            if wire is not None and ended_well:  # kept for this worker's next task
                cfg = self._settings
                timeout_s = self._options.request_timeout_ms / 1000
                task_wires.give_back(wire, cfg.producer_config, timeout_s)
            elif wire is not None:
                with contextlib.suppress(Exception):
                    wire.close()

    def _abort(self, producer: TxnProducer) -> None:
        """Abort the open transaction, bounded; on failure the driver's sweep (or,
        on Apache Kafka, transaction.timeout.ms) aborts it later."""
        done = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                with contextlib.suppress(Exception):
                    producer.flush()  # EndTxn waits for nothing in flight
                producer.abort()
            except BaseException as e:
                errors.append(e)
            finally:
                done.set()

        threading.Thread(target=run, name=f"abort-{self._tid}", daemon=True).start()
        if not done.wait(_ABORT_TIMEOUT_S) or errors:
            log.warning(
                "could not abort Kafka transaction %s (%s); the driver's sweep aborts it",
                self._tid,
                errors[0] if errors else "timed out",
            )


def _lengths(arr: pa.Array) -> np.ndarray:
    """Byte length of each element (0 for null) of a binary array."""
    return pc.fill_null(pc.binary_length(arr), 0).to_numpy(zero_copy_only=False)
