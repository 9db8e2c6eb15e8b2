"""PostgreSQL exactly-once sink: prepared transactions, committed by the driver.

This module is the sink's face: its options and settings, its preflight (the
role's privileges by :mod:`sinks.postgres.access`, the table by
:func:`sinks.postgres.catalog.check_target`, the marker tables by
:mod:`sinks.postgres.markers`, the server's room for prepared transactions by
:mod:`sinks.postgres.capacity`) and its writers (:mod:`sinks.postgres.writer`,
:mod:`sinks.postgres.upsert`, :mod:`sinks.postgres.replace`). Claims, the
commit path, abort, sweep and the progress they record are the committer's
(:mod:`sinks.postgres.committer`; a replace's,
:class:`sinks.postgres.replace.ReplaceCommitter`).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from sinks import keys
from sinks._parallel import (
    COMMIT_CONNECTIONS,
    check_connections,
)
from sinks.base import ClaimedScopes, Committable, JobScope, Sink, SinkWriter, WriteContext
from sinks.capabilities import ExpectedLoad, HoldsPreparedWork
from sinks.errors import ConfigError, PreflightError
from sinks.naming import check_id
from sinks.postgres import access, capacity, catalog, grants, liveness, markers, recorded, replace
from sinks.postgres.capacity import PreparedCapacity
from sinks.postgres.committer import PreparedCommitter
from sinks.postgres.kept import KeptConnections
from sinks.postgres.progress import ProgressTable
from sinks.postgres.types import ddl_type
from sinks.postgres.writer import PostgresWriter, WriterSettings

log = logging.getLogger("sinks.postgres")


def _auto_lock_timeout(checkpoint_interval_s: float) -> float:
    return max(120.0, 3 * checkpoint_interval_s + 60.0)


class PostgresSink(Sink, HoldsPreparedWork):
    """Writes a pipeline's output into a PostgreSQL table exactly once.

    Args:
        dsn: libpq connection string or URI, e.g. ``postgresql://app@db:5432/shop``.
        table: target table, ``"schema.table"`` or ``"table"`` (see ``schema``).
            Names are quoted identifiers, never SQL.
        key: upsert by these columns (``INSERT ... ON CONFLICT``) instead of
            appending; the table needs a unique index on exactly these columns.
            The input is hash-partitioned by the key so that one key is written
            by one task per batch (two prepared transactions holding the same
            key would wait on each other until the commit), unless Spark's plan
            already keeps each key in one partition (an aggregation by the key
            or a part of it upstream, :mod:`lifecycle.partitioning`) or
            ``partitioned_by_key`` says so. The rules of keyed
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
        partitioned_by_key: with ``key``, declare that no key spans two Spark
            partitions of a batch (the DataFrame is partitioned by the key or a
            part of it, and Spark's plan does not show it): the sink then skips
            its shuffle by key. A wrong declaration fails the batch within
            seconds with :class:`~sinks.errors.KeySpansTasksError`, nothing of
            it committed (:mod:`sinks.postgres.lock_watch`). Not with
            ``delete_when``: a delete does not wait for another task's
            uncommitted insert of its key, so that mistake could not be seen.
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
    _driver_only = ("_capacity", "_kept", "_committer")

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        key: Sequence[str] | None = None,
        order_by: str | None = None,
        delete_when: str | tuple[str, Any] | None = None,
        partitioned_by_key: bool = False,
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
        if partitioned_by_key and (not key or delete_when is not None):
            raise ConfigError(
                "PostgresSink: partitioned_by_key=True needs key= and no delete_when "
                "(a delete cannot tell that another task of its batch inserted its key)"
            )
        self.partitioned_by_key = partitioned_by_key
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
        self.lock_timeout_given = lock_timeout
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
        self._capacity = PreparedCapacity(self.describe(), self.connect, lambda: self.max_prepared)
        self._kept = KeptConnections(self.connect, most=self.commit_connections + 1)
        self._committer = self._make_committer()

    def _make_committer(self) -> PreparedCommitter:
        common: dict[str, Any] = {
            "where": self.describe(),
            "sink_id": self.sink_id,
            "connect": self._kept.connection,
            "markers": self._marker_ident,
            "marker_table": (self.marker_schema, self.marker_name),
            "progress_table": lambda: self._progress_table,
            "claims": self._claims,
            "ensure_markers": self._ensure_markers,
            "commit_timeout": self.commit_timeout,
            "commit_connections": self.commit_connections,
        }
        if self.replace_where is None:
            return PreparedCommitter(**common)
        return replace.ReplaceCommitter(
            **common,
            target=self._table_ident,
            staging=self._staging,
            columns=lambda: list(self._wire.names) if self._wire is not None else [],
            predicate=self.replace_where,
            marker_audit=lambda: bool(self._audit_columns),
        )

    def committer(self) -> PreparedCommitter:
        """The driver's :class:`~sinks.postgres.committer.PreparedCommitter`
        (a :class:`~sinks.postgres.replace.ReplaceCommitter` for a replace)."""
        return self._committer

    def close(self) -> None:
        """Release the driver's kept connections (the capacity check's, the
        committer's: :mod:`sinks.postgres.kept`)."""
        self._capacity.close()
        self._kept.close()

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
    def _table_ident(self) -> sql.Composable:
        """The target table as a quoted identifier (``schema.table``)."""
        return sql.Identifier(self.schema, self.table)

    @property
    def _marker_ident(self) -> sql.Composable:
        """The commit-marker table as a quoted identifier (``marker_table``)."""
        return sql.Identifier(self.marker_schema, self.marker_name)

    @property
    def _progress_table(self) -> ProgressTable:
        """Where this sink keeps its claim and committed progress (``twophase.progress``
        beside the markers)."""
        return ProgressTable(
            sql.Identifier(self.marker_schema, "progress"),
            self._marker_ident,
            f"{self.schema}.{self.table}",
            self.describe(),
            audit_columns=bool(self._audit_columns),
        )

    def settings(self) -> dict[str, Any]:
        """Non-secret settings (:mod:`sinks.settings`, :func:`recorded.settings_of`):
        the DSN without its ``password`` and ``sslpassword``."""
        return recorded.settings_of(self)

    @classmethod
    def from_settings(cls, s: Mapping[str, Any], secrets: Mapping[str, str]) -> PostgresSink:
        """The sink of :meth:`settings` (:func:`recorded.arguments`: the password
        from ``TWOPHASE_<SINK>_PASSWORD`` or ``PGPASSWORD`` in ``secrets``)."""
        dsn, table, kwargs = recorded.arguments(s, secrets)
        return cls(dsn, table, **kwargs)

    def describe(self) -> str:
        info = conninfo_to_dict(self.dsn)
        where = f"{info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"
        return f"PostgreSQL table {self.schema}.{self.table} at {where}"

    def __repr__(self) -> str:
        return f"PostgresSink({self.describe()}, key={self.key}, order_by={self.order_by!r})"

    def partition_columns(self) -> list[str] | None:
        """The key (none when ``partitioned_by_key`` declares the batches are)."""
        return None if self.partitioned_by_key else self.key or None

    def check_checkpoint_interval(self, checkpoint_interval_s: float) -> None:
        """Size the lock timeout for this interval; refuse an upsert whose given
        lock timeout is shorter than a batch's legitimate wait for the previous
        batch's commit of the keys they share."""
        given = self.lock_timeout_given
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
        """Check the role's privileges (:func:`sinks.postgres.access.required`),
        the server (:func:`sinks.postgres.capacity.max_prepared`), the marker
        tables and the table (:func:`sinks.postgres.catalog.check_target`)."""
        needs = access.required(self.settings())
        try:
            conn = self.connect(application_name="twophase-preflight")
        except psycopg.OperationalError as e:
            raise grants.connect_failed(e, self.describe(), self.dsn, needs) from e
        with conn:
            grants.check(conn, self.describe(), needs)
            self.max_prepared = capacity.max_prepared(conn, self.describe())
            self._ensure_markers(conn)
            target = catalog.check_target(
                conn,
                schema,
                table_schema=self.schema,
                table=self.table,
                ident=self._table_ident,
                key=self.key,
                rules=self.rules,
                create_missing=self.create_table,
                add_missing=self.add_columns,
                replace_where=self.replace_where,
                sink=self.describe(),
            )
        self._new_columns = target.new_columns
        self._wire = target.wire

    def evolve_schema(self, schema: pa.Schema) -> None:
        """With ``add_columns``: add the DataFrame's columns the table lacks (as
        nullable columns, :func:`catalog.add_columns`), then check again."""
        new = self._new_columns
        if not new:
            return
        where = f"{self.schema}.{self.table}"
        with self.connect(application_name="twophase-evolve") as conn:
            catalog.add_columns(conn, self._table_ident, new, where)
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
        self._capacity.warn(load)

    @property
    def commits_at_finish(self) -> bool:  # type: ignore[override]
        return self.replace_where is not None

    def holds_prepared_work(self) -> bool:
        """Prepared transactions hold row locks and slots (a replace stages instead)."""
        return self.replace_where is None

    def _staging(self, scope: JobScope) -> sql.Composable:
        """The staging table of a replacing scope."""
        return sql.Identifier(self.marker_schema, replace.staging_name(scope))

    def prepared_work_limit(self) -> float | None:
        """``lock_timeout`` (None: none): later tasks waiting on its rows fail after it."""
        return self.lock_timeout or None

    def server_prepared_transactions(self) -> tuple[int, int] | None:
        """Prepared transactions and their limit, as the last barrier read them."""
        return self._capacity.last_seen

    def prepare_waits_for_commits(self) -> bool:
        """A keyed sink's upserts wait for the rows an earlier batch's prepared
        transactions hold, until their checkpoint."""
        return bool(self.key)

    def checkpoint_pressure(self, batch: Sequence[Committable]) -> str | None:
        """A reason to checkpoint now when the server's prepared transactions
        (all databases, all jobs) leave less room than two more batches like
        this one; None otherwise (also when the server cannot be asked)."""
        return self._capacity.pressure(batch)

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
            table=self._table_ident,
            markers=self._marker_ident,
            marker_audit=bool(self._audit_columns),
            marker_schema=self.marker_schema,
            rules=self.rules,
            partitioned_by_key=self.partitioned_by_key,
        )
        if self.replace_where is not None:
            return replace.ReplaceWriter(
                settings, ctx, self._wire, self._staging(ctx.scope), self.replace_where
            )
        return PostgresWriter(settings, ctx, self._wire)
