"""The few raw Kafka protocol calls the sink needs, over kafka-python's client.

Longer than 450 lines because every raw request the sink sends goes through
this one class over the kafka-python internals listed below, so that a
kafka-python upgrade is checked in one place.

kafka-python's producer can only end a transaction it began itself, and its
``init_transactions()`` aborts whatever is open, so the driver speaks the
protocol directly: FindCoordinator (key type transaction), EndTxn with a
prepared transaction's (transactional id, producer id, epoch), InitProducerId
to fence and abort, Metadata for partition leaders, and Fetch at
``read_uncommitted`` to read raw record batches (control batches included).

Everything goes through one :class:`kafka.KafkaAdminClient` and its connection
manager. kafka-python internals used (kafka-python 3.0.x; 2.x has a different
network layer and these names do not exist there):

* ``KafkaAdminClient._manager`` (``kafka.net.manager.KafkaConnectionManager``):
  ``run(coro)``, ``send(request, node_id=...)``, ``broker_version_data``,
  ``cluster.add_coordinator(...)``, ``cluster.brokers()``;
* the request classes of ``kafka.protocol`` (public, generated from the
  Kafka JSON schemas) and ``kafka.record.MemoryRecords`` to parse batches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import kafka.errors as Errors
from kafka import KafkaAdminClient
from kafka.protocol.admin import DescribeTransactionsRequest, ListTransactionsRequest
from kafka.protocol.consumer import FetchRequest
from kafka.protocol.metadata import (
    CoordinatorType,
    FindCoordinatorRequest,
    MetadataRequest,
)
from kafka.protocol.producer import EndTxnRequest, InitProducerIdRequest
from kafka.record import MemoryRecords

log = logging.getLogger("sinks.kafka")

#: kafka-python configuration keys that are about reaching the cluster (security,
#: client id, timeouts) and so apply to the admin connection as well.
_CLIENT_KEYS = frozenset(KafkaAdminClient.DEFAULT_CONFIG) - {"bootstrap_servers", "kafka_client"}

# Fetch v13+ names topics by id; v12 (Kafka 2.7+) still names them, and every
# broker since Kafka 0.11 that speaks transactions answers it.
_FETCH_MAX_VERSION = 12
# EndTxn v5 / InitProducerId v5+ belong to transactions v2 (KIP-890/KIP-939):
# stay on the v1 protocol the producer itself uses.
_END_TXN_MAX_VERSION = 3
_INIT_PID_MAX_VERSION = 4
_IN_FLIGHT = 4
"""requests sent at once on one connection (kafka-python allows 5 in flight)"""
# How long each Fetch of a raw read may wait for records, by the number of empty
# answers in a row below the high watermark; then the read fails. A read at the end
# of the log is answered after the first wait (a registry refresh with nothing new
# took 50 ms a partition with Kafka's usual max_wait_ms=50). Not 0: tansu answers a
# zero wait with no partition at all. Not always short: tansu on S3 answers a short
# wait with no records below its high watermark. (Nor ListOffsets to skip the read:
# tansu on S3 answered it short of the last control batches.)
_WAITS = (1, 50, 200, 1000)

_COORDINATOR_NOT_READY = (
    Errors.CoordinatorNotAvailableError,
    Errors.CoordinatorLoadInProgressError,
)
"""FindCoordinator answers that pass: the coordinator's log is being created or loaded"""


# What a retry may cure: RetriableError covers dropped connections, timeouts,
# NOT_COORDINATOR, CONCURRENT_TRANSACTIONS, a node not ready...; UnknownBrokerIdError:
# a broker not yet in our metadata (looked up again on the next attempt).
TRANSIENT: tuple[type[BaseException], ...] = (Errors.RetriableError, Errors.UnknownBrokerIdError)


def _init_producer_id(
    transactional_id: str | None, timeout_ms: int, expected: tuple[int, int] | None
) -> Any:
    """An InitProducerId request; with ``expected`` (producer id, epoch) at
    version 3 or above (the first that carries them), never silently without."""
    if expected is None:
        return InitProducerIdRequest(
            transactional_id=transactional_id,
            transaction_timeout_ms=timeout_ms,
            producer_id=-1,
            producer_epoch=-1,
            max_version=_INIT_PID_MAX_VERSION,
        )
    return InitProducerIdRequest(
        transactional_id=transactional_id,
        transaction_timeout_ms=timeout_ms,
        producer_id=expected[0],
        producer_epoch=expected[1],
        min_version=3,
        max_version=_INIT_PID_MAX_VERSION,
    )


def _end_txn(transactional_id: str, producer_id: int, epoch: int, commit: bool) -> Any:
    """An EndTxn request."""
    return EndTxnRequest(
        transactional_id=transactional_id,
        producer_id=producer_id,
        producer_epoch=epoch,
        committed=commit,
        max_version=_END_TXN_MAX_VERSION,
    )


def _metadata(topics: list[str]) -> Any:
    return MetadataRequest(
        topics=[MetadataRequest.MetadataRequestTopic(name=t) for t in topics],
        allow_auto_topic_creation=False,
    )


def _leaders(response: Any, topic: str) -> dict[int, int] | None:
    """``{partition: leader}`` of ``topic`` in a Metadata answer; None if it does not exist."""
    for t in response.topics:
        if t.name != topic:
            continue
        error = Errors.for_code(t.error_code)
        if error is Errors.UnknownTopicOrPartitionError:
            return None
        if error is not Errors.NoError:
            raise error(f"metadata of topic {topic!r}")
        return {p.partition_index: p.leader_id for p in t.partitions}
    return None


def client_config(producer_config: dict[str, Any] | None) -> dict[str, Any]:
    """The part of a producer configuration that also applies to an admin client."""
    return {k: v for k, v in (producer_config or {}).items() if k in _CLIENT_KEYS}


@dataclass(frozen=True)
class TxnState:
    """A transactional id as its coordinator describes it."""

    state: str
    """Empty, Ongoing, PrepareCommit, PrepareAbort, CompleteCommit, CompleteAbort, ..."""
    producer_id: int
    epoch: int


OPEN_STATES = frozenset({"Ongoing", "PrepareCommit", "PrepareAbort", "PrepareEpochFence"})
"""the :attr:`TxnState.state` of a transaction that has not ended"""


@dataclass(frozen=True)
class RawPartition:
    """One Fetch answer for a partition: raw record bytes and offsets."""

    records: bytes
    high_watermark: int
    log_start_offset: int


class KafkaWire:
    """A connection to a cluster for raw protocol requests (driver and tests).

    Not thread-safe for concurrent use by design of the callers (one checkpoint
    at a time); kafka-python's manager itself is safe to call from any thread.
    """

    def __init__(
        self,
        bootstrap_servers: str | list[str],
        *,
        config: dict[str, Any] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.timeout_ms = int(timeout_s * 1000)
        settings: dict[str, Any] = {"client_id": "twophase", **client_config(config)}
        settings.update(
            bootstrap_servers=bootstrap_servers,
            request_timeout_ms=self.timeout_ms,
            bootstrap_timeout_ms=self.timeout_ms,
        )
        self.admin = KafkaAdminClient(**settings)
        self._manager: Any = self.admin._manager

    def close(self) -> None:
        self.admin.close()

    def __enter__(self) -> KafkaWire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------

    def send(self, request: Any, node_id: Any = None) -> Any:
        """Send ``request`` to ``node_id`` (any broker if None) and wait for the answer.

        Raises kafka-python errors: ``KafkaConnectionError`` when the broker closed
        the connection (tansu's answer to a refused EndTxn), ``KafkaTimeoutError``..."""
        manager = self._manager

        async def call() -> Any:
            return await manager.send(request, node_id=node_id)

        return manager.run(call)

    def submit(self, request: Any, node_id: Any) -> Any:
        """Send ``request`` to ``node_id`` without waiting: a kafka-python ``Future``
        of the answer (thread-safe; requests submitted from one thread go out in
        order on the node's connection)."""
        manager = self._manager
        return manager.call_soon(manager.send, request, node_id)

    def api_version(self, request_class: Any) -> int:
        """Highest version of ``request_class`` both sides speak (-1 if none)."""
        try:
            return int(self._manager.broker_version_data.api_version(request_class))
        except Errors.IncompatibleBrokerVersion:
            return -1

    def broker_ids(self) -> list[Any]:
        return [b.node_id for b in self._manager.cluster.brokers()]

    # -- metadata ----------------------------------------------------------------------

    def partition_leaders(self, topic: str) -> dict[int, int] | None:
        """``{partition: leader node id}`` of ``topic``; None if it does not exist."""
        return _leaders(self.send(_metadata([topic])), topic)

    def leaders_later(self, topics: list[str]) -> Callable[[], dict[str, dict[int, int] | None]]:
        """:meth:`partition_leaders` of every one of ``topics`` in one Metadata
        request, sent now without waiting: call the result for the answer
        (``{topic: leaders or None}``), raising what the request raised."""
        answer = self.answer_of(self.submit(_metadata(topics), None), "Metadata")
        return lambda: {t: _leaders(answer(), t) for t in topics}

    def answer_of(self, future: Any, what: str) -> Callable[[], Any]:
        """A function that waits (at most this wire's timeout) for the answer of
        ``future`` (from :meth:`submit`) and returns it, raising its error."""
        answered = threading.Event()
        future.add_both(lambda _: answered.set())

        def wait() -> Any:
            if not answered.wait(self.timeout_ms / 1000 + 1):
                raise Errors.KafkaTimeoutError(f"{what}: no answer")
            if future.failed():
                raise future.exception
            return future.value

        return wait

    # -- transactions ------------------------------------------------------------------

    def find_coordinators(
        self, transactional_ids: list[str], timeout: float = 30.0
    ) -> dict[str, Any]:
        """``{transactional id: coordinator node id}`` (FindCoordinator, key type 1).

        COORDINATOR_NOT_AVAILABLE and COORDINATOR_LOAD_IN_PROGRESS are retried
        for up to ``timeout`` seconds, as Kafka's clients do: Apache Kafka
        answers so while it creates ``__transaction_state`` (at the first
        FindCoordinator of a new cluster) or loads a partition of it."""
        cluster = self._manager.cluster
        kind = CoordinatorType.TRANSACTION
        found: dict[str, Any] = {}
        pending = list(dict.fromkeys(transactional_ids))
        deadline = time.monotonic() + timeout
        while pending:
            answers: list[tuple[str, Any]] = []
            if self.api_version(FindCoordinatorRequest) >= 4:
                response = self.send(
                    FindCoordinatorRequest(
                        key_type=kind.value, coordinator_keys=pending, min_version=4
                    )
                )
                answers = [(c.key, c) for c in response.coordinators]
            else:
                for tid in pending:
                    answers.append(
                        (
                            tid,
                            self.send(
                                FindCoordinatorRequest(key=tid, key_type=kind.value, max_version=3)
                            ),
                        )
                    )
            retry = []
            for tid, answer in answers:
                try:
                    found[tid] = cluster.add_coordinator(
                        answer, kind, tid, synthesize_node_id=False
                    )
                except _COORDINATOR_NOT_READY:
                    if time.monotonic() > deadline:
                        raise
                    retry.append(tid)
            pending = retry
            if pending:
                time.sleep(0.2)
        return found

    def end_txn(
        self, coordinator: Any, transactional_id: str, producer_id: int, epoch: int, commit: bool
    ) -> type[Errors.KafkaError]:
        """Send EndTxn; return the error class of the answer (``NoError`` on success).

        A broker that drops the connection instead of answering (tansu) raises
        ``KafkaConnectionError``."""
        response = self.send(_end_txn(transactional_id, producer_id, epoch, commit), coordinator)
        return Errors.for_code(response.error_code)

    def end_txns(
        self,
        coordinators: Mapping[str, Any],
        transactions: Mapping[str, tuple[int, int]],
        commit: bool,
    ) -> dict[str, type[Errors.KafkaError]]:
        """:meth:`end_txn` for each of ``transactions`` (``{transactional id:
        (producer id, epoch)}``), a few at a time on each coordinator's
        connection (sent without waiting, then their answers collected): the
        error class of each answer, ``KafkaConnectionError`` for each request a
        closed connection carried (tansu's refusal closes it: the other requests
        on it fail with it, and must be asked again)."""
        errors: dict[str, type[Errors.KafkaError]] = {}
        ids = list(transactions)
        for start in range(0, len(ids), _IN_FLIGHT):
            sent = {
                tid: self.answer_of(
                    self.submit(_end_txn(tid, *transactions[tid], commit), coordinators[tid]),
                    f"EndTxn of {tid}",
                )
                for tid in ids[start : start + _IN_FLIGHT]
            }
            for tid, answer in sent.items():
                try:
                    errors[tid] = Errors.for_code(answer().error_code)
                except Errors.KafkaConnectionError:
                    errors[tid] = Errors.KafkaConnectionError
        return errors

    def init_producer_id(
        self,
        coordinator: Any,
        transactional_id: str | None,
        transaction_timeout_ms: int,
        expected: tuple[int, int] | None = None,
    ) -> tuple[type[Errors.KafkaError], int, int]:
        """InitProducerId for ``transactional_id``: bumps its epoch, which fences
        any producer still using it and aborts its open transaction. Without a
        transactional id (``coordinator`` None: any broker): a fresh producer id
        for an idempotent producer.

        ``expected`` (producer id, epoch): the id's producer id and epoch as the
        caller knows them (InitProducerId v3+; refused by an older broker).
        Apache Kafka answers PRODUCER_FENCED when the producer id is another,
        and, for an id whose transaction ended (Empty, CompleteCommit,
        CompleteAbort), also when the epoch is neither the current one nor the
        one just before it (a retry); an id whose transaction is Ongoing is
        fenced whatever the epoch (:func:`sinks.kafka.txn.fence_own`).

        Returns (error class, producer id, new epoch)."""
        response = self.send(
            _init_producer_id(transactional_id, transaction_timeout_ms, expected), coordinator
        )
        return Errors.for_code(response.error_code), response.producer_id, response.producer_epoch

    def init_producer_ids(
        self,
        coordinators: dict[str, Any],
        transactional_ids: list[str],
        timeout_ms: int,
        expected: Mapping[str, tuple[int, int]] | None = None,
    ) -> dict[str, type[Errors.KafkaError]]:
        """:meth:`init_producer_id` for each of ``transactional_ids``, a few at a
        time (sent without waiting, then their answers collected: kafka-python
        keeps at most 5 requests in flight per connection): the error class of
        each. ``expected``: per id, its producer id and epoch as the caller knows
        them (see :meth:`init_producer_id`)."""
        errors: dict[str, type[Errors.KafkaError]] = {}
        for start in range(0, len(transactional_ids), _IN_FLIGHT):
            part = transactional_ids[start : start + _IN_FLIGHT]
            errors.update(self._init_producer_ids(coordinators, part, timeout_ms, expected or {}))
        return errors

    def _init_producer_ids(
        self,
        coordinators: dict[str, Any],
        transactional_ids: list[str],
        timeout_ms: int,
        expected: Mapping[str, tuple[int, int]],
    ) -> dict[str, type[Errors.KafkaError]]:
        sent: dict[str, tuple[Any, threading.Event]] = {}
        for tid in transactional_ids:
            request = _init_producer_id(tid, timeout_ms, expected.get(tid))
            answered = threading.Event()
            future = self.submit(request, coordinators[tid])
            future.add_both(lambda _, done=answered: done.set())
            sent[tid] = (future, answered)
        errors: dict[str, type[Errors.KafkaError]] = {}
        for tid, (future, answered) in sent.items():
            if not answered.wait(self.timeout_ms / 1000):
                raise Errors.KafkaTimeoutError(f"InitProducerId of {tid}: no answer")
            if future.failed():
                raise future.exception
            errors[tid] = Errors.for_code(future.value.error_code)
        return errors

    def describe_transaction(self, coordinator: Any, transactional_id: str) -> TxnState | None:
        """DescribeTransactions of one id at its coordinator: its state, producer
        id and epoch; None when the broker does not implement the request
        (tansu) or does not know the id."""
        if self.api_version(DescribeTransactionsRequest) < 0:
            return None
        response = self.send(
            DescribeTransactionsRequest(transactional_ids=[transactional_id]), coordinator
        )
        for t in response.transaction_states:
            error = Errors.for_code(t.error_code)
            if error is Errors.TransactionalIdNotFoundError:
                return None
            if error is not Errors.NoError:
                raise error(f"DescribeTransactions of {transactional_id}")
            return TxnState(t.transaction_state, t.producer_id, t.producer_epoch)
        return None

    def describe_transactions(
        self, coordinators: dict[str, Any]
    ) -> dict[str, TxnState | None] | None:
        """DescribeTransactions of every id of ``coordinators`` (``{transactional
        id: coordinator node id}``, as :meth:`find_coordinators` gives), one
        request per coordinator: each id's state, producer id and epoch, None
        for an id the broker does not know (never used, or expired). None as a
        whole when the broker does not implement the request (tansu, Kafka
        before 3.0)."""
        if self.api_version(DescribeTransactionsRequest) < 0:
            return None
        by_node: dict[Any, list[str]] = {}
        for tid, node in coordinators.items():
            by_node.setdefault(node, []).append(tid)
        found: dict[str, TxnState | None] = {}
        for node, ids in by_node.items():
            response = self.send(DescribeTransactionsRequest(transactional_ids=ids), node)
            for t in response.transaction_states:
                error = Errors.for_code(t.error_code)
                if error is Errors.TransactionalIdNotFoundError:
                    found[t.transactional_id] = None
                elif error is not Errors.NoError:
                    raise error(f"DescribeTransactions of {t.transactional_id}")
                else:
                    found[t.transactional_id] = TxnState(
                        t.transaction_state, t.producer_id, t.producer_epoch
                    )
        missing = sorted(set(coordinators) - set(found))
        if missing:
            raise Errors.KafkaError(f"DescribeTransactions answered nothing for {missing[:3]}")
        return found

    def list_transactions(self) -> list[str]:
        """Every transactional id the brokers' transaction coordinators hold
        (ListTransactions to each broker); what the pool keeps flat."""
        found: list[str] = []
        for node in self.broker_ids():
            response = self.send(ListTransactionsRequest(), node)
            error = Errors.for_code(response.error_code)
            if error is not Errors.NoError:
                raise error(f"ListTransactions at broker {node}")
            found += [t.transactional_id for t in response.transaction_states]
        return sorted(found)

    # -- raw log ------------------------------------------------------------------------

    def fetch(
        self,
        leader: Any,
        topic: str,
        partition: int,
        offset: int,
        max_bytes: int = 4 << 20,
        max_wait_ms: int = 1,
    ) -> RawPartition | None:
        """One read_uncommitted Fetch of ``topic``/``partition`` from ``offset``;
        ``None`` when the answer holds no such partition (an empty answer).

        ``max_wait_ms``: how long the broker may wait for records (see
        :meth:`batches`)."""
        topic_req = FetchRequest.FetchTopic
        request = FetchRequest(
            max_wait_ms=max_wait_ms,
            min_bytes=1,  # tansu answers min_bytes=0 with no partitions at all
            max_bytes=max_bytes,
            isolation_level=0,
            topics=[
                topic_req(
                    topic=topic,
                    partitions=[
                        topic_req.FetchPartition(
                            partition=partition,
                            fetch_offset=offset,
                            partition_max_bytes=max_bytes,
                        )
                    ],
                )
            ],
            max_version=_FETCH_MAX_VERSION,
        )
        response = self.send(request, leader)
        for t in response.responses:
            for p in t.partitions:
                if p.partition_index != partition:
                    continue
                error = Errors.for_code(p.error_code)
                if error is Errors.OffsetOutOfRangeError:
                    # deleted by retention or DeleteRecords: say where the log starts now
                    # (Apache Kafka answers -1 for it with the error: ask ListOffsets)
                    start = p.log_start_offset
                    if start < 0:
                        start = self.log_start_offset(topic, partition)
                    if 0 <= offset < start:
                        return RawPartition(b"", p.high_watermark, start)
                if error is not Errors.NoError:
                    raise error(f"fetch of {topic}/{partition} at offset {offset}")
                raw = p.records
                data = bytes(raw) if raw else b""
                return RawPartition(data, p.high_watermark, p.log_start_offset)
        return None  # tansu, loaded, has answered even a 1 ms wait with no partition

    def log_start_offset(self, topic: str, partition: int) -> int:
        """The partition's earliest offset (ListOffsets), -1 when not answered."""
        from kafka import TopicPartition
        from kafka.protocol.consumer import OffsetSpec

        tp = TopicPartition(topic, partition)
        found = self.admin.list_partition_offsets({tp: OffsetSpec.EARLIEST}).get(tp)
        return int(getattr(found, "offset", -1)) if found is not None else -1

    def batches(
        self, leader: Any, topic: str, partition: int, start: int = 0, stop: int | None = None
    ) -> Iterator[Any]:
        """Every record batch (data and control) of a partition from ``start`` up to
        ``stop`` (default: the high watermark at the first fetch), in offset order.

        Yields kafka-python ``DefaultRecordBatch`` objects, which expose
        ``base_offset``, ``next_offset``, ``producer_id``, ``producer_epoch``,
        ``is_transactional`` and ``is_control_batch``."""
        offset = start
        empty = 0
        while stop is None or offset < stop:
            part = self.fetch(leader, topic, partition, offset, max_wait_ms=_WAITS[empty])
            if part is None:  # an answer without the partition: ask again, waiting longer
                empty += 1
                if empty >= len(_WAITS):
                    raise Errors.KafkaTimeoutError(
                        f"{topic}/{partition}: {empty} fetches at offset {offset} answered "
                        "without the partition"
                    )
                continue
            if stop is None:
                stop = part.high_watermark
            if offset < part.log_start_offset:
                offset = part.log_start_offset  # the records before it are gone
                continue
            progressed = False
            for batch in MemoryRecords(part.records):
                if batch.next_offset <= offset:
                    continue  # a batch that begins before the requested offset
                yield batch
                offset = batch.next_offset
                progressed = True
                if offset >= stop:
                    return
            empty = 0 if progressed else empty + 1
            if empty >= len(_WAITS) and offset < stop:
                raise Errors.KafkaTimeoutError(
                    f"{topic}/{partition}: no records at offset {offset} below the high "
                    f"watermark {stop} after {empty} fetches"
                )
