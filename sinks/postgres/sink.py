"""PostgreSQL exactly-once sink: prepared transactions, committed by the driver.

The commit path (driver): :meth:`PostgresSink.commit` issues ``COMMIT PREPARED``
for every committable, over a few connections at once (each ``COMMIT
PREPARED`` waits for its WAL flush; the server flushes concurrent ones
together). It is idempotent: a gid that is no longer prepared was
either committed before (its marker row, written inside the prepared
transaction, is visible) or lost (no marker): the latter raises
:class:`TransactionLostError`, never silence.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sinks import _faults, keys, settings
from sinks._parallel import (
    COMMIT_CONNECTIONS,
    check_connections,
    run_parts,
    slices,
)
from sinks._retry import retry_transient
from sinks.audit import CheckpointEvidence, Finding
from sinks.base import (
    COMMITTED,
    LOST,
    PREPARED,
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
from sinks.errors import ConfigError, PreflightError, TransactionLostError
from sinks.naming import TxnName, check_id, scope_prefixes
from sinks.postgres import audit as pg_audit
from sinks.postgres import catalog, liveness, replace
from sinks.postgres.progress import PROGRESS_DDL, ProgressTable
from sinks.postgres.types import ddl_type, wire_type
from sinks.postgres.values import PG_TYPE_KEY
from sinks.postgres.writer import DELETE_FLAG, PostgresWriter, WriterSettings
from sinks.progress import SinkProgress

log = logging.getLogger("sinks.postgres")

_TRANSIENT = (psycopg.OperationalError,)


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
            of them inserted (see the README, "Keyed writes").
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
    _driver_only = ("_capacity", "_capacity_lock")

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
        for stmt in (
            sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.marker_schema)),
            sql.SQL(catalog.MARKER_DDL).format(marker=self.marker_ident),
            sql.SQL(PROGRESS_DDL).format(progress=sql.Identifier(self.marker_schema, "progress")),
        ):
            try:
                conn.execute(stmt)
            except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject):
                pass  # created concurrently by another job: that is fine
            except psycopg.errors.InsufficientPrivilege as e:
                raise PreflightError(
                    f"{self.describe()}: cannot create the commit-marker table "
                    f"{self.marker_schema}.{self.marker_name} ({e}); create it as an admin "
                    "or grant CREATE, or pass marker_table= naming a schema you may write"
                ) from e
        self._audit_columns = self._add_audit_columns(conn)

    def _add_audit_columns(self, conn: psycopg.Connection) -> bool:
        """Whether the marker table has the audit columns (``batch``, ``rows``),
        adding them to a table an earlier version created, and the index that
        finds a scope's markers by gid prefix (they are kept for the audit
        window now, so a scan would grow with it). Each change waits at most
        2 s for its lock: prepared transactions of a crashed run hold the table
        until recovery settles them; then the table stays as it is (legacy
        paths, or a scan) until a later start."""
        have = {
            c.name for c in catalog.table_columns(conn, self.marker_schema, self.marker_name) or []
        }
        missing = [c for c in catalog.MARKER_LATER_COLUMNS if c not in have]
        changes: list[tuple[str, sql.Composable]] = []
        if missing:
            changes.append(
                (
                    f"columns {missing} for audits",
                    sql.SQL("ALTER TABLE {} ").format(self.marker_ident)
                    + sql.SQL(", ").join(
                        sql.SQL("ADD COLUMN IF NOT EXISTS {} bigint").format(sql.Identifier(c))
                        for c in missing
                    ),
                )
            )
        index = f"{self.marker_name}_gid_prefix"
        found = conn.execute(
            "SELECT 1 FROM pg_indexes WHERE schemaname = %s AND indexname = %s",
            (self.marker_schema, index),
        ).fetchone()
        if found is None:
            changes.append(
                (
                    f"the index {index}",
                    sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (gid text_pattern_ops)").format(
                        sql.Identifier(index), self.marker_ident
                    ),
                )
            )
        complete = not missing
        for what, change in changes:
            try:
                with conn.transaction():
                    conn.execute("SET LOCAL lock_timeout = '2s'")
                    conn.execute(change)
                if what.startswith("columns"):
                    complete = True
            except (psycopg.errors.LockNotAvailable, psycopg.errors.InsufficientPrivilege) as e:
                log.warning(
                    "%s: could not add %s to the commit-marker table %s.%s (%s); the sink "
                    "works without, and a later start tries again (as the table's owner: "
                    "ALTER TABLE ... ADD COLUMN batch bigint, ADD COLUMN rows bigint; CREATE "
                    "INDEX ... (gid text_pattern_ops))",
                    self.describe(),
                    what,
                    self.marker_schema,
                    self.marker_name,
                    str(e).strip(),
                )
            except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject):
                pass  # created concurrently by another job
        return complete

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

    # -- driver side: commit, abort, sweep --------------------------------------------

    def _prepared(self, conn: psycopg.Connection, gids: list[str]) -> set[str]:
        rows = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            " AND gid = ANY(%s)",
            (gids,),
        ).fetchall()
        return {r[0] for r in rows}

    def commit(self, committables: Sequence[Committable]) -> None:
        if self.replace_where is not None:
            self._commit_replace(committables)
            return
        gids = [c["txn"] for c in committables]
        if gids:
            doing: list[str] = []  # the statement in flight, for a commit that hangs
            retry_transient(
                lambda: self._commit_once(gids, doing),
                what=f"commit of {len(gids)} transaction(s) to {self.describe()}",
                transient=_TRANSIENT,
                deadline=self.commit_timeout,
                in_flight=lambda: doing[-1] if doing else None,
            )

    def _commit_once(self, gids: list[str], doing: list[str]) -> None:
        with self.connect(application_name="twophase-commit") as conn:
            prepared = self._prepared(conn, gids)
            missing = [g for g in gids if g not in prepared]
            if missing:
                self._check_committed(conn, missing)
            replays: list[str] = []
            for scope, names in self._claims.group(map(TxnName.require, prepared)).items():
                if scope.incarnation is None:
                    continue  # first-format work of a ledger that never claimed
                self.progress_table.check_owner(conn, scope)
                settled = self.progress_table.settled_batch(conn, scope)
                replays += sorted(str(n) for n in names if n.batch_id <= settled)
            if replays:
                log.warning(
                    "%s: %d transaction(s) re-write batches this sink holds committed "
                    "already (a replay); rolling them back instead of committing: %s",
                    self.describe(),
                    len(replays),
                    replays[:5],
                )
                self._rollback(replays)
            todo = [g for g in gids if g in prepared and g not in replays]
            parts = slices(todo, most=self.commit_connections)
            count = itertools.count(1)  # the fault point is after the first COMMIT PREPARED

            def commit_part(c: psycopg.Connection, part: list[str]) -> None:
                for gid in part:
                    doing.append(f"COMMIT PREPARED '{gid}'")
                    try:
                        c.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
                    except psycopg.errors.UndefinedObject:
                        self._check_committed(c, [gid])  # committed concurrently, or lost
                    if next(count) == 1 and len(prepared) > 1:
                        _faults.hit("driver.mid_commit", sink=self.kind)

            run_parts(
                parts,
                commit_part,
                conn,
                lambda: self.connect("twophase-commit"),
                name="twophase-pg-commit",
            )

    def _commit_replace(self, committables: Sequence[Committable]) -> None:
        """One transaction: the rows matching ``replace_where`` go, the staged
        rows of ``committables`` come (:func:`replace.commit`)."""
        if not committables:
            return
        assert self.replace_where is not None and self._wire is not None
        names = [TxnName.require(c["txn"]) for c in committables]
        scopes = {JobScope(n.job, n.pipeline, n.sink_id, n.incarnation) for n in names}
        if len(scopes) != 1:
            raise ValueError(f"{self!r}: a replace commits the work of one scope at a time")
        scope = scopes.pop()

        def once() -> None:
            with self.connect(application_name="twophase-replace") as conn:
                self.progress_table.check_owner(conn, scope)
                replace.commit(
                    conn,
                    target=self.table_ident,
                    staging=self.staging(scope),
                    markers=self.marker_ident,
                    marker_audit=bool(self._audit_columns),
                    columns=list(self._wire.names),
                    predicate=self.replace_where or "",
                    committables=committables,
                    job=scope.job,
                    where=self.describe(),
                )

        retry_transient(
            once,
            what=f"replace of {self.replace_where!r} in {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )

    def _marked(self, conn: psycopg.Connection, gids: list[str]) -> set[str]:
        """The ``gids`` whose commit marker is visible: committed."""
        rows = conn.execute(
            sql.SQL("SELECT gid FROM {} WHERE gid = ANY(%s)").format(self.marker_ident), (gids,)
        ).fetchall()
        return {r[0] for r in rows}

    def _check_committed(self, conn: psycopg.Connection, gids: list[str]) -> None:
        lost = sorted(set(gids) - self._marked(conn, gids))
        if lost:
            raise TransactionLostError(
                f"{self.describe()}: {len(lost)} prepared transaction(s) are gone without "
                f"having been committed (rolled back by someone else?): {', '.join(lost[:5])}"
                + (" ..." if len(lost) > 5 else "")
                + ". Their rows are not in the table; the job stops rather than lose them "
                "silently. Re-run the affected batches from source to restore them."
            )

    def classify(self, committables: Sequence[Committable]) -> dict[str, str]:
        """Prepared (in ``pg_prepared_xacts``), committed (its marker is
        visible) or lost (neither): the checks of :meth:`commit`."""
        gids = [c["txn"] for c in committables]
        if not gids:
            return {}

        def read() -> dict[str, str]:
            with self.connect(application_name="twophase-classify") as conn:
                if self.replace_where is not None:
                    return self._classify_staged(conn, committables)
                prepared = self._prepared(conn, gids)
                marked = self._marked(conn, [g for g in gids if g not in prepared])
            return {
                g: PREPARED if g in prepared else COMMITTED if g in marked else LOST for g in gids
            }

        return retry_transient(
            read,
            what=f"check of {len(gids)} transaction(s) in {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )

    def _classify_staged(
        self, conn: psycopg.Connection, committables: Sequence[Committable]
    ) -> dict[str, str]:
        """A replace's transactions: committed (marker), staged in full
        (prepared) or lost."""
        gids = [str(c["txn"]) for c in committables]
        marked = self._marked(conn, gids)
        found: dict[str, str] = {}
        for c in committables:
            g = str(c["txn"])
            if g in marked:
                found[g] = COMMITTED
                continue
            name = TxnName.require(g)
            scope = JobScope(name.job, name.pipeline, name.sink_id, name.incarnation)
            counts = replace.staged_counts(conn, self.staging(scope), [g]) or {}
            found[g] = PREPARED if counts.get(g) == int(c.get("rows", 0)) else LOST
        return found

    def abort(self, committables: Sequence[Committable]) -> None:
        gids = [c["txn"] for c in committables]
        if gids and self.replace_where is not None:
            by_scope: dict[JobScope, list[str]] = {}
            for g in gids:
                n = TxnName.require(g)
                by_scope.setdefault(
                    JobScope(n.job, n.pipeline, n.sink_id, n.incarnation), []
                ).append(g)

            def delete() -> None:
                with self.connect(application_name="twophase-abort") as conn:
                    for scope, names in by_scope.items():
                        replace.delete_staged(conn, self.staging(scope), names)

            retry_transient(
                delete,
                what=f"abort of {len(gids)} staged transaction(s) in {self.describe()}",
                transient=_TRANSIENT,
                deadline=self.commit_timeout,
            )
            return
        if gids:
            retry_transient(
                lambda: self._rollback(gids),
                what=f"abort of {len(gids)} transaction(s) in {self.describe()}",
                transient=_TRANSIENT,
                deadline=self.commit_timeout,
            )

    def _rollback(self, gids: list[str]) -> None:
        with self.connect(application_name="twophase-abort") as conn:
            for gid in sorted(self._prepared(conn, gids)):
                with contextlib.suppress(psycopg.errors.UndefinedObject):  # already gone
                    conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))

    @staticmethod
    def _prepared_named(
        conn: psycopg.Connection, prefixes: Sequence[str]
    ) -> list[tuple[str, TxnName, str]]:
        """``(gid, name, when prepared)`` of every transaction prepared in this
        database whose gid starts with one of ``prefixes`` and is one of ours."""
        rows = conn.execute(
            "SELECT gid, prepared FROM pg_prepared_xacts WHERE database = current_database()"
            " AND EXISTS (SELECT FROM unnest(%s::text[]) p WHERE starts_with(gid, p))"
            " ORDER BY gid",
            (list(prefixes),),
        ).fetchall()
        found = []
        for gid, prepared in rows:
            name = TxnName.parse(gid)
            if name is not None:
                found.append((gid, name, f"{prepared:%Y-%m-%d %H:%M:%S %Z}".strip()))
        return found

    def lingering(self, job: str, pipeline: str) -> list[LingeringTxn]:
        """Every prepared transaction of (``job``, ``pipeline``, this sink) in
        the database, of every incarnation: what :meth:`abort_lingering` looks at."""

        def read() -> list[LingeringTxn]:
            with self.connect(application_name="twophase-lingering") as conn:
                found = self._prepared_named(conn, scope_prefixes(job, pipeline, self.sink_id))
            return [
                LingeringTxn(gid, name, "prepared", f"prepared at {when}")
                for gid, name, when in found
            ]

        return retry_transient(
            read,
            what=f"listing of prepared transactions in {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )

    def abort_lingering(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        def sweep() -> list[str]:
            with self.connect(application_name="twophase-recover") as conn:
                found = self._prepared_named(conn, scope.own_prefixes())
                staged = self._sweep_staged(conn, scope, is_orphan)
            orphans = [gid for gid, name, _ in found if is_orphan(name)]
            if orphans:
                self._rollback(orphans)
            return orphans + staged

        aborted = retry_transient(
            sweep,
            what=f"sweep of lingering transactions in {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )
        if aborted:
            log.info("rolled back %d lingering prepared transaction(s): %s", len(aborted), aborted)
        return aborted

    def _sweep_staged(
        self, conn: psycopg.Connection, scope: JobScope, is_orphan: OrphanTest
    ) -> list[str]:
        """Delete a replace's staged rows of orphan transactions; the whole
        staging table of a scope this sink has not claimed (an incarnation a
        start-over took over: no task of it writes any more)."""
        if self.replace_where is None:
            return []
        staging = self.staging(scope)
        txns = replace.staged_txns(conn, staging)
        orphans = [t for t in txns if (n := TxnName.parse(t)) is not None and is_orphan(n)]
        if not self._claims.owns(scope) and txns and len(orphans) == len(txns):
            replace.delete_staged(conn, staging, orphans, drop=True)
        elif orphans:
            replace.delete_staged(conn, staging, orphans)
        return orphans

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
