"""A partition replace in PostgreSQL (``PostgresSink(replace_where=SQL)``).

A backfill that rewrites one slice of a table must leave it right however often
it runs: the rows matching ``replace_where`` go, the pipeline's rows come, all
at once for readers. Per-task prepared transactions cannot do that (each would
delete under the others' locks, and several ``COMMIT PREPARED`` are not one
step for readers), so:

* **tasks** (:class:`ReplaceWriter`) COPY their rows into the scope's private
  **staging table** (in the marker schema, :func:`staging_name`), each row tagged
  with the task's transaction name, and commit it as an ordinary transaction:
  nothing of the target changes. Before that, a row outside the predicate
  fails the task (nothing of it is staged). A retried attempt removes its
  partition's earlier rows first;
* the pipeline is **deferred** (``Sink.commits_at_finish``): its batches stay
  pending in the ledger, across restarts, until the checkpoint that finishes it;
* the **commit** (:func:`commit`, the driver, one transaction): ``DELETE FROM
  target WHERE replace_where``, ``INSERT ... SELECT`` the committed
  transactions' rows from the staging table, a commit marker per transaction
  (the sink's memory of what it committed, and the commit's idempotence: a
  retried commit that finds the markers only drops the staging table), and
  ``DROP`` the staging table. Each transaction's staged row count is checked
  first: a transaction whose rows are gone is lost, never committed short.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pgpq
import psycopg
import pyarrow as pa
from psycopg import sql

from sinks.base import (
    Committable,
    JobScope,
    OrphanTest,
    Outcome,
    SinkWriter,
    WriteContext,
)
from sinks.errors import DataError, TransactionLostError
from sinks.naming import TxnName
from sinks.postgres.committer import PreparedCommitter
from sinks.postgres.values import PG_TYPE_KEY, to_wire
from sinks.postgres.writer import WriterSettings

log = logging.getLogger("sinks.postgres")

TXN_COLUMN = "_twophase_txn"
"""the staging table's column naming each row's transaction"""


class ReplaceError(DataError):
    """A row of a replacing pipeline does not match its ``replace_where``."""


def staging_name(scope: JobScope) -> str:
    """The staging table of ``scope`` (its incarnation included)."""
    digest = hashlib.sha1(scope.txn_prefix().encode()).hexdigest()[:20]
    return f"replace_{digest}"


def txn_field() -> pa.Field:
    return pa.field(TXN_COLUMN, pa.string(), metadata={PG_TYPE_KEY: b"text"})


class ReplaceWriter(SinkWriter):
    """Stages one task attempt's rows in the scope's staging table (committed,
    invisible in the target) after checking them against the predicate."""

    def __init__(
        self,
        settings: WriterSettings,
        ctx: WriteContext,
        wire: pa.Schema,
        staging: sql.Composable,
        predicate: str,
    ) -> None:
        self._settings = settings
        self._name = ctx.txn_name()
        self._gid = str(self._name)
        self._wire = wire.append(txn_field())
        self._staging = staging
        self._predicate = predicate
        self._conn: psycopg.Connection | None = None
        self._copy_cm: Any = None
        self._copy: Any = None
        self._encoder: pgpq.ArrowToPostgresBinaryEncoder | None = None
        self._rows = 0
        self._bytes = 0

    def _begin(self) -> None:
        cfg = self._settings
        self._conn = conn = cfg.connect("twophase-replace")
        create_staging(conn, cfg.table, self._staging, [f.name for f in self._wire][:-1])
        conn.execute("BEGIN")
        conn.execute(  # an earlier attempt of this partition staged rows: they go
            sql.SQL("DELETE FROM {} WHERE starts_with({}, %s)").format(
                self._staging, sql.Identifier(TXN_COLUMN)
            ),
            (self._name.partition_prefix(),),
        )
        cols = sql.SQL(", ").join(sql.Identifier(f.name) for f in self._wire)
        self._encoder = pgpq.ArrowToPostgresBinaryEncoder(self._wire)
        self._copy_cm = conn.cursor().copy(
            sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(self._staging, cols)
        )
        self._copy = self._copy_cm.__enter__()
        header = self._encoder.write_header()
        self._bytes += len(header)
        self._copy.write(header)

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        tagged = batch.append_column(txn_field(), pa.array([self._gid] * batch.num_rows))
        wire = to_wire(tagged, self._wire, self._settings.where)
        if self._conn is None:
            self._begin()
        assert self._encoder is not None
        data = self._encoder.write_batch(wire)
        self._bytes += len(data)
        self._copy.write(data)
        self._rows += batch.num_rows

    def prepare(self) -> Committable | None:
        if self._conn is None:
            return None
        assert self._encoder is not None
        conn = self._conn
        trailer = self._encoder.finish()
        self._bytes += len(trailer)
        self._copy.write(trailer)
        cm, self._copy_cm = self._copy_cm, None
        cm.__exit__(None, None, None)
        outside = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE {} = %s AND NOT coalesce(({}), false)").format(
                self._staging, sql.Identifier(TXN_COLUMN), sql.SQL(self._predicate)
            ),
            (self._gid,),
        ).fetchone()
        if outside and outside[0]:
            raise ReplaceError(
                f"{self._settings.where}: {outside[0]} row(s) of task {self._gid} do not match "
                f"replace_where {self._predicate!r}: a replace writes only inside the slice it "
                "replaces. Nothing of the backfill was committed; filter the rows, or widen "
                "the predicate"
            )
        conn.execute("COMMIT")
        return {"txn": self._gid, "rows": self._rows, "bytes": self._bytes, "staged": True}

    def close(self, failed: bool = False) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if self._copy_cm is not None:
                self._copy_cm.__exit__(RuntimeError, RuntimeError("task failed"), None)
        except Exception:
            pass
        finally:
            conn.close()  # an uncommitted transaction dies with its connection


def create_staging(
    conn: psycopg.Connection, target: sql.Composable, staging: sql.Composable, columns: list[str]
) -> None:
    """The staging table: the fed columns as the target has them, and the
    transaction name. A regular table (it must outlive a crash of the driver)."""
    cols = sql.SQL(", ").join(map(sql.Identifier, columns))
    # created at the same instant by another task: that is fine
    with contextlib.suppress(psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} AS SELECT {}, NULL::text AS {} FROM {} WITH NO DATA"
            ).format(staging, cols, sql.Identifier(TXN_COLUMN), target)
        )


def staged_counts(
    conn: psycopg.Connection, staging: sql.Composable, gids: Sequence[str]
) -> dict[str, int] | None:
    """Rows staged per transaction of ``gids``; None when there is no staging table."""
    try:
        with conn.transaction():
            rows = conn.execute(
                sql.SQL("SELECT {0}, count(*) FROM {1} WHERE {0} = ANY(%s) GROUP BY 1").format(
                    sql.Identifier(TXN_COLUMN), staging
                ),
                (list(gids),),
            ).fetchall()
    except psycopg.errors.UndefinedTable:
        return None
    return {str(g): int(n) for g, n in rows}


def commit(
    conn: psycopg.Connection,
    *,
    target: sql.Composable,
    staging: sql.Composable,
    markers: sql.Composable,
    marker_audit: bool,
    columns: list[str],
    predicate: str,
    committables: Sequence[Committable],
    job: str,
    where: str,
) -> bool:
    """Replace (module docstring) in one transaction; False when the markers
    show it committed before (then only the staging table goes)."""
    gids = [str(c["txn"]) for c in committables]
    with conn.transaction():
        marked = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE gid = ANY(%s)").format(markers), (gids,)
        ).fetchone()
        if marked and marked[0]:
            if marked[0] != len(gids):
                raise TransactionLostError(
                    f"{where}: {marked[0]} of the replace's {len(gids)} transactions have "
                    "commit markers and the others not: the replace was not one transaction"
                )
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(staging))
            return False
        counts = staged_counts(conn, staging, gids) or {}
        short = [c["txn"] for c in committables if counts.get(c["txn"], 0) != int(c["rows"])]
        if short:
            raise TransactionLostError(
                f"{where}: the staging table no longer holds the rows of {len(short)} "
                f"transaction(s) of the replace (e.g. {short[0]}); nothing was replaced. "
                "Re-run the backfill from source"
            )
        deleted = conn.execute(
            sql.SQL("DELETE FROM {} WHERE {}").format(target, sql.SQL(predicate))
        ).rowcount
        cols = sql.SQL(", ").join(map(sql.Identifier, columns))
        inserted = conn.execute(
            sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} WHERE {} = ANY(%s)").format(
                target, cols, cols, staging, sql.Identifier(TXN_COLUMN)
            ),
            (gids,),
        ).rowcount
        for c in committables:
            batch = TxnName.require(str(c["txn"])).batch_id
            if marker_audit:
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (gid, job, batch, rows) VALUES (%s, %s, %s, %s)"
                    ).format(markers),
                    (c["txn"], job, batch, int(c["rows"])),
                )
            else:
                conn.execute(
                    sql.SQL("INSERT INTO {} (gid, job) VALUES (%s, %s)").format(markers),
                    (c["txn"], job),
                )
        conn.execute(sql.SQL("DROP TABLE {}").format(staging))
    log.info("%s: replaced %d row(s) matching %r by %d", where, deleted, predicate, inserted)
    return True


def staged_txns(conn: psycopg.Connection, staging: sql.Composable) -> list[str]:
    """The transactions with rows in the staging table ([] without one)."""
    try:
        with conn.transaction():
            rows = conn.execute(
                sql.SQL("SELECT DISTINCT {} FROM {}").format(sql.Identifier(TXN_COLUMN), staging)
            ).fetchall()
    except psycopg.errors.UndefinedTable:
        return []
    return sorted(str(r[0]) for r in rows)


def delete_staged(
    conn: psycopg.Connection, staging: sql.Composable, gids: Sequence[str], *, drop: bool = False
) -> None:
    """Delete the staged rows of ``gids`` (``drop``: the whole staging table)."""
    with conn.transaction():
        if drop:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(staging))
            return
        found = conn.execute("SELECT to_regclass(%s)", (staging.as_string(conn),)).fetchone()
        if found is None or found[0] is None:
            return
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE {} = ANY(%s)").format(
                staging, sql.Identifier(TXN_COLUMN)
            ),
            (list(gids),),
        )


def _scope_of(gid: str) -> JobScope:
    n = TxnName.require(gid)
    return JobScope(n.job, n.pipeline, n.sink_id, n.incarnation)


@dataclass
class ReplaceCommitter(PreparedCommitter):
    """The driver side of a replacing sink: :func:`commit` at the pipeline's
    final checkpoint; abort and sweep delete staged rows."""

    target: sql.Composable | None = None
    staging: Callable[[JobScope], sql.Composable] | None = None
    columns: Callable[[], list[str]] | None = None
    """the fed columns (known after preflight)"""
    predicate: str = ""
    marker_audit: Callable[[], bool] | None = None

    def _staging(self, scope: JobScope) -> sql.Composable:
        assert self.staging is not None
        return self.staging(scope)

    def commit(self, committables: Sequence[Committable]) -> None:
        """One transaction: the rows matching the predicate go, the staged rows
        of ``committables`` come (:func:`commit`)."""
        if not committables:
            return
        scopes = {_scope_of(str(c["txn"])) for c in committables}
        if len(scopes) != 1:
            raise ValueError(f"{self.where}: a replace commits the work of one scope at a time")
        scope = scopes.pop()
        assert self.target is not None and self.columns is not None

        def once() -> None:
            with self.connect("twophase-replace") as conn:
                self.progress_table().check_owner(conn, scope)
                commit(
                    conn,
                    target=self.target,  # type: ignore[arg-type]
                    staging=self._staging(scope),
                    markers=self.markers,
                    marker_audit=bool(self.marker_audit and self.marker_audit()),
                    columns=self.columns(),  # type: ignore[misc]
                    predicate=self.predicate,
                    committables=committables,
                    job=scope.job,
                    where=self.where,
                )

        self._retry(once, f"replace of {self.predicate!r} in")

    def _classify(
        self, conn: psycopg.Connection, committables: Sequence[Committable]
    ) -> dict[str, Outcome]:
        """Committed (marker), staged in full (prepared) or lost."""
        gids = [str(c["txn"]) for c in committables]
        marked = self.marked(conn, gids)
        found: dict[str, Outcome] = {}
        for c in committables:
            g = str(c["txn"])
            if g in marked:
                found[g] = Outcome.COMMITTED
                continue
            counts = staged_counts(conn, self._staging(_scope_of(g)), [g]) or {}
            found[g] = Outcome.PREPARED if counts.get(g) == int(c.get("rows", 0)) else Outcome.LOST
        return found

    def abort(self, committables: Sequence[Committable]) -> None:
        """Delete the staged rows of ``committables``."""
        by_scope: dict[JobScope, list[str]] = {}
        for c in committables:
            by_scope.setdefault(_scope_of(str(c["txn"])), []).append(str(c["txn"]))
        if not by_scope:
            return

        def delete() -> None:
            with self.connect("twophase-abort") as conn:
                for scope, names in by_scope.items():
                    delete_staged(conn, self._staging(scope), names)

        self._retry(delete, f"abort of {len(committables)} staged transaction(s) in")

    def _sweep_more(
        self, conn: psycopg.Connection, scope: JobScope, is_orphan: OrphanTest
    ) -> list[str]:
        """Delete the staged rows of orphan transactions; the whole staging
        table of a scope this sink has not claimed (an incarnation a start-over
        took over: no task of it writes any more)."""
        staging = self._staging(scope)
        txns = staged_txns(conn, staging)
        orphans = [t for t in txns if (n := TxnName.parse(t)) is not None and is_orphan(n)]
        if not self.claims.owns(scope) and txns and len(orphans) == len(txns):
            delete_staged(conn, staging, orphans, drop=True)
        elif orphans:
            delete_staged(conn, staging, orphans)
        return orphans
