"""PostgreSQL exactly-once sink: prepared transactions, committed by the driver.

This module is the sink's face: its options, preflight (:mod:`catalog`,
:mod:`markers`), its writers (:mod:`writer`, :mod:`upsert`, :mod:`replace`),
its progress and claims (:mod:`progress`). The commit path, abort and sweep
are the committer's (:mod:`sinks.postgres.committer`; a replace's,
:class:`sinks.postgres.replace.ReplaceCommitter`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sinks import keys, settings
from sinks._parallel import (
    COMMIT_CONNECTIONS,
    check_connections,
)
from sinks._retry import retry_transient
from sinks.audit import CheckpointEvidence, Finding
from sinks.base import (
    ClaimedScopes,
    Committable,
    ExpectedLoad,
    JobScope,
    LingeringTxn,
    OrphanTest,
    Sink,
    SinkWriter,
    WriteContext,
)
from sinks.errors import ConfigError, PreflightError
from sinks.naming import TxnName, check_id
from sinks.postgres import audit as pg_audit
from sinks.postgres import catalog, liveness, markers, replace
from sinks.postgres.committer import TRANSIENT as _TRANSIENT
from sinks.postgres.committer import PreparedCommitter
from sinks.postgres.progress import ProgressTable
from sinks.postgres.types import ddl_type, wire_type
from sinks.postgres.values import PG_TYPE_KEY
from sinks.postgres.writer import DELETE_FLAG, PostgresWriter, WriterSettings
from sinks.progress import SinkProgress

log = logging.getLogger("sinks.postgres")


def _auto_lock_timeout(checkpoint_interval_s: float) -> float:
    return max(120.0, 3 * checkpoint_interval_s + 60.0)


class PostgresSink(Sink):
    """Writes a pipeline's output into a PostgreSQL table exactly once.

    Args:
        dsn: libpq connection string or URI, e.g. ``postgresql://app@db:5432/shop``.
        table: target table, ``"schema.table"`` or ``"table"`` (see ``schema``).
            Names are quoted identifiers, never SQL.
        key: upsert by these columns (``INSERT ... ON CONFLICT``) instead of
            appending; the table needs a unique index on exactly these columns.
            The input is hash-partitioned by the key so that one key is written
            by one task per batch (two prepared transactions holding the same
            key would wait on each other until the commit). The rules of keyed
            writes are in :mod:`sinks.keys`: a null key is an error, and so are
            different rows of one key in one batch unless ``order_by`` says
            which one wins.
        order_by: with ``key``, the column whose greatest value wins among the
            rows of one key in a batch (e.g. ``"updated_at"``); a null in it, or
            a tie at the greatest value between different rows, is an error.
            Across batches the later batch wins.
        delete_when: with ``key``, which rows are deletes: a boolean column's
            name (``"deleted"``), or a column and the value that marks a delete
            (``("op", "D")``). A delete removes the key's row; a delete of a
            missing key is no error; the column itself is not written (the
            table needs no such column). A delete waits for this sink's earlier
            batches still awaiting their checkpoint, so that it sees a row one
            of them inserted (see :doc:`/sinks/keyed-writes`).
        schema: schema of ``table`` when ``table`` has no dot (default ``public``).
        create_table: create the table from the DataFrame schema when missing
            (with a primary key on ``key``).
        replace_where: a SQL predicate over the table's columns (e.g. ``"day =
            '2026-11-01'"``): a bounded pipeline replaces the rows it matches
            with everything it writes, in one transaction at its final
            checkpoint (:mod:`sinks.postgres.replace`). A row outside the
            predicate fails its task. Not with ``key``.
        add_columns: add the DataFrame's columns the table lacks, as nullable
            columns, once at job start (after recovery, before any data is
            prepared; :meth:`evolve_schema`). The ``ALTER TABLE`` waits at most
            half a second for its lock per try, so that readers never queue
            long behind it; if the table stays busy the job refuses to start.
            Without it a missing column fails preflight.
        sink_id: stable id of this sink in its pipeline (part of every gid);
            default derived from the database and table.
        marker_table: ``schema.table`` of the commit markers; created on preflight.
        commit_connections: connections the driver commits a checkpoint's
            prepared transactions over at once, at most (one per 4
            transactions); concurrent ``COMMIT PREPARED`` share their WAL
            flushes.
        commit_timeout: seconds a commit or abort keeps retrying transient errors
            (server restarting, connection refused) before the job fails; the
            decision stays in the ledger and the next start finishes it.
        connect_timeout: seconds to wait for a connection.
        lock_timeout: seconds a task waits for a row lock (a key another
            transaction holds) before it fails with :class:`LockWaitError`, so
            Spark retries it instead of the job hanging. ``None`` (default):
            ``max(120, 3 x checkpoint_interval + 60)``, longer than an upsert
            batch legitimately waits for the previous batch's commit on the
            keys they share. ``0``: wait forever.
    """

    kind = "postgres"
    _driver_only = ("_capacity", "_capacity_lock", "_committer")

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        key: Sequence[str] | None = None,
        order_by: str | None = None,
        delete_when: str | tuple[str, Any] | None = None,
        schema: str | None = None,
        create_table: bool = False,
        sink_id: str | None = None,
        marker_table: str = "twophase.committed_txns",
        commit_timeout: float = 300.0,
        commit_connections: int = COMMIT_CONNECTIONS,
        connect_timeout: float = 10.0,
        lock_timeout: float | None = None,
        add_columns: bool = False,
        replace_where: str | None = None,
    ) -> None:
        if not table:
            raise ConfigError("PostgresSink needs a table name")
        if schema is None:
            schema, _, table = table.rpartition(".") if "." in table else ("public", "", table)
        self.dsn = dsn
        self.schema = schema
        self.table = table
        self.key = list(key or [])
        self.order_by = order_by
        self.create_table = create_table
        self.add_columns = add_columns
        if replace_where is not None and (key or not replace_where.strip()):
            raise ConfigError(
                "PostgresSink: replace_where replaces the rows it matches with the pipeline's "
                "rows, which is neither an upsert (key=) nor an empty predicate; choose one"
            )
        self.replace_where = replace_where
        self._new_columns: list[pa.Field] = []
        self.marker_schema, _, self.marker_name = marker_table.rpartition(".")
        if not self.marker_schema:
            raise ConfigError(f"marker_table {marker_table!r} must be 'schema.table'")
        self.commit_timeout = commit_timeout
        self.commit_connections = check_connections(commit_connections)
        self.connect_timeout = connect_timeout
        if lock_timeout is not None and lock_timeout < 0:
            raise ConfigError("lock_timeout must be >= 0 seconds (0: wait forever)")
        self._lock_timeout_given = lock_timeout
        self.lock_timeout = lock_timeout if lock_timeout is not None else _auto_lock_timeout(0.0)
        self.marker_table = marker_table
        self._sink_id = check_id("sink_id", sink_id or self._default_id())
        self.rules = keys.KeyedWrite.of(self.describe(), self.key, order_by, delete_when)
        self._wire: pa.Schema | None = None
        self._claims = ClaimedScopes()
        self._init_driver_state()
        self.max_prepared: int | None = None
        """the server's ``max_prepared_transactions``, read at preflight"""
        self._audit_columns: bool | None = None
        """whether the marker table has the audit columns, seen at preflight"""

    # -- driver-side state (never pickled to executors) ----------------------------

    def _init_driver_state(self) -> None:
        self._capacity: psycopg.Connection | None = None  # the capacity check's, kept
        self._capacity_lock = threading.Lock()
        self._committer = self._make_committer()

    def _make_committer(self) -> PreparedCommitter:
        common: dict[str, Any] = {
            "where": self.describe(),
            "sink_id": self.sink_id,
            "connect": self.connect,
            "markers": self.marker_ident,
            "progress": lambda: self.progress_table,
            "claims": self._claims,
            "commit_timeout": self.commit_timeout,
            "commit_connections": self.commit_connections,
        }
        if self.replace_where is None:
            return PreparedCommitter(**common)
        return replace.ReplaceCommitter(
            **common,
            target=self.table_ident,
            staging=self.staging,
            columns=lambda: list(self._wire.names) if self._wire is not None else [],
            predicate=self.replace_where,
            marker_audit=lambda: bool(self._audit_columns),
        )

    def close(self) -> None:
        """Release the driver's kept connection (the capacity check's)."""
        with self._capacity_lock:
            conn, self._capacity = self._capacity, None
        if conn is not None:
            conn.close()

    # -- identity ---------------------------------------------------------------

    def _default_id(self) -> str:
        db = conninfo_to_dict(self.dsn).get("dbname", "")
        digest = hashlib.sha1(f"{db}\0{self.schema}\0{self.table}".encode()).hexdigest()[:6]
        readable = re.sub(r"[^A-Za-z0-9_-]", "_", self.table)[:24]
        return f"pg-{readable}-{digest}"

    @property
    def sink_id(self) -> str:
        return self._sink_id

    @property
    def table_ident(self) -> sql.Composable:
        return sql.Identifier(self.schema, self.table)

    @property
    def marker_ident(self) -> sql.Composable:
        return sql.Identifier(self.marker_schema, self.marker_name)

    @property
    def progress_table(self) -> ProgressTable:
        return ProgressTable(
            sql.Identifier(self.marker_schema, "progress"),
            self.marker_ident,
            f"{self.schema}.{self.table}",
            self.describe(),
            audit_columns=bool(self._audit_columns),
        )

    def settings(self) -> dict[str, Any]:
        """Non-secret settings (:mod:`sinks.settings`): the DSN without its
        ``password`` and ``sslpassword``."""
        info = conninfo_to_dict(self.dsn)
        for k in settings.DSN_SECRETS:
            info.pop(k, None)
        return {
            "kind": self.kind,
            "v": settings.FORMAT,
            "sink_id": self.sink_id,
            "dsn": make_conninfo(**info),
            "schema": self.schema,
            "table": self.table,
            "key": list(self.key),
            "order_by": self.order_by,
            "delete_when": self.rules.delete_when.settings() if self.rules.delete_when else None,
            "create_table": self.create_table,
            "add_columns": self.add_columns,
            "replace_where": self.replace_where,
            "marker_table": self.marker_table,
            "commit_timeout": self.commit_timeout,
            "commit_connections": self.commit_connections,
            "connect_timeout": self.connect_timeout,
            "lock_timeout": self._lock_timeout_given,
        }

    @classmethod
    def from_settings(cls, s: Mapping[str, Any], secrets: Mapping[str, str]) -> PostgresSink:
        """The sink of :meth:`settings`; the password from
        ``TWOPHASE_<SINK>_PASSWORD`` or ``PGPASSWORD`` in ``secrets``, else
        wherever libpq finds it (``~/.pgpass``, ...)."""
        dsn = s["dsn"]
        password = settings.lookup(
            secrets, (settings.env_name(s["sink_id"], "password"), "PGPASSWORD")
        )
        if password is not None:
            dsn = make_conninfo(dsn, password=password)
        return cls(
            dsn,
            s["table"],
            schema=s["schema"],
            key=s["key"],
            order_by=s.get("order_by"),
            delete_when=s.get("delete_when"),
            create_table=s["create_table"],
            add_columns=s.get("add_columns", False),
            replace_where=s.get("replace_where"),
            sink_id=s["sink_id"],
            marker_table=s["marker_table"],
            commit_timeout=s["commit_timeout"],
            commit_connections=s.get("commit_connections", COMMIT_CONNECTIONS),
            connect_timeout=s["connect_timeout"],
            lock_timeout=s["lock_timeout"],
        )

    def describe(self) -> str:
        info = conninfo_to_dict(self.dsn)
        where = f"{info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"
        return f"PostgreSQL table {self.schema}.{self.table} at {where}"

    def __repr__(self) -> str:
        return f"PostgresSink({self.describe()}, key={self.key}, order_by={self.order_by!r})"

    def partition_columns(self) -> list[str] | None:
        return self.key or None

    def check_checkpoint_interval(self, checkpoint_interval_s: float) -> None:
        """Size the lock timeout for this interval; refuse an upsert whose given
        lock timeout is shorter than a batch's legitimate wait for the previous
        batch's commit of the keys they share."""
        given = self._lock_timeout_given
        if given is None:
            self.lock_timeout = _auto_lock_timeout(checkpoint_interval_s)
        elif self.key and 0 < given <= checkpoint_interval_s:
            raise PreflightError(
                f"{self.describe()}: lock_timeout={given}s is not longer than "
                f"checkpoint_interval={checkpoint_interval_s}s. With key={self.key}, a batch "
                "writing a key the previous batch wrote waits for that batch's commit at the "
                "next checkpoint, so its tasks would fail spuriously; leave lock_timeout at "
                "its default or make it several checkpoint intervals long"
            )

    # -- connections --------------------------------------------------------------

    def connect(self, application_name: str = "twophase") -> psycopg.Connection:
        """A connection that notices a dead server within a third of
        ``commit_timeout`` (at most 30 s; :mod:`sinks.postgres.liveness`), so
        a half-open connection cannot outlast the commit's retries."""
        return liveness.connect(
            self.dsn,
            application_name,
            connect_timeout=self.connect_timeout,
            commit_timeout=self.commit_timeout,
        )

    # -- preflight ----------------------------------------------------------------

    def preflight(self, schema: pa.Schema) -> None:
        where = f"{self.schema}.{self.table}"
        try:
            conn = self.connect(application_name="twophase-preflight")
        except psycopg.OperationalError as e:
            raise PreflightError(f"cannot connect to {self.describe()}: {e}".strip()) from e
        with conn:
            mpt = int(conn.execute("SHOW max_prepared_transactions").fetchone()[0])
            if mpt == 0:
                raise PreflightError(
                    f"{self.describe()}: max_prepared_transactions is 0, so PostgreSQL "
                    "cannot prepare transactions and exactly-once is impossible. Set "
                    "max_prepared_transactions in postgresql.conf to at least the number of "
                    "Spark tasks that write at once times the batches awaiting commit "
                    "(e.g. 100), and restart the server."
                )
            self.max_prepared = mpt
            self._ensure_markers(conn)
            columns = catalog.table_columns(conn, self.schema, self.table)
            if columns is None:
                if not self.create_table:
                    raise PreflightError(
                        f"table {where} does not exist ({self.describe()}); create it, "
                        "or pass create_table=True to PostgresSink"
                    )
                catalog.create_table(
                    conn, self.table_ident, self.rules.written(schema), self.key, where
                )
                columns = catalog.table_columns(conn, self.schema, self.table)
                assert columns is not None
            self.rules.preflight(schema)
            written = self.rules.written(schema)
            have = {c.name for c in columns}
            self._new_columns = [
                f
                for f in written
                if self.add_columns and f.name not in have and f.name not in self.key
            ]
            if self._new_columns:  # evolve_schema adds them, then comes back here
                written = pa.schema([f for f in written if f not in self._new_columns])
            targets = catalog.check_columns(where, columns, written, self.key)
            if self.replace_where is not None and not self._new_columns:
                # (with new columns to add, the pass after evolve_schema checks it)
                catalog.check_replace_predicate(conn, self.table_ident, self.replace_where, where)
            if self.key and set(self.key) not in catalog.unique_keys(conn, self.schema, self.table):
                raise PreflightError(
                    f"upsert by key {self.key} needs a unique index or primary key on exactly "
                    f"those columns of {where} (INSERT ... ON CONFLICT uses it); create one, "
                    "e.g. ALTER TABLE ... ADD PRIMARY KEY (...)"
                )
        if self._new_columns:
            self._wire = None
            return
        self._wire = pa.schema(
            [
                pa.field(f.name, wire_type(f.type, c), metadata={PG_TYPE_KEY: c.formatted})
                for f, c in zip(written, targets, strict=True)
            ]
        )
        if self.rules.delete_when is not None:
            self._wire = self._wire.append(DELETE_FLAG)

    def evolve_schema(self, schema: pa.Schema) -> None:
        """With ``add_columns``: add the DataFrame's columns the table lacks (as
        nullable columns, :func:`catalog.add_columns`), then check again."""
        new = self._new_columns
        if not new:
            return
        where = f"{self.schema}.{self.table}"
        with self.connect(application_name="twophase-evolve") as conn:
            catalog.add_columns(conn, self.table_ident, new, where)
        log.info(
            "%s: added the column(s) %s (add_columns=True)",
            self.describe(),
            ", ".join(f"{f.name} {ddl_type(f.type)}" for f in new),
        )
        self.preflight(schema)

    def _ensure_markers(self, conn: psycopg.Connection) -> None:
        self._audit_columns = markers.ensure(
            conn, self.marker_schema, self.marker_name, self.describe()
        )

    def expect_load(self, load: ExpectedLoad) -> None:
        """Warn when this sink alone may hold more prepared transactions between
        two checkpoints than the server's ``max_prepared_transactions``."""
        limit = self.max_prepared
        if limit is None or load.transactions < limit:
            return
        log.warning(
            "%s: max_prepared_transactions is %d, and this sink may hold about %d prepared "
            "transactions between two checkpoints (%d tasks per batch x %d batches). Set "
            "max_prepared_transactions to at least %d in postgresql.conf (a server restart; "
            "other jobs on the server count too), or checkpoint more often. Meanwhile the "
            "job takes a checkpoint early when the server comes close to the limit",
            self.describe(),
            limit,
            load.transactions,
            load.tasks_per_batch,
            load.batches_per_checkpoint,
            2 * load.transactions,
        )

    @property
    def commits_at_finish(self) -> bool:  # type: ignore[override]
        return self.replace_where is not None

    @property
    def prepared_work_holds_resources(self) -> bool:  # type: ignore[override]
        """A batch's tasks hold prepared transactions (row locks, prepared
        slots) until the commit; a replace's tasks stage into a table instead."""
        return self.replace_where is None

    def staging(self, scope: JobScope) -> sql.Composable:
        """The staging table of a replacing scope."""
        return sql.Identifier(self.marker_schema, replace.staging_name(scope))

    def checkpoint_pressure(self, batch: Sequence[Committable]) -> str | None:
        """A reason to checkpoint now when the server's prepared transactions
        (all databases, all jobs) leave less room than two more batches like
        this one; None otherwise (also when the server cannot be asked)."""
        limit = self.max_prepared
        if not batch or limit is None:
            return None
        try:
            held = self._prepared_count()
        except psycopg.OperationalError:
            return None  # the commit will say what is wrong with the server
        if held + 2 * len(batch) <= limit:
            return None
        return (
            f"{self.describe()}: {held} of max_prepared_transactions={limit} are prepared "
            f"and the last batch prepared {len(batch)}"
        )

    def _prepared_count(self) -> int:
        """How many transactions the server holds prepared (every database and
        job), over a connection kept from one batch to the next: the check runs
        in every batch's barrier, where a new connection would cost more than
        the query. A connection that fails is dropped; the next check opens one."""
        with self._capacity_lock:
            conn = self._capacity
            if conn is None or conn.closed:
                conn = self._capacity = self.connect("twophase-capacity")
            try:
                row = conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()
            except psycopg.Error:
                self._capacity = None
                with contextlib.suppress(Exception):
                    conn.close()
                raise
            return int(row[0]) if row else 0

    # -- executor side --------------------------------------------------------------

    def open_writer(self, ctx: WriteContext, schema: pa.Schema) -> SinkWriter:
        if self._wire is None:
            raise RuntimeError(
                "PostgresSink.preflight() must run before writers open"
                + (
                    f", and evolve_schema() after it: the table lacks {len(self._new_columns)} "
                    "column(s) of the DataFrame (add_columns=True)"
                    if self._new_columns
                    else ""
                )
            )
        settings = WriterSettings(
            where=self.describe(),
            dsn=self.dsn,
            connect_timeout=self.connect_timeout,
            commit_timeout=self.commit_timeout,
            lock_timeout=self.lock_timeout,
            table=self.table_ident,
            markers=self.marker_ident,
            marker_audit=bool(self._audit_columns),
            marker_schema=self.marker_schema,
            rules=self.rules,
        )
        if self.replace_where is not None:
            return replace.ReplaceWriter(
                settings, ctx, self._wire, self.staging(ctx.scope), self.replace_where
            )
        return PostgresWriter(settings, ctx, self._wire)

    # -- progress and claims -----------------------------------------------------------

    def progress(self, scope: JobScope) -> SinkProgress:
        def read() -> SinkProgress:
            with self.connect(application_name="twophase-progress") as conn:
                return self.progress_table.read(conn, scope)

        return retry_transient(
            read,
            what=f"read of the progress of {scope.key()} in {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )

    def claim(self, scope: JobScope, *, start_over_from: str | None = None) -> SinkProgress:
        def claim() -> SinkProgress:
            with self.connect(application_name="twophase-claim") as conn:
                self._ensure_markers(conn)
                return self.progress_table.claim(conn, scope, start_over_from)

        found = retry_transient(
            claim,
            what=f"claim of {scope.key()} in {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )
        self._claims.remember(scope)
        return found

    # -- driver side: commit, abort, sweep (sinks.postgres.committer) ----------------

    def commit(self, committables: Sequence[Committable]) -> None:
        self._committer.commit(committables)

    def classify(self, committables: Sequence[Committable]) -> dict[str, str]:
        return self._committer.classify(committables)

    def abort(self, committables: Sequence[Committable]) -> None:
        self._committer.abort(committables)

    def lingering(self, job: str, pipeline: str) -> list[LingeringTxn]:
        return self._committer.lingering(job, pipeline)

    def abort_lingering(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        return self._committer.sweep(scope, is_orphan)

    def evidence(self, committable: Committable) -> dict[str, Any]:
        return pg_audit.evidence(committable)

    def audit(self, scope: JobScope, checkpoints: Sequence[CheckpointEvidence]) -> list[Finding]:
        with self.connect(application_name="twophase-audit") as conn:
            have = {
                c.name
                for c in catalog.table_columns(conn, self.marker_schema, self.marker_name) or []
            }
            complete = set(catalog.MARKER_LATER_COLUMNS) <= have
            return pg_audit.audit(conn, self.marker_ident, checkpoints, columns=complete)

    def retire_evidence(self, scope: JobScope, before_batch: int) -> None:
        """Delete the commit markers of ``scope`` below ``before_batch``."""
        try:
            with self.connect(application_name="twophase-cleanup") as conn:
                self.progress_table.retire(conn, scope, before_batch)
        except psycopg.OperationalError as e:  # harmless: the next retirement deletes them
            log.warning("could not delete old commit markers of %s: %s", self.describe(), e)

    def forget(self, committables: Sequence[Committable]) -> None:
        """Record the committed batches in the progress row (their markers stay
        while the ledger keeps their audit evidence: :meth:`retire_evidence`)."""
        gids = [c["txn"] for c in committables]
        if not gids:
            return
        try:
            with self.connect(application_name="twophase-cleanup") as conn:
                for scope, names in self._claims.group(map(TxnName.require, gids)).items():
                    batch = max(n.batch_id for n in names)
                    self.progress_table.settle(conn, scope, batch)
        except psycopg.OperationalError as e:  # harmless: the markers still say it
            log.warning(
                "could not record the progress of %d committed transactions (%s); their "
                "commit markers stay and say the same",
                len(gids),
                e,
            )
