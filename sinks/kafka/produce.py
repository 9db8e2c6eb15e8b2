"""One task's Kafka transaction, spoken in raw protocol: the writer's producer.

Longer than 450 lines because the transaction's requests, the pipelined produce
and the per-partition error rules below all act on one producer's state
(sequences, requests in flight, batches to resend), so they are read together.

kafka-python's ``KafkaProducer.send`` costs about 60 µs per record (a future,
a header list, a partitioner call and an accumulator append in Python). The
writer instead encodes whole record batches from Arrow
(:mod:`sinks.kafka.records`) and hands them to :class:`TxnProducer`, which
speaks the few requests a transactional producer needs over kafka-python's
network layer (connections, security, versions):

* ``InitProducerId`` with the transactional id (a fresh id has nothing to abort)
  gives the producer id and epoch;
* ``AddPartitionsToTxn`` (v3 and below: the driver speaks the classic
  transaction protocol) before the first batch of each partition;
* ``Produce`` with ``acks=-1`` and the transactional id: at most one batch per
  partition per request, requests to a leader pipelined up to
  ``max_in_flight`` deep (Kafka keeps the last five batches per producer and
  partition to check sequences), each batch's ``base_sequence`` continuing the
  partition's sequence;
* ``EndTxn`` only to abort: the commit is the driver's.

Errors of a produce, per partition:

* retriable (``NOT_LEADER_OR_FOLLOWER``, ``REQUEST_TIMED_OUT``, a closed
  connection, ...): every request still in flight is waited for, the leaders
  are looked up again, and the failed batches are sent again, in sequence
  order, with the same bytes (hence the same sequence numbers: the broker
  keeps each batch once). A later batch of the same partition answered
  ``OUT_OF_ORDER_SEQUENCE_NUMBER`` in that round only followed the failed one
  and is resent too; outside such a round that answer is fatal for the attempt;
* ``DUPLICATE_SEQUENCE_NUMBER``: the broker says it already has the batch but
  gives no offset; tansu on S3 can acknowledge a batch it lost, so the batch is
  counted as unconfirmed and the writer fails the attempt
  (:class:`~sinks.errors.UnconfirmedWriteError`);
* anything else (fenced, too large, not authorised) fails the attempt.

Resends stop at ``delivery_timeout_ms``. Memory stays bounded: at most
``max_in_flight`` requests of at most ``max_request_bytes`` per leader.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kafka.errors as Errors
from kafka.future import Future
from kafka.protocol.producer import AddPartitionsToTxnRequest, ProduceRequest

from sinks.errors import TwoPhaseError
from sinks.kafka.records import EncodedBatch
from sinks.kafka.wire import OPEN_STATES, TRANSIENT, KafkaWire

log = logging.getLogger("sinks.kafka")

_PRODUCE_MAX_VERSION = 11  # v12 adds partitions implicitly (transactions v2): not for us
_ADD_PARTITIONS_MAX_VERSION = 3
_SEQUENCE_WRAP = 1 << 31


_COMPRESSION = {
    None: None,
    "none": None,
    "gzip": "gzip",
    "snappy": "snappy",
    "lz4": "lz4",
    "zstd": "zstd",
}


@dataclass(frozen=True)
class ProducerOptions:
    """The settings of the writers' producer, from the sink's ``producer_config``
    (kafka-python ``KafkaProducer`` names, with its defaults except ``batch_size``).

    ``linger_ms`` and other keys of kafka-python's accumulator have no effect:
    each Arrow batch is encoded and sent whole."""

    request_timeout_ms: int = 30_000
    delivery_timeout_ms: int = 120_000
    retry_backoff_ms: int = 100
    max_in_flight: int = 5
    max_request_size: int = 1 << 20
    batch_size: int = 1 << 20
    compression: str | None = None

    @classmethod
    def of(cls, config: dict[str, Any]) -> ProducerOptions:
        """Options from a ``producer_config`` (unknown keys are the caller's to check)."""
        compression = config.get("compression_type")
        if compression not in _COMPRESSION:
            raise ValueError(
                f"compression_type {compression!r}: use one of gzip, snappy, lz4, zstd or None"
            )
        d = cls()
        return cls(
            request_timeout_ms=int(config.get("request_timeout_ms", d.request_timeout_ms)),
            delivery_timeout_ms=int(config.get("delivery_timeout_ms", d.delivery_timeout_ms)),
            retry_backoff_ms=int(config.get("retry_backoff_ms", d.retry_backoff_ms)),
            max_in_flight=min(
                5, int(config.get("max_in_flight_requests_per_connection", d.max_in_flight))
            ),
            max_request_size=int(config.get("max_request_size", d.max_request_size)),
            batch_size=int(config.get("batch_size", d.batch_size)),
            compression=_COMPRESSION[compression],
        )


@dataclass
class _Pending:
    """One batch on its way: where it goes and what it holds."""

    topic: str
    partition: int
    batch: EncodedBatch


@dataclass
class _InFlight:
    node: Any
    future: Any
    pending: list[_Pending]
    done: threading.Event = field(default_factory=threading.Event)


class ProduceError(Errors.KafkaError):  # type: ignore[misc]  # kafka-python has no hints
    """A produce the attempt cannot recover from (fenced, refused, timed out)."""


class OpenTransactionError(ProduceError, TwoPhaseError):
    """A pooled transactional id still holds another attempt's open transaction.

    The attempt fails rather than abort that transaction. What follows is
    Spark's: on a cluster (``spark.task.maxFailures``, 4 by default) the task
    runs again under its next attempt number, hence another id; under
    ``local[N]`` a task has one try, so the batch fails and the job with it
    (``TaskFailedError``, whose cause is this whole message). The failed batch
    is not lost: the next run writes it again. The other attempt's transaction
    ends first: the failed run's settling, else the next run's recovery, ends
    the announced ones no ledger entry owns, and Kafka aborts any other at its
    ``transaction_timeout_ms``."""

    def __str__(self) -> str:
        # the message alone: kafka-python's KafkaError puts the class name first,
        # which a traceback (and the job's one-line cause) prints already
        return Exception.__str__(self)


class TxnProducer:
    """The producer of one transaction (one task attempt).

    With ``transactional_id=None`` it is an idempotent producer outside any
    transaction (the benchmarks' at-least-once twin, same encoder and pipeline).
    Not thread-safe: one writer calls it. ``wire`` is owned by the caller.
    """

    def __init__(
        self,
        wire: KafkaWire,
        transactional_id: str | None,
        *,
        transaction_timeout_ms: int,
        options: ProducerOptions | None = None,
    ) -> None:
        options = options or ProducerOptions()
        if not 1 <= options.max_in_flight <= 5:
            raise ValueError("max_in_flight must be between 1 and 5 (Kafka checks 5 batches)")
        self.wire = wire
        self.transactional_id = transactional_id
        self.transaction_timeout_ms = transaction_timeout_ms
        self.request_timeout_ms = options.request_timeout_ms
        self.delivery_timeout_ms = options.delivery_timeout_ms
        self.retry_backoff_s = options.retry_backoff_ms / 1000
        self.max_in_flight = options.max_in_flight
        self._max_request_bytes = options.max_request_size
        self.producer_id = -1
        self.epoch = -1
        self._coordinator: Any = None
        self._leaders: dict[str, dict[int, Any]] = {}
        self._prefetched: Callable[[], dict[str, dict[int, int] | None]] | None = None
        self._added: set[tuple[str, int]] = set()
        self._sequences: dict[tuple[str, int], int] = {}
        self._in_flight: dict[Any, collections.deque[_InFlight]] = collections.defaultdict(
            collections.deque
        )
        self._retry: list[_Pending] = []
        self._failed_round: set[tuple[str, int]] = set()
        self._offsets: dict[tuple[str, int], list[int]] = {}
        self.unconfirmed = 0
        self._error: BaseException | None = None

    # -- transaction ---------------------------------------------------------------------

    def begin(self, *, guard: bool = False) -> None:
        """InitProducerId for the transactional id (retrying what is retriable).

        With ``guard`` (a pooled id, :mod:`sinks.kafka.pool`), DescribeTransactions
        first: an id whose transaction is open belongs to another attempt (one of
        an earlier lease that began late), whose prepared work an InitProducerId
        would abort, so :class:`OpenTransactionError` fails this attempt instead
        (a retry of the task takes another id; where Spark does not retry, the
        job fails and its next run writes the batch again)."""
        deadline = time.monotonic() + self.request_timeout_ms / 1000 * 2
        while True:
            if guard:  # again before every attempt: the id's state may have changed
                self._refuse_open(deadline)
            try:
                coordinator = self._find_coordinator() if self.transactional_id else None
                error, pid, epoch = self.wire.init_producer_id(
                    coordinator, self.transactional_id, self.transaction_timeout_ms
                )
            except TRANSIENT as e:
                error, pid, epoch = type(e), -1, -1
            if error is Errors.NoError:
                self.producer_id, self.epoch = int(pid), int(epoch)
                return
            self._retry_or_raise(error, deadline, "InitProducerId")

    def _refuse_open(self, deadline: float) -> None:
        assert self.transactional_id is not None
        while True:
            try:
                found = self.wire.describe_transaction(
                    self._find_coordinator(), self.transactional_id
                )
            except TRANSIENT as e:
                self._retry_or_raise(type(e), deadline, "DescribeTransactions")
                continue
            if found is None or found.state not in OPEN_STATES:
                return
            if found.state == "Ongoing":
                raise OpenTransactionError(
                    f"Kafka transactional id {self.transactional_id} holds an open transaction "
                    f"(producer id {found.producer_id}, epoch {found.epoch}) of another task "
                    "attempt, which this attempt refuses to abort: it fails. On a cluster Spark "
                    "runs the task again under its next attempt number, hence another id (up "
                    "to spark.task.maxFailures, 4 by default); under local[N] a task has one "
                    "try (local[N,F]: F), so the batch fails and the job stops: run the job "
                    "again, and it writes the batch again once that transaction has ended (its "
                    "recovery ends those the registry shows; Kafka aborts any other after "
                    f"transaction_timeout_ms={self.transaction_timeout_ms})"
                )
            self._retry_or_raise(Errors.ConcurrentTransactionsError, deadline, "InitProducerId")

    def abort(self) -> None:
        """EndTxn(abort); raises what the broker answered if not NoError."""
        if self.producer_id < 0 or self.transactional_id is None:
            return
        error = self.wire.end_txn(
            self._find_coordinator(), self.transactional_id, self.producer_id, self.epoch, False
        )
        if error is not Errors.NoError:
            raise error(f"abort of Kafka transaction {self.transactional_id}")

    def _find_coordinator(self, refresh: bool = False) -> Any:
        assert self.transactional_id is not None
        if self._coordinator is None or refresh:
            found = self.wire.find_coordinators([self.transactional_id])
            self._coordinator = found[self.transactional_id]
        return self._coordinator

    def _retry_or_raise(self, error: type[BaseException], deadline: float, what: str) -> None:
        if not issubclass(error, TRANSIENT) or time.monotonic() > deadline:
            raise ProduceError(
                f"{what} for Kafka transaction {self.transactional_id}: {error.__name__}"
            )
        if error is not Errors.ConcurrentTransactionsError:
            self._coordinator = None  # look it up again
        time.sleep(self.retry_backoff_s)

    def add_partitions(self, topic: str, partitions: Iterable[int]) -> None:
        """AddPartitionsToTxn for those of ``partitions`` not yet in the transaction."""
        self.add_to_txn({topic: partitions})

    def add_to_txn(self, partitions: Mapping[str, Iterable[int]]) -> None:
        """AddPartitionsToTxn, one request, for those of ``partitions`` (per topic)
        not yet in the transaction. Adding a partition writes nothing to it: it
        only tells the coordinator where EndTxn writes its markers."""
        new = {
            topic: sorted({p for p in ps if (topic, p) not in self._added})
            for topic, ps in partitions.items()
        }
        new = {topic: ps for topic, ps in new.items() if ps}
        if not new or self.transactional_id is None:
            return
        topic_class = AddPartitionsToTxnRequest.AddPartitionsToTxnTopic
        deadline = time.monotonic() + self.delivery_timeout_ms / 1000
        while True:
            request = AddPartitionsToTxnRequest(
                v3_and_below_transactional_id=self.transactional_id,
                v3_and_below_producer_id=self.producer_id,
                v3_and_below_producer_epoch=self.epoch,
                v3_and_below_topics=[topic_class(name=t, partitions=ps) for t, ps in new.items()],
                max_version=_ADD_PARTITIONS_MAX_VERSION,
            )
            try:
                response = self.wire.send(request, self._find_coordinator())
                errors = {
                    Errors.for_code(r.partition_error_code)
                    for t in response.results_by_topic_v3_and_below
                    for r in t.results_by_partition
                }
            except TRANSIENT as e:
                errors = {type(e)}
            errors.discard(Errors.NoError)
            if not errors:
                self._added.update((t, p) for t, ps in new.items() for p in ps)
                return
            # one partition's refusal answers OPERATION_NOT_ATTEMPTED for the others
            errors.discard(Errors.OperationNotAttemptedError)
            worst = next(iter(errors), Errors.OperationNotAttemptedError)
            self._retry_or_raise(worst, deadline, f"AddPartitionsToTxn {new}")

    # -- sequences and leaders -----------------------------------------------------------

    def next_sequence(self, topic: str, partition: int) -> int:
        """The base sequence the next batch of ``topic``/``partition`` must carry."""
        return self._sequences.get((topic, partition), 0)

    def prefetch_leaders(self, topics: list[str]) -> None:
        """Ask for the leaders of ``topics`` now, in one request, without waiting:
        :meth:`leaders` takes the answer (what it asks meanwhile goes out beside)."""
        self._prefetched = self.wire.leaders_later(topics)

    def leaders(self, topic: str, refresh: bool = False) -> dict[int, Any]:
        """``{partition: leader}`` of ``topic`` (cached)."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            with contextlib.suppress(*TRANSIENT):  # asked again below
                for t, found in prefetched().items():
                    if found:
                        self._leaders.setdefault(t, found)
        if refresh or topic not in self._leaders:
            found = self.wire.partition_leaders(topic)
            if not found:
                raise ProduceError(f"Kafka topic {topic!r} has no partitions (does it exist?)")
            self._leaders[topic] = found
        return self._leaders[topic]

    def _leader(self, topic: str, partition: int) -> Any:
        """The partition's leader, or -1 while none can be found (the produce to
        -1 then fails as retriable and is resent after a new lookup)."""
        leader = self.leaders(topic).get(partition)
        if leader is None or leader < 0:
            try:
                leader = self.leaders(topic, refresh=True).get(partition, -1)
            except TRANSIENT:
                leader = -1
        return leader

    # -- produce -------------------------------------------------------------------------

    def send(self, topic: str, batches: Mapping[int, Sequence[EncodedBatch]]) -> None:
        """Queue ``batches`` (per partition, in sequence order) and send them,
        pipelined; returns once they are on the wire (not acknowledged)."""
        self._raise_if_failed()
        pending: list[_Pending] = []
        for partition, items in batches.items():
            key = (topic, partition)
            for batch in items:
                expected = self._sequences.get(key, 0)
                if batch.base_sequence != expected:
                    raise ValueError(
                        f"{topic}/{partition}: batch sequence {batch.base_sequence}, "
                        f"expected {expected}"
                    )
                self._sequences[key] = (expected + batch.records) % _SEQUENCE_WRAP
                pending.append(_Pending(topic, partition, batch))
        self.add_partitions(topic, batches)
        self._dispatch(pending)

    def flush(self) -> dict[tuple[str, int], tuple[int, int]]:
        """Wait for every batch; return ``{(topic, partition): (first, last offset)}``
        of what this producer wrote. Raises the first fatal error."""
        self._drain()
        self._raise_if_failed()
        return {k: (v[0], v[1]) for k, v in self._offsets.items()}

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _dispatch(self, pending: list[_Pending]) -> None:
        by_node: dict[Any, dict[tuple[str, int], collections.deque[_Pending]]] = {}
        for item in pending:
            leader = self._leader(item.topic, item.partition)
            queues = by_node.setdefault(leader, {})
            queues.setdefault((item.topic, item.partition), collections.deque()).append(item)
        for node, queues in by_node.items():
            while any(queues.values()):
                request_items: list[_Pending] = []
                size = 0
                for queue in queues.values():
                    fits = (
                        size + len(queue[0].batch.data) <= self._max_request_bytes
                        if queue
                        else False
                    )
                    if queue and (not request_items or fits):
                        item = queue.popleft()
                        request_items.append(item)
                        size += len(item.batch.data)
                self._submit(node, request_items)

    def _submit(self, node: Any, items: list[_Pending]) -> None:
        queue = self._in_flight[node]
        while len(queue) >= self.max_in_flight:
            self._complete(queue.popleft())
        topic_class = ProduceRequest.TopicProduceData
        partition_class = topic_class.PartitionProduceData
        topics: dict[str, list[Any]] = {}
        for item in items:
            topics.setdefault(item.topic, []).append(
                partition_class(index=item.partition, records=item.batch.data)
            )
        request = ProduceRequest(
            transactional_id=self.transactional_id,
            acks=-1,
            timeout_ms=self.request_timeout_ms,
            topic_data=[topic_class(name=t, partition_data=ps) for t, ps in topics.items()],
            min_version=3,
            max_version=_PRODUCE_MAX_VERSION,
        )
        entry = _InFlight(node, None, items)
        if node is None or node < 0:
            entry.future = _failed(Errors.LeaderNotAvailableError("no leader"))
            entry.done.set()
        else:
            entry.future = self.wire.submit(request, node)
            entry.future.add_both(lambda _: entry.done.set())
        queue.append(entry)

    def _complete(self, entry: _InFlight) -> None:
        """Wait for one request and file its answer."""
        if not entry.done.wait(self.request_timeout_ms / 1000 + 10):
            raise ProduceError(f"no answer to a produce request to broker {entry.node}")
        future = entry.future
        if future.failed():
            exc = future.exception
            error = exc if isinstance(exc, BaseException) else Errors.KafkaError(str(exc))
            for item in entry.pending:
                self._file_error(item, type(error), str(error))
            return
        answers: dict[tuple[str, int], Any] = {}
        for t in future.value.responses:
            for p in t.partition_responses:
                answers[(t.name, p.index)] = p
        for item in entry.pending:
            p = answers.get((item.topic, item.partition))
            if p is None:
                self._file_error(item, Errors.KafkaProtocolError, "no answer for the partition")
                continue
            error = Errors.for_code(p.error_code)
            if error is Errors.NoError:
                first = int(p.base_offset)
                last = first + item.batch.records - 1
                span = self._offsets.get((item.topic, item.partition))
                if span is None:
                    self._offsets[(item.topic, item.partition)] = [first, last]
                else:
                    span[0], span[1] = min(span[0], first), max(span[1], last)
            else:
                message = getattr(p, "error_message", None) or ""
                self._file_error(item, error, message)

    def _file_error(self, item: _Pending, error: type[BaseException], message: str) -> None:
        key = (item.topic, item.partition)
        if error is Errors.DuplicateSequenceNumberError:
            self.unconfirmed += item.batch.records
            return
        retriable = issubclass(error, TRANSIENT)
        follows_failure = (
            error is Errors.OutOfOrderSequenceNumberError and key in self._failed_round
        )
        if retriable or follows_failure:
            self._failed_round.add(key)
            self._retry.append(item)
            return
        if self._error is None:
            self._error = ProduceError(
                f"produce to {item.topic}/{item.partition} (Kafka transaction "
                f"{self.transactional_id}): {error.__name__} {message}".rstrip()
            )

    def _drain(self) -> None:
        """Wait for everything in flight; resend what failed retriably, in order,
        until nothing is left or the delivery timeout passes."""
        deadline = time.monotonic() + self.delivery_timeout_ms / 1000
        while True:
            for queue in self._in_flight.values():
                while queue:
                    self._complete(queue.popleft())
            if not self._retry or self._error is not None:
                self._retry.clear()
                self._failed_round.clear()
                return
            if time.monotonic() > deadline:
                self._error = ProduceError(
                    f"Kafka transaction {self.transactional_id}: {len(self._retry)} batch(es) "
                    f"not written within delivery_timeout_ms={self.delivery_timeout_ms}"
                )
                continue
            retry = sorted(self._retry, key=lambda i: (i.topic, i.partition, i.batch.base_sequence))
            self._retry = []
            self._failed_round.clear()
            log.info(
                "Kafka transaction %s: resending %d batch(es) after a retriable error",
                self.transactional_id,
                len(retry),
            )
            time.sleep(self.retry_backoff_s)
            for topic in {i.topic for i in retry}:
                with contextlib.suppress(*TRANSIENT):
                    self.leaders(topic, refresh=True)
            self._dispatch(retry)


def _failed(error: BaseException) -> Any:
    return Future().failure(error)
