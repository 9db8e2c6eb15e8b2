"""Executor side of the Kafka sink: one transactional producer per task attempt.

Life of a writer (nothing is opened for an empty partition):

1. first non-empty batch, once its records are encoded: a ``KafkaProducer`` with
   ``transactional_id`` = the task's transaction name (deterministic, optionally
   prefixed); ``init_transactions()`` (a fresh id: nothing to abort),
   ``begin_transaction()``, the id is announced in the registry topic and flushed
   (see :mod:`sinks.kafka.registry`);
2. ``write``: keys, values and headers are built column-wise from Arrow
   (:mod:`sinks.kafka.encode`) before anything of the batch is sent, so a value
   the JSON encoding refuses fails the task with nothing of that batch in the
   transaction; every row is sent with an explicit partition (murmur2 of the key,
   as Kafka's default partitioner, or round-robin per Arrow batch for keyless rows);
3. ``prepare``: ``flush()``, fail if any send failed or any record (the
   announcement included) was acknowledged without an offset, and return the
   committable with the producer id and epoch, without committing or aborting.
   A broker answers a produce DUPLICATE_SEQUENCE_NUMBER when it already has the
   batch's sequence numbers (a produce retried across a broker restart), and
   kafka-python then reports the records written, with offset -1. Apache Kafka
   holds such a batch; tansu on S3 persists a producer's new sequence number
   before it stores the batch, so a SIGKILL between the two loses the batch
   while its retry is acknowledged. The task cannot tell which, so it fails
   (:class:`~sinks.errors.UnconfirmedWriteError`), its transaction is aborted,
   and Spark's next attempt writes the partition again;
4. ``close``: after ``prepare`` the producer is closed with ``timeout=0``, which
   stops its I/O thread without any EndTxn (kafka-python 3.0 never aborts on
   close; the Java client, and possibly other kafka-python versions, abort on a
   graceful close, and a forced close skips that path). ``close(failed=True)``
   after ``prepare``, and any close before it, abort the transaction (best
   effort, bounded; the driver's sweep aborts what this misses).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import kafka.errors as Errors
import pyarrow as pa
from kafka import KafkaProducer
from kafka.net.compat import KafkaNetClient
from kafka.partitioner.default import murmur2

from sinks.base import Committable, SinkWriter, WriteContext
from sinks.errors import UnconfirmedWriteError
from sinks.kafka import encode
from sinks.kafka.registry import announcement

if TYPE_CHECKING:
    from sinks.kafka.sink import KafkaSink

log = logging.getLogger("sinks.kafka")

_ABORT_TIMEOUT_S = 30.0


class RetryingNetClient(KafkaNetClient):
    """The writers' kafka-python network client (``KafkaProducer(kafka_client=...)``):
    ``await_ready`` answers False for a node it cannot reach instead of raising.

    kafka-python 3.0.12's Sender, about to send a transactional request
    (AddPartitionsToTxn, EndTxn...) to a coordinator whose connection attempt
    fails (a broker restarting), catches the exception, looks the coordinator
    up again, and drops the request: it re-enqueues it only when ``await_ready``
    returned False. A dropped AddPartitionsToTxn leaves the records of those
    partitions unsent until ``delivery_timeout_ms`` expires them (2 minutes by
    default) and the task fails; with False, the request is retried once the
    coordinator is found again. The Sender is this client's only caller of
    ``await_ready``. A ``kafka_client`` in ``producer_config`` replaces it."""

    def await_ready(self, node_id: Any, timeout_ms: int = 30000) -> bool:
        try:
            return bool(super().await_ready(node_id, timeout_ms=timeout_ms))
        except Errors.KafkaConnectionError:
            return False


def producer_ids(producer: KafkaProducer) -> tuple[int, int]:
    """(producer id, epoch) of a transactional producer (kafka-python internal
    ``_transaction_manager.producer_id_and_epoch``, present in 2.x and 3.x)."""
    tm = getattr(producer, "_transaction_manager", None)
    pe = getattr(tm, "producer_id_and_epoch", None)
    if pe is None:
        raise RuntimeError(
            "this kafka-python version does not expose the producer id and epoch "
            "(KafkaProducer._transaction_manager.producer_id_and_epoch); use kafka-python 3.0"
        )
    return int(pe.producer_id), int(pe.epoch)


class KafkaWriter(SinkWriter):
    """Writes one task's partition into one Kafka transaction and prepares it."""

    def __init__(self, sink: KafkaSink, ctx: WriteContext, schema: pa.Schema) -> None:
        self._sink = sink
        self._txn = str(ctx.txn_name())
        self._tid = sink.transactional_id(ctx.txn_name())
        self._spark_partition = ctx.partition
        self._producer: KafkaProducer | None = None
        self._partitions: list[int] = []
        self._round_robin = 0
        self._first: dict[int, Any] = {}  # kafka partition -> future of its first record
        self._last: dict[int, Any] = {}  # kafka partition -> future of its latest record
        self._errors: list[BaseException] = []
        self._unplaced = 0  # records acknowledged without an offset (see the module doc)
        self._rows = 0
        self._prepared = False
        self._opened_at: float | None = None

    # -- opening ----------------------------------------------------------------------

    def _begin(self) -> KafkaProducer:
        sink = self._sink
        producer = KafkaProducer(**sink.producer_settings(self._tid))
        self._producer = producer
        producer.init_transactions()
        producer.begin_transaction()
        self._opened_at = time.time()  # the broker's timer starts with the first record
        if sink.registry_topic:
            future = producer.send(
                sink.registry_topic, key=self._tid.encode(), value=announcement(sink.topic)
            )
            future.add_callback(self._on_ack)
            future.get(timeout=sink.flush_timeout)
        partitions = producer.partitions_for(sink.topic)
        if not partitions:
            raise RuntimeError(f"Kafka topic {sink.topic!r} has no partitions (does it exist?)")
        self._partitions = sorted(partitions)
        self._round_robin = self._spark_partition % len(self._partitions)
        return producer

    # -- writing ----------------------------------------------------------------------

    def _on_error(self, exc: BaseException) -> None:
        self._errors.append(exc)

    def _on_ack(self, metadata: Any) -> None:
        if metadata.offset < 0:  # DUPLICATE_SEQUENCE_NUMBER: stored or not, nobody knows
            self._unplaced += 1

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        sink = self._sink
        n = batch.num_rows
        # encode first: a value the encoding refuses fails the task before anything
        # of this batch is sent (and before a producer is opened for the first one)
        keys: list[bytes | None] = (
            encode.to_bytes(batch.column(sink.key)) if sink.key else [None] * n
        )
        values = encode.to_bytes(batch.column(sink.value)) if sink.value else self._json(batch)
        if sink.value and None in values:
            self._check_nulls(keys, values)
        headers = self._headers(batch)
        producer = self._producer or self._begin()
        parts = self._partition_of(keys)
        send, topic, on_error, on_ack = producer.send, sink.topic, self._on_error, self._on_ack
        first, last = self._first, self._last
        for key, value, hdrs, part in zip(keys, values, headers, parts, strict=True):
            future = send(topic, value=value, key=key, headers=hdrs, partition=part)
            future.add_errback(on_error)
            future.add_callback(on_ack)
            if part not in first:
                first[part] = future
            last[part] = future
        self._rows += n
        if self._errors:
            raise self._errors[0]

    def _json(self, batch: pa.RecordBatch) -> list[bytes]:
        try:
            return encode.json_rows(batch)
        except encode.JSONEncodeError as e:
            raise encode.JSONEncodeError(
                f"{self._sink.describe()}: batch rows {self._rows} to "
                f"{self._rows + batch.num_rows - 1} of this task: {e}"
            ) from e

    def _check_nulls(self, keys: list[bytes | None], values: list[bytes | None]) -> None:
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k is None and v is None:
                raise ValueError(
                    f"{self._sink.describe()}: a row (number {self._rows + i} of this task) has "
                    f"a null value column {self._sink.value!r} and no key; a Kafka record needs "
                    "a key or a value (a null value with a key is a tombstone)"
                )

    def _headers(self, batch: pa.RecordBatch) -> list[list[tuple[str, bytes]] | None]:
        names = self._sink.headers
        if not names:
            return [None] * batch.num_rows
        columns = [(name, encode.to_bytes(batch.column(name))) for name in names]
        rows: list[list[tuple[str, bytes]] | None] = []
        for i in range(batch.num_rows):
            row = [(name, vals[i]) for name, vals in columns if vals[i] is not None]
            rows.append(row or None)
        return rows

    def _partition_of(self, keys: list[bytes | None]) -> list[int]:
        ps = self._partitions
        n = len(ps)
        rr = ps[self._round_robin]
        self._round_robin = (self._round_robin + 1) % n
        if n == 1:
            return [ps[0]] * len(keys)
        return [rr if k is None else ps[(murmur2(k) & 0x7FFFFFFF) % n] for k in keys]

    # -- prepare / close ------------------------------------------------------------

    def prepare(self) -> Committable | None:
        producer = self._producer
        if producer is None:
            return None
        producer.flush(timeout=self._sink.flush_timeout)
        if self._errors:
            raise RuntimeError(
                f"Kafka transaction {self._tid}: {len(self._errors)} record(s) were not "
                f"written: {self._errors[0]!r}"
            ) from self._errors[0]
        if self._unplaced:
            raise UnconfirmedWriteError(
                f"{self._sink.describe()}: Kafka transaction {self._tid}: the broker "
                f"acknowledged {self._unplaced} record(s) without an offset "
                "(DUPLICATE_SEQUENCE_NUMBER: a produce retried after the broker restarted or "
                "lost a request), so this transaction cannot be shown to hold them. The task "
                "fails and its transaction is aborted; Spark's next attempt writes the "
                "partition again"
            )
        offsets: dict[str, list[int]] = {}
        for part, first in sorted(self._first.items()):
            offsets[str(part)] = [
                first.get(timeout=1).offset,
                self._last[part].get(timeout=1).offset,
            ]
        producer_id, epoch = producer_ids(producer)
        self._prepared = True
        return {
            "txn": self._txn,
            "transactional_id": self._tid,
            "producer_id": producer_id,
            "epoch": epoch,
            "rows": self._rows,
            "topic": self._sink.topic,
            "partitions": offsets,
            "opened_at": round(self._opened_at or time.time(), 3),
        }

    def close(self, failed: bool = False) -> None:
        producer, self._producer = self._producer, None
        if producer is None:
            return
        keep = self._prepared and not failed
        try:
            if not keep:
                self._abort(producer)
        finally:
            self._shut(producer, keep)

    @staticmethod
    def _shut(producer: KafkaProducer, keep: bool) -> None:
        """Stop the producer. ``timeout=0`` forces the close: no graceful shutdown
        path, hence no EndTxn. It refuses (KafkaTimeoutError) while records are
        still unacknowledged, which cannot happen after ``prepare`` flushed; for
        unprepared work a graceful close is then fine (an abort is what we want)."""
        try:
            producer.close(timeout=0)
        except Exception as e:
            if keep:  # leave it to process exit rather than risk an abort
                log.error("forced close of a prepared Kafka producer failed: %r", e)
                return
            with contextlib.suppress(Exception):
                producer.close(timeout=5)

    def _abort(self, producer: KafkaProducer) -> None:
        """Abort the open transaction, bounded; on failure the driver's sweep (or,
        on Apache Kafka, transaction.timeout.ms) aborts it later."""
        done = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                producer.abort_transaction()
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
