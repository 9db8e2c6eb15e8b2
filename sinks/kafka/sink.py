"""Kafka exactly-once sink: one transaction per task attempt, committed by the driver.

Longer than 450 lines because KafkaSink is the public API: its documented
constructor with every option, and its settings round trip, stay on this one
class.

This module is the sink's face: its options and settings, its transactional
ids, preflight (:mod:`sinks.kafka.preflight`) and its writers. The commit
path, abort, the sweep of lingering transactions and the records of what
committed are the committer's (:mod:`sinks.kafka.committer`, with its claims
in :mod:`sinks.kafka.claims` and its lanes of pooled ids in
:mod:`sinks.kafka.lanes`).

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

* the **claim**: which incarnation may commit. The committer's ``claim`` (at start, before any
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
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from sinks import settings
from sinks._parallel import COMMIT_CONNECTIONS, check_connections
from sinks.base import Committable, Sink, SinkWriter, WriteContext
from sinks.capabilities import ExpiringWork, HoldsPreparedWork
from sinks.errors import ConfigError
from sinks.kafka import checks, txn_age
from sinks.kafka.committer import KafkaCommitter
from sinks.kafka.connections import DriverConnections
from sinks.kafka.pool import IdPool, pooled_id
from sinks.kafka.preflight import check_cluster, check_schema
from sinks.kafka.produce import ProducerOptions
from sinks.kafka.progress import ProgressStore
from sinks.kafka.registry import DEFAULT_TOPIC
from sinks.kafka.writer import KafkaWriter, WriterSettings
from sinks.keys import KeyedWrite
from sinks.naming import check_id

log = logging.getLogger("sinks.kafka")


class KafkaSink(Sink, ExpiringWork, HoldsPreparedWork):
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
    speculation_safe = True  # every attempt has its own pooled id (sinks/kafka/pool.py)

    def prepared_work_timeout(self) -> float:
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
            pooled_ids=lambda: self.pooled_ids,
        )

    def committer(self) -> KafkaCommitter:
        """The driver's :class:`~sinks.kafka.committer.KafkaCommitter`."""
        return self._committer

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

    def holds_prepared_work(self) -> bool:
        """An open transaction holds back read_committed consumers until it ends."""
        return True

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
