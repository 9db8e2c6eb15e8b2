"""Kafka exactly-once sink: one transaction per task attempt, committed by the driver.

Longer than 450 lines because KafkaSink is the public API: its documented
constructor, its settings round trip and every method the coordinator calls
(most of them one-line delegations) stay on this one class.

This module is the sink's face: its options and settings, its transactional
ids, preflight (:mod:`sinks.kafka.preflight`), its writers, its claims and its
lanes of pooled ids. The commit path, abort, the sweep of lingering
transactions and the records of what committed are the committer's
(:mod:`sinks.kafka.committer`).

Executor side (:mod:`sinks.kafka.writer`): each Spark task writes its partition
in its own Kafka transaction, flushes it and returns the committable ``{txn,
transactional_id, producer_id, epoch, rows, topic, partitions: {partition:
[first offset, last offset]}}`` without committing or aborting. The ``transactional.id`` (after
``transactional_id_prefix``) comes from a bounded pool on brokers that answer
DescribeTransactions (:mod:`sinks.kafka.pool`: ``tp3.<job>.<pipeline>.<sink>
.i<incarnation>.l<lane>.p<part>.a<attempt>``); elsewhere it is the task's
transaction name (:mod:`sinks.naming`: ``tp2.<job>.<pipeline>.<sink>.i<incarnation>
.r<run>.b<batch>.p<part>.a<attempt>``).

What the sink remembers (:mod:`sinks.kafka.progress`), all in the registry
topic, per (target topic, job, pipeline, sink id):

* the **claim**: which incarnation may commit. ``claim()`` (at start, before any
  data moves) appends a claim record on registry partition 0 unless this
  incarnation holds it already; the owner is decided by replaying the claim
  records in log order (a claim wins iff the owner so far is nobody, itself or
  its ``start_over_from``), so of two jobs claiming at the same instant the
  first in the log wins and the other refuses with
  :class:`~sinks.progress.IncarnationConflictError`;
* **what is committed**: the writers' committed announcements and the progress
  records ``forget`` appends (:mod:`sinks.kafka.committer`, which also says
  what holds across a crash).

Transaction timeout: a prepared transaction must be committed before
``transaction_timeout_ms`` has passed since its first write, or Apache Kafka
aborts it and its data is lost (the best-known failure of Flink's Kafka sink).
:meth:`KafkaSink.min_safe_timeout_ms` and :meth:`KafkaSink.check_checkpoint_interval`
compare it with the checkpoint interval plus batch, commit and restart time.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from sinks import settings
from sinks._parallel import COMMIT_CONNECTIONS, check_connections
from sinks._retry import retry_transient
from sinks.audit import CheckpointEvidence, Finding
from sinks.base import (
    Committable,
    JobScope,
    LingeringTxn,
    OrphanTest,
    Sink,
    SinkWriter,
    WriteContext,
)
from sinks.errors import ConfigError
from sinks.kafka import audit as kafka_audit
from sinks.kafka import checks, txn, txn_age
from sinks.kafka.committer import REGISTRY_TIMEOUT_S, KafkaCommitter
from sinks.kafka.connections import DriverConnections
from sinks.kafka.pool import IdPool, lane_of, pool_prefix, pooled_id
from sinks.kafka.preflight import check_cluster, check_schema
from sinks.kafka.produce import ProducerOptions
from sinks.kafka.progress import ProgressStore
from sinks.kafka.registry import DEFAULT_TOPIC
from sinks.kafka.wire import TRANSIENT
from sinks.kafka.writer import KafkaWriter, WriterSettings
from sinks.keys import KeyedWrite
from sinks.naming import check_id
from sinks.progress import SinkProgress

log = logging.getLogger("sinks.kafka")


class KafkaSink(Sink):
    """Writes a pipeline's output into a Kafka topic exactly once (transactions).

    Consumers must read with ``isolation_level='read_committed'``.

    Args:
        bootstrap_servers: ``"host:port"`` or a list of them.
        topic: the target topic (one sink = one topic).
        key: column whose values become record keys (binary, string, or a number
            or boolean written as its text); default: no key. Alone, it only
            places records (rows are events, all written); with ``order_by`` or
            ``delete_when`` the topic is a changelog of keyed writes.
        order_by: with ``key``, a keyed write (:mod:`sinks.keys`): the input is
            repartitioned by the key and each batch writes one record per key,
            its row with the greatest value of this column (a null there, or a
            tie between different rows, is an error), so that the topic after
            compaction holds what an upsert would.
        delete_when: with ``key``, which rows are deletes: a boolean column's
            name, or a column and the value that marks a delete (``("op",
            "D")``). A delete is a tombstone: the key and a null value, whether
            values come from ``value`` or are the JSON of the row (which leaves
            this column out). A key with different rows in one batch needs
            ``order_by`` to say which wins; a null key is an error.
        value: binary or string column that becomes the record value; default:
            each row as a JSON object of all its columns, in one encoding
            whatever the session time zone (timestamps in UTC with ``Z``, maps as
            objects, decimals as exact strings, ``"NaN"``/``"Infinity"``; see
            :mod:`sinks.kafka.encode`); types it cannot write fail preflight, values
            it cannot write fail the task before anything of it is sent.
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
        commit_connections: connections the driver sends a checkpoint's EndTxn
            requests (and an abort's InitProducerId requests) over at once, at
            most (one per 4 transactions): a broker handles one request of a
            connection at a time. On tansu, the test broker, more than one is
            faster while tasks write and slower when it is idle (:doc:`/performance`).
        commit_timeout: seconds a commit, abort or sweep keeps retrying
            transient errors before the job fails (the decision stays in the ledger).
        registry_topic: compacted topic where writers announce their
            transactional ids so the driver can sweep lingering ones; created on
            preflight. ``None`` disables the sweep (see :mod:`sinks.kafka.committer`).
        flush_timeout: seconds ``prepare`` waits for all records to be acknowledged.
        connect_timeout: seconds preflight waits for the cluster to answer.
    """

    kind = "kafka"
    _driver_only = ("_conns", "_store", "_pool", "_committer")
    prepared_work_expires = True
    prepared_work_holds_resources = True
    speculation_safe = True  # every attempt has its own pooled id (sinks/kafka/pool.py)

    def prepared_work_timeout(self) -> float | None:
        return self.transaction_timeout_ms / 1000

    def __init__(
        self,
        bootstrap_servers: str | list[str],
        topic: str,
        *,
        key: str | None = None,
        value: str | None = None,
        headers: Sequence[str] | None = None,
        order_by: str | None = None,
        delete_when: str | tuple[str, Any] | None = None,
        transactional_id_prefix: str | None = None,
        transaction_timeout_ms: int = 900_000,
        create_topic: bool = False,
        partitions: int = 1,
        replication_factor: int = 1,
        sink_id: str | None = None,
        producer_config: dict[str, Any] | None = None,
        commit_timeout: float = 300.0,
        commit_connections: int = COMMIT_CONNECTIONS,
        registry_topic: str | None = DEFAULT_TOPIC,
        flush_timeout: float = 120.0,
        connect_timeout: float = 15.0,
    ) -> None:
        checks.check_settings(
            bootstrap_servers,
            topic,
            registry_topic,
            transaction_timeout_ms,
            partitions,
            replication_factor,
            producer_config,
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
        self.commit_connections = check_connections(commit_connections)
        self._checkpoint_interval_s = 0.0
        self.registry_topic = registry_topic
        self.topic_max_bytes: int | None = None  # the topic's max.message.bytes (preflight)
        self.topic_cleanup_policy: str | None = None  # the topic's cleanup.policy (preflight)
        self.pooled_ids = False  # the broker describes transactions (preflight): pool the ids
        self.flush_timeout = flush_timeout
        self.connect_timeout = connect_timeout
        self._sink_id = check_id("sink_id", sink_id or self._default_id())
        self.rules = KeyedWrite.of(self.describe(), [key] if key else [], order_by, delete_when)
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

    def settings(self) -> dict[str, Any]:
        """Non-secret settings (:mod:`sinks.settings`): ``producer_config``
        without the keys that name a password, secret or token (listed under
        ``"redacted"``) and without values that are not JSON (``"omitted"``)."""
        config, redacted, omitted = settings.split_secrets(
            self.producer_config, settings.KAFKA_SECRET_WORDS
        )
        return {
            "kind": self.kind,
            "v": settings.FORMAT,
            "sink_id": self.sink_id,
            "bootstrap_servers": self.bootstrap_servers,
            "topic": self.topic,
            "key": self.key,
            "value": self.value,
            "headers": list(self.headers),
            "order_by": self.rules.order_by,
            "delete_when": self.rules.delete_when.settings() if self.rules.delete_when else None,
            "transactional_id_prefix": self.id_prefix or None,
            "transaction_timeout_ms": self.transaction_timeout_ms,
            "create_topic": self.create_topic,
            "partitions": self.partitions,
            "replication_factor": self.replication_factor,
            "producer_config": config,
            "redacted": redacted,
            "omitted": omitted,
            "commit_timeout": self.commit_timeout,
            "commit_connections": self.commit_connections,
            "registry_topic": self.registry_topic,
            "flush_timeout": self.flush_timeout,
            "connect_timeout": self.connect_timeout,
        }

    @classmethod
    def from_settings(cls, s: Mapping[str, Any], secrets: Mapping[str, str]) -> KafkaSink:
        """The sink of :meth:`settings`; each redacted ``producer_config`` key
        from ``TWOPHASE_<SINK>_<KEY>`` or ``TWOPHASE_KAFKA_<KEY>`` in ``secrets``."""
        config = dict(s["producer_config"])
        for key in s.get("redacted", []):
            names = (settings.env_name(s["sink_id"], key), settings.env_name("kafka", key))
            value = settings.lookup(secrets, names)
            if value is None:
                raise ConfigError(
                    f"Kafka sink {s['sink_id']!r} (topic {s['topic']}) needs producer_config "
                    f"{key!r}, which the ledger does not keep: set {names[0]} or {names[1]}"
                )
            config[key] = value
        if s.get("omitted"):
            log.warning(
                "Kafka sink %s: producer_config %s were not recorded (not JSON values) and "
                "are missing from the rebuilt sink",
                s["sink_id"],
                s["omitted"],
            )
        return cls(
            s["bootstrap_servers"],
            s["topic"],
            key=s["key"],
            value=s["value"],
            headers=s["headers"],
            order_by=s.get("order_by"),
            delete_when=s.get("delete_when"),
            transactional_id_prefix=s["transactional_id_prefix"],
            transaction_timeout_ms=s["transaction_timeout_ms"],
            create_topic=s["create_topic"],
            partitions=s["partitions"],
            replication_factor=s["replication_factor"],
            sink_id=s["sink_id"],
            producer_config=config,
            commit_timeout=s["commit_timeout"],
            commit_connections=s.get("commit_connections", COMMIT_CONNECTIONS),
            registry_topic=s["registry_topic"],
            flush_timeout=s["flush_timeout"],
            connect_timeout=s["connect_timeout"],
        )

    def __repr__(self) -> str:
        return f"KafkaSink({self.describe()}, key={self.key}, value={self.value})"

    def transactional_id(self, ctx: WriteContext) -> str:
        """The Kafka ``transactional.id`` a writer of ``ctx`` uses: a pooled id of
        its batch's lane (:mod:`sinks.kafka.pool`), or, for a writer opened
        without a lease, its transaction's name."""
        if ctx.lease is None or ctx.scope.incarnation is None:
            return f"{self.id_prefix}{ctx.txn_name()}"
        return pooled_id(self.id_prefix, ctx.scope, ctx.lease, ctx.partition, ctx.attempt_number)

    @property
    def max_request_size(self) -> int:
        """The producer's ``max_request_size`` (bytes): a writer refuses a record
        larger than this before sending anything."""
        return ProducerOptions.of(self.producer_config).max_request_size

    # -- driver-side state (never pickled to executors) ----------------------------------

    def _init_driver_state(self) -> None:
        self._pool = IdPool()
        self._conns = DriverConnections(
            self.bootstrap_servers, self.producer_config, self.commit_timeout
        )
        self._store = (
            ProgressStore(self.registry_topic, self.topic, self.id_prefix, self.describe())
            if self.registry_topic
            else None
        )
        self._committer = KafkaCommitter(
            where=self.describe(),
            sink_id=self.sink_id,
            topic=self.topic,
            id_prefix=self.id_prefix,
            transaction_timeout_ms=self.transaction_timeout_ms,
            commit_timeout=self.commit_timeout,
            commit_connections=self.commit_connections,
            conns=self._conns,
            store=self._store,
            pool=self._pool,
        )

    def close(self) -> None:
        """Release the driver's connections (optional; they are daemon threads)."""
        self._conns.close()

    # -- preflight ----------------------------------------------------------------------

    def preflight(self, schema: pa.Schema) -> None:
        """Check the DataFrame's columns, then the cluster (:mod:`sinks.kafka.preflight`),
        and keep what the writers need to know of the cluster."""
        self._check_schema(schema)
        facts = check_cluster(
            self.describe(),
            self.bootstrap_servers,
            servers=self._servers(),
            producer_config=self.producer_config,
            connect_timeout=self.connect_timeout,
            topic=self.topic,
            registry_topic=self.registry_topic,
            id_prefix=self.id_prefix,
            sink_id=self.sink_id,
            create_topic=self.create_topic,
            partitions=self.partitions,
            replication_factor=self.replication_factor,
            transaction_timeout_ms=self.transaction_timeout_ms,
        )
        # the writers size their record batches to it, and refuse a tombstone of an
        # event on a compacted topic (they run on executors: pickled)
        self.topic_max_bytes = facts.topic_max_bytes
        self.topic_cleanup_policy = facts.topic_cleanup_policy
        self.pooled_ids = facts.pooled_ids

    @property
    def changelog(self) -> bool:
        """Whether this sink writes by key (``order_by`` or ``delete_when``)."""
        return self.rules.order_by is not None or self.rules.delete_when is not None

    def partition_columns(self) -> list[str] | None:
        return list(self.rules.key) if self.changelog else None

    def sort_columns(self) -> list[str] | None:
        return self.rules.sort_columns() if self.changelog else None

    def _check_schema(self, schema: pa.Schema) -> None:
        check_schema(
            schema,
            self.rules,
            changelog=self.changelog,
            key=self.key,
            value=self.value,
            headers=self.headers,
        )

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
            self.describe(),
            self.transaction_timeout_ms,
            checkpoint_interval_s,
            commit_timeout_s=self.commit_timeout,
            batch_duration_s=batch_duration_s,
            restart_s=restart_s,
        )
        self._checkpoint_interval_s = checkpoint_interval_s

    def checkpoint_pressure(self, batch: Sequence[Committable]) -> str | None:
        """Checkpoint now when the batch's transactions, measured, may reach half
        of ``transaction_timeout_ms`` by their commit (:mod:`sinks.kafka.txn_age`)."""
        return txn_age.pressure(
            self.describe(),
            batch,
            timeout_ms=self.transaction_timeout_ms,
            checkpoint_interval_s=self._checkpoint_interval_s,
            commit_timeout_s=self.commit_timeout,
        )

    # -- executor side -------------------------------------------------------------------

    def open_writer(self, ctx: WriteContext, schema: pa.Schema) -> SinkWriter:
        return KafkaWriter(self._writer_settings(), ctx, self.transactional_id(ctx))

    def _writer_settings(self) -> WriterSettings:
        return WriterSettings(
            where=self.describe(),
            bootstrap_servers=self.bootstrap_servers,
            producer_config=dict(self.producer_config),
            topic=self.topic,
            key=self.key,
            value=self.value,
            headers=tuple(self.headers),
            rules=self.rules if self.changelog else None,
            registry_topic=self.registry_topic,
            transaction_timeout_ms=self.transaction_timeout_ms,
            topic_max_bytes=self.topic_max_bytes,
            topic_cleanup_policy=self.topic_cleanup_policy,
        )

    # -- progress and claims (sinks.kafka.progress) --------------------------------------

    def progress(self, scope: JobScope) -> SinkProgress:
        store = self._store
        if store is None:
            return SinkProgress(owner=None)

        def read() -> SinkProgress:
            with self._conns.wire() as wire:
                return store.read(wire, scope)

        return retry_transient(
            read,
            what=f"read of the progress of {scope.key()} in {self.describe()}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )

    def claim(self, scope: JobScope, *, start_over_from: str | None = None) -> SinkProgress:
        ours = scope.incarnation
        assert ours is not None
        self._pool.reset(scope)  # a start: recovery ends every earlier transaction first
        store = self._store
        if store is None:
            log.warning(
                "%s: registry_topic=None, so this sink keeps no progress and holds no claim: "
                "nothing stops another copy of job %s writing the same topic",
                self.describe(),
                scope.job,
            )
            return SinkProgress(owner=ours)
        nonce = uuid.uuid4().hex[:16]  # one per claim: a retry appends the same claim

        def claim() -> SinkProgress:
            with self._conns.wire() as wire, self._conns.producer() as producer:
                return store.claim(
                    wire, producer, scope, start_over_from, nonce, REGISTRY_TIMEOUT_S
                )

        return retry_transient(
            claim,
            what=f"claim of {scope.key()} in {self.describe()}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )

    # -- driver side: commit, abort, sweep, forget (sinks.kafka.committer) ---------------

    def commit(self, committables: Sequence[Committable]) -> None:
        """EndTxn(commit) for every transaction of ``committables``
        (:meth:`~sinks.kafka.committer.KafkaCommitter.commit`)."""
        self._committer.commit(committables)

    def classify(self, committables: Sequence[Committable]) -> dict[str, str]:
        return self._committer.classify(committables)

    def abort(self, committables: Sequence[Committable]) -> None:
        self._committer.abort(committables)

    def lingering(self, job: str, pipeline: str) -> list[LingeringTxn]:
        return self._committer.lingering(job, pipeline)

    def abort_lingering(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        return self._committer.abort_lingering(scope, is_orphan)

    def forget(self, committables: Sequence[Committable]) -> None:
        self._committer.forget(committables)

    def evidence(self, committable: Committable) -> dict[str, Any]:
        return kafka_audit.evidence(committable)

    def audit(self, scope: JobScope, checkpoints: Sequence[CheckpointEvidence]) -> list[Finding]:
        with self._conns.wire() as wire:
            return kafka_audit.audit(wire, checkpoints)

    # -- the pool of transactional ids (sinks/kafka/pool.py) ------------------------------

    def lease(self, scope: JobScope, batch_id: int) -> int | None:
        """The lane of pooled transactional ids ``batch_id``'s writers use; None
        (an id per transaction, as before the pool) on a broker that cannot
        describe a transaction (tansu, Kafka before 3.0: a writer could not
        tell another's open transaction on its id) or for a ledger that never
        claimed."""
        if scope.incarnation is None or not self.pooled_ids:
            return None
        return self._pool.lease(scope, batch_id, self._busy_lanes(scope))

    def settled(self, scope: JobScope, through_batch: int) -> None:
        """Release the lanes of settled batches once their ids have ended: the
        registry (as last read) shows none of them, and the broker none open
        (DescribeTransactions of every id the pool has seen in the lanes about
        to be released: a transaction a zombie opened after the driver ended
        its attempt's was never announced). A lane found open, or that could
        not be asked about, stays leased; the next checkpoint's settle asks
        again."""
        self._pool.settle(scope, through_batch)
        busy = self._busy_lanes(scope)
        seen = self._pool.seen(scope, self._pool.releasable(scope, busy))
        if seen:
            try:
                with self._conns.wire() as wire:
                    still_open = txn.open_ids(wire, seen) or {}
            except Exception as e:
                log.warning(
                    "%s: could not ask the broker whether lanes %s of %s hold open "
                    "transactions (%r); they stay leased until a later settle",
                    self.describe(),
                    sorted(set(seen.values())),
                    scope,
                    e,
                )
                busy |= set(seen.values())
            else:
                if still_open:
                    ongoing = any(s.state == "Ongoing" for s in still_open.values())
                    log.log(
                        logging.WARNING if ongoing else logging.INFO,
                        "%s: lanes %s of %s stay leased: the broker shows open transactions "
                        "on their ids: %s",
                        self.describe(),
                        sorted({seen[t] for t in still_open}),
                        scope,
                        sorted(still_open.items())[:5],
                    )
                busy |= {seen[t] for t in still_open}
        released = self._pool.release(scope, busy)
        if released:
            log.debug("%s: lanes %s of %s back in the pool", self.describe(), released, scope)

    def _busy_lanes(self, scope: JobScope) -> set[int]:
        """Lanes of ``scope`` with an id the registry (as last read) still shows:
        its transaction open, or ended and not yet tombstoned (a tombstone
        written after a new announcement of the id would hide that one). The
        pool remembers those ids (:meth:`settled` asks the broker about them)."""
        if self._store is None:
            return set()
        prefix = pool_prefix(self.id_prefix, scope)
        live = [tid for tid in self._store.view.live() if tid.startswith(prefix)]
        self._pool.remember(scope, live, self.id_prefix)
        return {lane for tid in live for lane in [lane_of(tid, self.id_prefix)] if lane is not None}

    def pool_size(self, scope: JobScope) -> int:
        """How many lanes of pooled ids ``scope`` has used in this run."""
        return self._pool.size(scope)
