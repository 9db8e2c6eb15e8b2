"""Kafka exactly-once sink: one transaction per task attempt, committed by the driver.

Executor side (:mod:`sinks.kafka.writer`): each Spark task writes its partition
in its own Kafka transaction, flushes it and returns the committable ``{txn,
transactional_id, producer_id, epoch, rows, topic, partitions: {partition:
[first offset, last offset]}}`` without committing or aborting. The ``transactional.id`` (after
``transactional_id_prefix``) comes from a bounded pool on brokers that answer
DescribeTransactions (:mod:`sinks.kafka.pool`: ``tp3.<job>.<pipeline>.<sink>
.i<incarnation>.l<lane>.p<part>.a<attempt>``); elsewhere it is the task's
transaction name (:mod:`sinks.naming`: ``tp2.<job>.<pipeline>.<sink>.i<incarnation>
.r<run>.b<batch>.p<part>.a<attempt>``).

Commit and abort (driver, :mod:`sinks.kafka.txn`): the transaction is resumed
by EndTxn (never ``init_transactions()``, which aborts), idempotently, the
transactions of a checkpoint over a few connections at once; any
refusal is settled from the control markers in the log, and so is a success
answered to a retry (a broker that died inside an EndTxn may answer success
without having written every marker). Abort fences (InitProducerId). Retried
(tenacity) on retriable errors and dropped connections, bounded by
``commit_timeout``.

Lingering transactions (``abort_lingering``): the driver cannot list them from
Kafka portably (ListTransactions needs Kafka 3.0+ and DESCRIBE rights; tansu
lacks it) nor derive them (Spark task attempt ids are not enumerable). Every
writer therefore announces its transactional id in a registry topic before it
writes data (:mod:`sinks.kafka.registry`); the sweep reads the registry
incrementally, asks ``is_orphan`` about each id announced for this topic under
``scope.own_prefixes()`` (this incarnation's, and first-format names: never
another incarnation's, unless the coordinator passes that incarnation's scope
after a start-over), fences the orphans and tombstones them once the registry
shows them aborted. Limits: ``registry_topic=None`` disables the sweep (Apache
Kafka then aborts orphans only after ``transaction.timeout.ms``; until then
they hold back read_committed consumers) and the memory of progress below;
every transactional id leaves coordinator state for
``transactional.id.expiration.ms`` (7 days by default): with the pool, lanes
x partitions x attempts of them; without it, one per task and batch.
A future option on Apache Kafka >= 3.0: ListTransactions (state Ongoing) as a
second source of candidates.

What the sink remembers (:mod:`sinks.kafka.progress`), all in the registry
topic, per (target topic, job, pipeline, sink id):

* the **claim**: which incarnation may commit. ``claim()`` (at start, before any
  data moves) appends a claim record on registry partition 0 unless this
  incarnation holds it already; the owner is decided by replaying the claim
  records in log order (a claim wins iff the owner so far is nobody, itself or
  its ``start_over_from``), so of two jobs claiming at the same instant the
  first in the log wins and the other refuses with
  :class:`~sinks.progress.IncarnationConflictError`;
* **what is committed**: a writer's announcement is the first record of its own
  transaction, so its COMMIT marker proves the batch committed, atomically with
  the data. ``forget`` (after the ledger recorded the commit) first appends a
  progress record ``{incarnation, batch}`` (acks=all, waited for), then
  tombstones the announcements. The highest committed batch is the max of the
  owner's progress record and its committed announcements still there.

Guarantees across a crash at any instant: a batch's data and its announcement
commit together; the progress record is durable before its announcements are
tombstoned, so one of them always says the batch committed (a sweep that finds
a committed announcement left by a missed ``forget`` records its progress
before tombstoning it). Before each commit the claim is re-read (incrementally):
another owner refuses the commit (``at_commit``), and committables of a batch
at or below this incarnation's progress record are replays: fenced, never
committed (a retried commit of the same transactions stays idempotent, since the
progress record is written only after the commit completed). Limits: the
registry must keep its records: compaction is safe (claims have unique keys,
progress keys keep their latest record, announcements go only after their
progress record), but ``cleanup.policy=delete`` with a retention would forget
claims and progress, and deleting the registry topic forgets everything
(``registry_topic=None`` likewise keeps nothing). The check before a commit and
the EndTxn are two steps: a takeover between them is caught at the next commit.

Transaction timeout: a prepared transaction must be committed before
``transaction_timeout_ms`` has passed since its first write, or Apache Kafka
aborts it and its data is lost (the best-known failure of Flink's Kafka sink).
:meth:`KafkaSink.min_safe_timeout_ms` and :meth:`KafkaSink.check_checkpoint_interval`
compare it with the checkpoint interval plus batch, commit and restart time.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
from kafka.protocol.admin import DescribeTransactionsRequest

from sinks import _faults, base, settings
from sinks._parallel import (
    COMMIT_CONNECTIONS,
    check_connections,
    slices,
)
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
from sinks.errors import ConfigError, PreflightError
from sinks.kafka import access, checks, encode, outcome, txn, txn_age
from sinks.kafka import audit as kafka_audit
from sinks.kafka.connections import DriverConnections
from sinks.kafka.pool import IdPool, lane_of, pool_prefix, pooled_id
from sinks.kafka.produce import ProducerOptions
from sinks.kafka.progress import ProgressStore
from sinks.kafka.registry import (
    ABORTED,
    COMMITTED,
    DEFAULT_TOPIC,
    OPEN,
    TOPIC_CONFIG,
    Announcement,
    announced_name,
    write_tombstones,
)
from sinks.kafka.wire import TRANSIENT, KafkaWire
from sinks.kafka.writer import KafkaWriter, WriterSettings
from sinks.keys import KeyedWrite
from sinks.naming import TxnName, check_id, scope_prefixes
from sinks.progress import SinkProgress

log = logging.getLogger("sinks.kafka")

_REGISTRY_TIMEOUT_S = 30.0


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
            preflight. ``None`` disables the sweep (see the module docstring).
        flush_timeout: seconds ``prepare`` waits for all records to be acknowledged.
        connect_timeout: seconds preflight waits for the cluster to answer.
    """

    kind = "kafka"
    _driver_only = ("_conns", "_store", "_pool")
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

    def close(self) -> None:
        """Release the driver's connections (optional; they are daemon threads)."""
        self._conns.close()

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
        needs = access.required(self.topic, self.registry_topic, self.id_prefix)
        with wire:
            access.check_topics(wire, self.describe(), needs, self.producer_config)
            checks.ensure_topic(
                wire,
                self.describe(),
                self.topic,
                partitions=self.partitions,
                replication_factor=self.replication_factor,
                config={},
                create=self.create_topic,
            )
            if self.registry_topic:
                checks.ensure_topic(
                    wire,
                    self.describe(),
                    self.registry_topic,
                    partitions=1,
                    replication_factor=self.replication_factor,
                    config=TOPIC_CONFIG,
                    create=True,
                    registry=True,
                )
            access.check_topics(wire, self.describe(), needs, self.producer_config)  # created
            probe = f"{self.id_prefix}tp-preflight.{self.sink_id}"  # under the ACL's prefix
            try:
                checks.check_transaction_timeout(
                    wire, self.describe(), self.transaction_timeout_ms, probe=probe
                )
            except checks.TransactionalIdDenied as e:
                acl = [a for a in needs if a.resource == "transactional-id"]
                raise access.denied(self.describe(), acl, self.producer_config) from e
            # the writers size their record batches to it (they run on executors: pickled)
            self.topic_max_bytes = checks.topic_max_message_bytes(wire, self.topic)
            self.pooled_ids = wire.api_version(DescribeTransactionsRequest) >= 0

    @property
    def changelog(self) -> bool:
        """Whether this sink writes by key (``order_by`` or ``delete_when``)."""
        return self.rules.order_by is not None or self.rules.delete_when is not None

    def partition_columns(self) -> list[str] | None:
        return list(self.rules.key) if self.changelog else None

    def sort_columns(self) -> list[str] | None:
        return self.rules.sort_columns() if self.changelog else None

    def _check_schema(self, schema: pa.Schema) -> None:
        if self.changelog:
            self.rules.preflight(schema)
        if self.key:
            encode.check_bytes_column(schema, self.key, "key", numbers=True)
        if self.value:
            encode.check_bytes_column(schema, self.value, "value", numbers=False)
        else:
            encode.check_json_schema(self.rules.written(schema))
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
                    wire, producer, scope, start_over_from, nonce, _REGISTRY_TIMEOUT_S
                )

        return retry_transient(
            claim,
            what=f"claim of {scope.key()} in {self.describe()}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )

    # -- driver side: commit --------------------------------------------------------------

    def commit(self, committables: Sequence[Committable]) -> None:
        pending = {c["transactional_id"]: c for c in committables}
        if not pending:
            return
        txn_age.check_at_commit(
            self.describe(), committables, timeout_ms=self.transaction_timeout_ms
        )
        total = len(pending)
        replayed: list[str] = []
        done = itertools.count(1)
        failed = False  # an attempt failed: the broker may have died inside an EndTxn

        def attempt() -> None:
            nonlocal failed
            try:
                commit_pending()
            except BaseException:
                failed = True
                raise

        def commit_pending() -> None:
            with self._conns.wire() as wire:
                replays = self._store.replays(wire, pending) if self._store else []
                if replays:
                    log.warning(
                        "%s: %d transaction(s) re-write batches this sink holds committed "
                        "already (a replay); aborting them instead of committing: %s",
                        self.describe(),
                        len(replays),
                        replays[:5],
                    )
                    self._fence(wire, list(replays))
                    for tid in replays:
                        del pending[tid]
                    replayed.extend(replays)
                parts = slices(sorted(pending), most=self.commit_connections)
                self._conns.each(wire, parts, commit_part, "commit")

        def commit_part(wire: KafkaWire, part: list[str]) -> None:
            coordinators = wire.find_coordinators(part)
            for tid in part:
                txn.commit(
                    wire,
                    coordinators[tid],
                    pending[tid],
                    where=self.describe(),
                    timeout_ms=self.transaction_timeout_ms,
                    verify=failed,
                )
                del pending[tid]  # distinct keys per thread: a retry skips it
                if next(done) == 1 and total > 1:
                    _faults.hit("driver.mid_commit", sink=self.kind)

        retry_transient(
            attempt,
            what=f"commit of {total} transaction(s) to {self.describe()}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )
        self._tombstone(replayed)

    def cannot_have_lost(self, committables: Sequence[Committable]) -> bool:
        """True when every transaction opened (``opened_at``, the executor's
        clock) less than ``transaction_timeout_ms`` minus a minute ago: the
        broker cannot have aborted any at its timeout yet. Reading the log for
        each (:meth:`classify`) costs a read per partition and transaction."""
        opened = [c.get("opened_at") for c in committables]
        if not opened or any(t is None for t in opened):
            return False
        margin_s = 60.0  # clock skew between executors and driver, the abort sweep's period
        oldest = min(float(t) for t in opened if t is not None)
        return time.time() - oldest < self.transaction_timeout_ms / 1000 - margin_s

    def classify(self, committables: Sequence[Committable]) -> dict[str, str]:
        """From the log, as the commit settles a refused EndTxn
        (:mod:`sinks.kafka.outcome`): COMMIT marker: committed; no marker yet:
        prepared; ABORT marker, or its records gone: lost."""
        found: dict[str, str] = {}

        def read() -> None:
            with self._conns.wire() as wire:
                for c in committables:
                    if c["txn"] not in found:
                        verdict = outcome.txn_outcome(wire, c)
                        found[c["txn"]] = (
                            base.COMMITTED
                            if verdict == outcome.COMMITTED
                            else base.PREPARED
                            if verdict == outcome.OPEN
                            else base.LOST
                        )

        retry_transient(
            read,
            what=f"check of {len(committables)} transaction(s) in {self.describe()}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )
        return found

    # -- driver side: abort, sweep, forget ------------------------------------------------

    def _fence(self, wire: KafkaWire, transactional_ids: list[str]) -> None:
        txn.fence(wire, transactional_ids, self.transaction_timeout_ms)

    def abort(self, committables: Sequence[Committable]) -> None:
        ids = sorted({c["transactional_id"] for c in committables})
        if not ids:
            return
        # a pooled id is ended by its own producer id and epoch (sinks/kafka/pool.py)
        own = {
            c["transactional_id"]: (int(c["producer_id"]), int(c["epoch"]))
            for c in committables
            for n in [TxnName.require(c["txn"])]
            if self._not_to_fence(
                c["transactional_id"], JobScope(n.job, n.pipeline, n.sink_id, n.incarnation)
            )
        }
        legacy = [t for t in ids if t not in own]
        parts = slices(legacy, most=self.commit_connections)  # fence() empties them as it goes

        def attempt() -> None:
            with self._conns.wire() as wire:
                txn.abort_own(wire, own)
                self._conns.each(wire, [p for p in parts if p], self._fence, "abort")

        retry_transient(
            attempt,
            what=f"abort of {len(ids)} transaction(s) in {self.describe()}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )
        self._tombstone(ids)

    def _announced(
        self, wire: KafkaWire, prefixes: tuple[str, ...]
    ) -> dict[str, tuple[TxnName, Announcement]]:
        """Every transactional id announced for this topic whose transaction's
        name starts with one of ``prefixes`` and not tombstoned, read from the
        registry (incrementally), with its name and how it ended."""
        assert self._store is not None
        live = self._store.view.refresh(wire)
        found: dict[str, tuple[TxnName, Announcement]] = {}
        for tid, a in sorted(live.items()):
            if a.topic != self.topic:
                continue
            name = announced_name(tid, a, self.id_prefix)
            if name is not None and str(name).startswith(prefixes):
                found[tid] = (name, a)
        return found

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
        """Release the lanes of settled batches whose ids the registry shows ended."""
        self._pool.settle(scope, through_batch)
        released = self._pool.release(scope, self._busy_lanes(scope))
        if released:
            log.debug("%s: lanes %s of %s back in the pool", self.describe(), released, scope)

    def _busy_lanes(self, scope: JobScope) -> set[int]:
        """Lanes of ``scope`` with an id the registry (as last read) still shows:
        its transaction open, or ended and not yet tombstoned (a tombstone
        written after a new announcement of the id would hide that one)."""
        if self._store is None:
            return set()
        prefix = pool_prefix(self.id_prefix, scope)
        return {
            lane
            for tid in self._store.view.live()
            if tid.startswith(prefix)
            for lane in [lane_of(tid, self.id_prefix)]
            if lane is not None
        }

    def _not_to_fence(self, transactional_id: str, scope: JobScope) -> bool:
        """Whether ``transactional_id`` is a pooled id that a task of this run may
        hold now: it is ended by its transaction's own epoch, never fenced."""
        return lane_of(transactional_id, self.id_prefix) is not None and self._pool.leasing(scope)

    def pool_size(self, scope: JobScope) -> int:
        """How many lanes of pooled ids ``scope`` has used in this run."""
        return self._pool.size(scope)

    def lingering(self, job: str, pipeline: str) -> list[LingeringTxn]:
        """Every transactional id of (``job``, ``pipeline``, this sink) announced
        in the registry for this topic and not yet tombstoned, of every
        incarnation: open, or ended (committed or aborted) with the tombstone
        still to come. Empty without a registry (nothing can be listed)."""
        store = self._store
        if store is None:
            return []

        def read() -> dict[str, tuple[TxnName, Announcement]]:
            with self._conns.wire() as wire:
                return self._announced(wire, scope_prefixes(job, pipeline, self.sink_id))

        found = retry_transient(
            read,
            what=f"listing of announced transactions in {self.describe()}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )
        return [
            LingeringTxn(
                str(name),
                name,
                a.state,
                (f"transactional id {tid}, " if tid != str(name) else "")
                + f"producer id {a.producer_id}, epoch {a.epoch}, announced on registry "
                f"partition {a.partition}",
            )
            for tid, (name, a) in found.items()
        ]

    def abort_lingering(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        """Fence the orphans among the ids of ``scope.own_prefixes()`` announced
        for this topic; tombstone them once the registry shows them aborted.

        An orphan found committed (its ``forget`` was missed: a crash between the
        ledger's record and ``forget``) is not fenced: its progress is recorded
        under the incarnation in its name (never the one this sink claimed: after
        a start-over they differ), then it is tombstoned."""
        store = self._store
        if store is None:
            return []

        orphans_named: dict[str, TxnName] = {}

        def sweep() -> tuple[list[TxnName], dict[str, Announcement]]:
            with self._conns.wire() as wire:
                announced = self._announced(wire, scope.own_prefixes())
                orphans = {t: n for t, (n, _) in announced.items() if is_orphan(n)}
                orphans_named.update(orphans)
                # (an orphan that ended already needs no fence: its writer aborted it, or
                # the broker did at its timeout, bumping the epoch)
                ending = [t for t in sorted(orphans) if announced[t][1].state == OPEN]
                # a pooled id may be leased to a batch in flight (now, or by the time
                # a fence lands): end the orphan's own transaction (its producer id
                # and epoch), never fence the id
                pooled = [t for t in ending if self._not_to_fence(t, scope)]
                if pooled:
                    txn.abort_own(wire, {t: announced[t][1].own_epoch() for t in pooled})
                fenced = [t for t in ending if t not in pooled]
                if fenced:
                    self._fence(wire, list(fenced))  # fenced twice after a retry: harmless
                live = store.view.refresh(wire)  # the markers of the ended ones
                return [orphans[t] for t in ending], {t: live[t] for t in orphans if t in live}

        ended, found = retry_transient(
            sweep,
            what=f"sweep of lingering transactions in {self.describe()}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )
        committed = [t for t, a in found.items() if a.state == COMMITTED]
        if committed and self._record_committed(
            [orphans_named[t] for t in committed], as_named=True
        ):
            self._tombstone(committed)
        self._tombstone(sorted(t for t, a in found.items() if a.state == ABORTED))
        aborted = sorted(str(n) for n in ended)
        if aborted:
            log.info("aborted %d lingering Kafka transaction(s): %s", len(aborted), aborted)
        return aborted

    def evidence(self, committable: Committable) -> dict[str, Any]:
        return kafka_audit.evidence(committable)

    def audit(self, scope: JobScope, checkpoints: Sequence[CheckpointEvidence]) -> list[Finding]:
        with self._conns.wire() as wire:
            return kafka_audit.audit(wire, checkpoints)

    def forget(self, committables: Sequence[Committable]) -> None:
        """Record the committed batches in a progress record, then tombstone
        their announcements (which said the same until then)."""
        ids = sorted({c["transactional_id"] for c in committables})
        names = [TxnName.require(c["txn"]) for c in committables]
        if ids and self._record_committed(names):
            self._tombstone(ids)

    def _record_committed(self, names: list[TxnName], *, as_named: bool = False) -> bool:
        """Append the progress records of the committed transactions ``names``
        (see :meth:`ProgressStore.record_committed`); False (and the
        announcements must stay) when they could not be written."""
        store = self._store
        if store is None:
            return True
        try:
            with self._conns.wire() as wire, self._conns.producer() as producer:
                store.record_committed(
                    wire, producer, names, _REGISTRY_TIMEOUT_S, as_named=as_named
                )
        except Exception as e:
            log.warning(
                "could not record the progress of %d committed transaction(s) in registry %s "
                "(%r); their announcements stay and say the same",
                len(names),
                self.registry_topic,
                e,
            )
            return False
        return True

    def _tombstone(self, ids: list[str]) -> None:
        """Mark ids resolved in the registry. Best effort: a missed tombstone only
        makes a later sweep see an already finished id again (harmless)."""
        if not ids or self._store is None:
            return
        try:
            with self._conns.producer() as producer:
                write_tombstones(producer, self._store.registry, ids, timeout_s=_REGISTRY_TIMEOUT_S)
        except Exception as e:
            log.warning(
                "could not tombstone %d id(s) in registry %s (%r); harmless, a later sweep retries",
                len(ids),
                self.registry_topic,
                e,
            )
            return
        self._store.view.forget(ids)
