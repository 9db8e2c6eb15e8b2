"""Kafka exactly-once sink: one transaction per task attempt, committed by the driver.

Executor side (:mod:`sinks.kafka.writer`): each Spark task writes its partition
in its own Kafka transaction whose ``transactional.id`` is the task's
transaction name (``[prefix]tp1.<job>.<pipeline>.<sink>.r<run>.b<batch>.p<part>.a<attempt>``),
flushes it and returns the committable ``{txn, transactional_id, producer_id,
epoch, rows, topic, partitions: {partition: [first offset, last offset]}}``
without committing or aborting.

Commit and abort (driver, :mod:`sinks.kafka.txn`): the transaction is resumed
by EndTxn (never ``init_transactions()``, which aborts), idempotently; any
refusal is settled from the control markers in the log. Abort fences
(InitProducerId). Retried (tenacity) on retriable errors and dropped
connections, bounded by ``commit_timeout``.

Lingering transactions (``abort_lingering``): the driver cannot list them from
Kafka portably (ListTransactions needs Kafka 3.0+ and DESCRIBE rights; tansu
lacks it) nor derive them (Spark task attempt ids are not enumerable). Every
writer therefore announces its transactional id in a registry topic before it
writes data (:mod:`sinks.kafka.registry`); the sweep reads the registry
incrementally, asks ``is_orphan`` about each announced id of the scope, fences
the orphans and tombstones them. Limits: ``registry_topic=None`` disables the
sweep (Apache Kafka then aborts orphans only after ``transaction.timeout.ms``;
until then they hold back read_committed consumers); every transactional id
leaves coordinator state for ``transactional.id.expiration.ms`` (7 days by
default), one per task and batch. A future option on Apache Kafka >= 3.0:
ListTransactions (state Ongoing) as a second source of candidates.

Transaction timeout: a prepared transaction must be committed before
``transaction_timeout_ms`` has passed since its first write, or Apache Kafka
aborts it and its data is lost (the best-known failure of Flink's Kafka sink).
:meth:`KafkaSink.min_safe_timeout_ms` and :meth:`KafkaSink.check_checkpoint_interval`
compare it with the checkpoint interval plus batch, commit and restart time.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import kafka.errors as Errors
import pyarrow as pa
from kafka import KafkaProducer

from sinks import _faults
from sinks._retry import retry_transient
from sinks.base import Committable, JobScope, OrphanTest, Sink, SinkWriter, WriteContext
from sinks.errors import ConfigError, PreflightError
from sinks.kafka import checks, encode, txn
from sinks.kafka.registry import DEFAULT_TOPIC, TOPIC_CONFIG, RegistryView, write_tombstones
from sinks.kafka.wire import KafkaWire
from sinks.kafka.writer import KafkaWriter
from sinks.naming import TxnName, check_id

log = logging.getLogger("sinks.kafka")

# RetriableError covers dropped connections, timeouts, NOT_COORDINATOR,
# CONCURRENT_TRANSACTIONS...; UnknownBrokerIdError: a broker not yet in our
# metadata (the connection is rebuilt, with fresh metadata, on the next attempt).
_TRANSIENT: tuple[type[BaseException], ...] = (Errors.RetriableError, Errors.UnknownBrokerIdError)
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_RESERVED = {
    "bootstrap_servers": "pass it as the first argument",
    "transactional_id": "it is derived from the task (see transactional_id_prefix)",
    "transaction_timeout_ms": "pass transaction_timeout_ms=",
    "enable_idempotence": "transactions need it",
    "acks": "transactions need acks='all'",
    "key_serializer": "keys are sent as bytes",
    "value_serializer": "values are sent as bytes",
}
_PRODUCER_DEFAULTS: dict[str, Any] = {"linger_ms": 5, "batch_size": 256 * 1024}


class KafkaSink(Sink):
    """Writes a pipeline's output into a Kafka topic exactly once (transactions).

    Consumers must read with ``isolation_level='read_committed'``.

    Args:
        bootstrap_servers: ``"host:port"`` or a list of them.
        topic: the target topic (one sink = one topic).
        key: column whose values become record keys (binary, string, or a number
            or boolean written as its text); default: no key.
        value: binary or string column that becomes the record value; default:
            each row as a JSON object of all its columns (see
            :mod:`sinks.kafka.encode`).
        headers: columns sent as record headers (named after the column; values
            as for ``key``; a null leaves the header out).
        transactional_id_prefix: put in front of every transactional id, e.g. to
            match ACLs on ``TransactionalId`` prefixes.
        transaction_timeout_ms: the producer's ``transaction.timeout.ms``. Must not
            exceed the broker's ``transaction.max.timeout.ms`` and must cover the
            time from a batch's first write to its commit, see
            :meth:`min_safe_timeout_ms`.
        create_topic: create a missing topic with ``partitions`` and
            ``replication_factor`` on preflight.
        sink_id: stable id of this sink in its pipeline (part of every
            transactional id); default derived from the servers and topic.
        producer_config: extra kafka-python ``KafkaProducer`` settings (security,
            batching, compression); keys that would break transactions are refused.
        commit_timeout: seconds a commit, abort or sweep keeps retrying
            transient errors before the job fails (the decision stays in the ledger).
        registry_topic: compacted topic where writers announce their
            transactional ids so the driver can sweep lingering ones; created on
            preflight. ``None`` disables the sweep (see the module docstring).
        flush_timeout: seconds ``prepare`` waits for all records to be acknowledged.
        connect_timeout: seconds preflight waits for the cluster to answer.
    """

    kind = "kafka"

    def __init__(
        self,
        bootstrap_servers: str | list[str],
        topic: str,
        *,
        key: str | None = None,
        value: str | None = None,
        headers: Sequence[str] | None = None,
        transactional_id_prefix: str | None = None,
        transaction_timeout_ms: int = 900_000,
        create_topic: bool = False,
        partitions: int = 1,
        replication_factor: int = 1,
        sink_id: str | None = None,
        producer_config: dict[str, Any] | None = None,
        commit_timeout: float = 300.0,
        registry_topic: str | None = DEFAULT_TOPIC,
        flush_timeout: float = 120.0,
        connect_timeout: float = 15.0,
    ) -> None:
        if not bootstrap_servers:
            raise ConfigError("KafkaSink needs bootstrap_servers, e.g. 'broker:9092'")
        for what, name in (("topic", topic), ("registry_topic", registry_topic or "x")):
            if not isinstance(name, str) or not _TOPIC.match(name) or name in (".", ".."):
                raise ConfigError(
                    f"{what} {name!r} is not a valid Kafka topic name "
                    "(1-249 characters from A-Z a-z 0-9 . _ -)"
                )
        if not isinstance(transaction_timeout_ms, int) or transaction_timeout_ms <= 0:
            raise ConfigError("transaction_timeout_ms must be a positive integer (milliseconds)")
        if partitions < 1 or replication_factor < 1:
            raise ConfigError("partitions and replication_factor must be at least 1")
        bad = sorted(set(producer_config or {}) & set(_RESERVED))
        if bad:
            raise ConfigError(
                f"producer_config may not set {bad}: "
                + "; ".join(f"{k}: {_RESERVED[k]}" for k in bad)
            )
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.key = key
        self.value = value
        self.headers = list(headers or [])
        self.id_prefix = transactional_id_prefix or ""
        self.transaction_timeout_ms = transaction_timeout_ms
        self.create_topic = create_topic
        self.partitions = partitions
        self.replication_factor = replication_factor
        self.producer_config = dict(producer_config or {})
        self.commit_timeout = commit_timeout
        self.registry_topic = registry_topic
        self.flush_timeout = flush_timeout
        self.connect_timeout = connect_timeout
        self._sink_id = check_id("sink_id", sink_id or self._default_id())
        self._init_driver_state()

    # -- identity -----------------------------------------------------------------------

    def _default_id(self) -> str:
        servers = ",".join(sorted(self._servers()))
        digest = hashlib.sha1(f"{servers}\0{self.topic}".encode()).hexdigest()[:6]
        readable = re.sub(r"[^A-Za-z0-9_-]", "_", self.topic)[:24]
        return f"kafka-{readable}-{digest}"

    def _servers(self) -> list[str]:
        s = self.bootstrap_servers
        return [x.strip() for x in s.split(",")] if isinstance(s, str) else list(s)

    @property
    def sink_id(self) -> str:
        return self._sink_id

    def describe(self) -> str:
        return f"Kafka topic {self.topic} at {','.join(self._servers())}"

    def __repr__(self) -> str:
        return f"KafkaSink({self.describe()}, key={self.key}, value={self.value})"

    def transactional_id(self, name: TxnName) -> str:
        """The Kafka ``transactional.id`` of a transaction name."""
        return f"{self.id_prefix}{name}"

    def producer_settings(self, transactional_id: str) -> dict[str, Any]:
        """kafka-python ``KafkaProducer`` settings of a writer."""
        return {
            **_PRODUCER_DEFAULTS,
            **self.producer_config,
            "bootstrap_servers": self.bootstrap_servers,
            "transactional_id": transactional_id,
            "transaction_timeout_ms": self.transaction_timeout_ms,
            "enable_idempotence": True,
            "acks": "all",
        }

    @property
    def max_request_size(self) -> int:
        """The producer's ``max_request_size`` (bytes): kafka-python refuses a
        record larger than this before sending it."""
        settings = {**KafkaProducer.DEFAULT_CONFIG, **_PRODUCER_DEFAULTS, **self.producer_config}
        return int(settings["max_request_size"])

    # -- driver-side state (never pickled to executors) ----------------------------------

    def _init_driver_state(self) -> None:
        self._lock = threading.RLock()
        self._wire: KafkaWire | None = None
        self._tombstoner: KafkaProducer | None = None
        self._registry = RegistryView(self.registry_topic) if self.registry_topic else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_lock", "_wire", "_tombstoner", "_registry"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_driver_state()

    @contextlib.contextmanager
    def _client(self) -> Iterator[KafkaWire]:
        """The driver's cached connection; dropped (and rebuilt next time) on error."""
        with self._lock:
            if self._wire is None:
                # one attempt never outlasts the whole retry budget by much
                timeout = min(30.0, max(2.0, self.commit_timeout / 4))
                self._wire = KafkaWire(
                    self.bootstrap_servers, config=self.producer_config, timeout_s=timeout
                )
            try:
                yield self._wire
            except BaseException:
                wire, self._wire = self._wire, None
                with contextlib.suppress(Exception):
                    wire.close()
                raise

    def close(self) -> None:
        """Release the driver's connections (optional; they are daemon threads)."""
        with self._lock:
            wire, self._wire = self._wire, None
            producer, self._tombstoner = self._tombstoner, None
        if wire is not None:
            wire.close()
        if producer is not None:
            producer.close(timeout=5)

    # -- preflight ----------------------------------------------------------------------

    def preflight(self, schema: pa.Schema) -> None:
        self._check_schema(schema)
        try:
            wire = KafkaWire(
                self.bootstrap_servers, config=self.producer_config, timeout_s=self.connect_timeout
            )
        except Exception as e:
            raise PreflightError(
                f"cannot reach Kafka at {','.join(self._servers())}: {e}".strip()
            ) from e
        with wire:
            checks.ensure_topic(wire, self, self.topic, self.partitions, {}, self.create_topic)
            if self.registry_topic:
                checks.ensure_topic(wire, self, self.registry_topic, 1, TOPIC_CONFIG, True)
            checks.check_transaction_timeout(wire, self)

    def _check_schema(self, schema: pa.Schema) -> None:
        if self.key:
            encode.check_bytes_column(schema, self.key, "key", numbers=True)
        if self.value:
            encode.check_bytes_column(schema, self.value, "value", numbers=False)
        for h in self.headers:
            encode.check_bytes_column(schema, h, "header", numbers=True)

    @staticmethod
    def min_safe_timeout_ms(
        checkpoint_interval_s: float,
        *,
        batch_duration_s: float = 60.0,
        commit_timeout_s: float = 300.0,
        restart_s: float = 300.0,
    ) -> int:
        """The smallest ``transaction_timeout_ms`` that cannot abort a prepared
        transaction before its commit (see :func:`sinks.kafka.checks.min_safe_timeout_ms`)."""
        return checks.min_safe_timeout_ms(
            checkpoint_interval_s,
            batch_duration_s=batch_duration_s,
            commit_timeout_s=commit_timeout_s,
            restart_s=restart_s,
        )

    def check_checkpoint_interval(
        self,
        checkpoint_interval_s: float,
        *,
        batch_duration_s: float = 60.0,
        restart_s: float = 300.0,
    ) -> None:
        """Raise :class:`PreflightError` when ``transaction_timeout_ms`` is smaller
        than :meth:`min_safe_timeout_ms` for this checkpoint interval."""
        checks.check_checkpoint_interval(
            self, checkpoint_interval_s, batch_duration_s=batch_duration_s, restart_s=restart_s
        )

    # -- executor side -------------------------------------------------------------------

    def open_writer(self, ctx: WriteContext, schema: pa.Schema) -> SinkWriter:
        return KafkaWriter(self, ctx, schema)

    # -- driver side: commit --------------------------------------------------------------

    def commit(self, committables: Sequence[Committable]) -> None:
        pending = {c["transactional_id"]: c for c in committables}
        if not pending:
            return
        total = len(pending)

        def attempt() -> None:
            with self._client() as wire:
                coordinators = wire.find_coordinators(sorted(pending))
                for tid in sorted(pending):
                    txn.commit(
                        wire,
                        coordinators[tid],
                        pending[tid],
                        where=self.describe(),
                        timeout_ms=self.transaction_timeout_ms,
                    )
                    del pending[tid]
                    if len(pending) == total - 1 and total > 1:
                        _faults.hit("driver.mid_commit")

        retry_transient(
            attempt,
            what=f"commit of {total} transaction(s) to {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )

    # -- driver side: abort, sweep, forget ------------------------------------------------

    def _fence(self, wire: KafkaWire, transactional_ids: list[str]) -> None:
        txn.fence(wire, transactional_ids, self.transaction_timeout_ms)

    def abort(self, committables: Sequence[Committable]) -> None:
        ids = sorted({c["transactional_id"] for c in committables})
        if not ids:
            return
        remaining = list(ids)

        def attempt() -> None:
            with self._client() as wire:
                self._fence(wire, remaining)

        retry_transient(
            attempt,
            what=f"abort of {len(ids)} transaction(s) in {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )
        self._tombstone(ids)

    def abort_lingering(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        view = self._registry
        if view is None:
            return []
        prefix = self.id_prefix + scope.txn_prefix()

        def sweep() -> dict[str, TxnName]:
            with self._client() as wire:
                live = view.refresh(wire)
                orphans: dict[str, TxnName] = {}
                for tid in sorted(live):
                    if not tid.startswith(prefix):
                        continue
                    name = TxnName.parse(tid[len(self.id_prefix) :])
                    if name is not None and is_orphan(name):
                        orphans[tid] = name
                if orphans:
                    self._fence(wire, sorted(orphans))  # fenced twice after a retry: harmless
                return orphans

        orphans = retry_transient(
            sweep,
            what=f"sweep of lingering transactions in {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )
        if orphans:
            self._tombstone(sorted(orphans))
            log.info("aborted %d lingering Kafka transaction(s): %s", len(orphans), sorted(orphans))
        return sorted(str(n) for n in orphans.values())

    def forget(self, committables: Sequence[Committable]) -> None:
        self._tombstone(sorted({c["transactional_id"] for c in committables}))

    def _tombstone(self, ids: list[str]) -> None:
        """Mark ids resolved in the registry. Best effort: a missed tombstone only
        makes a later sweep fence an already finished id again (harmless)."""
        if not ids or not self.registry_topic:
            return
        try:
            with self._lock:
                if self._tombstoner is None:
                    self._tombstoner = KafkaProducer(
                        **{
                            **self.producer_config,
                            "bootstrap_servers": self.bootstrap_servers,
                            "acks": "all",
                        }
                    )
                write_tombstones(self._tombstoner, self.registry_topic, ids, timeout_s=30.0)
        except Exception as e:
            log.warning(
                "could not tombstone %d id(s) in registry %s (%r); harmless, a later sweep retries",
                len(ids),
                self.registry_topic,
                e,
            )
            with self._lock:
                producer, self._tombstoner = self._tombstoner, None
            if producer is not None:
                with contextlib.suppress(Exception):
                    producer.close(timeout=0)
            return
        if self._registry is not None:
            self._registry.forget(ids)
