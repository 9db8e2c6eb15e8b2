"""The PostgreSQL sink's memory of its own progress (see :mod:`sinks.progress`).

Two tables in the marker schema hold it:

* ``committed_txns`` (the commit markers): one row per transaction, written
  *inside* the prepared transaction, so it becomes visible exactly when the
  transaction commits. Its gid names the incarnation and the batch, and it
  holds the batch and the rows written (the audit's evidence, see
  :mod:`sinks.postgres.audit`). Markers are kept while the ledger keeps the
  audit evidence of their checkpoint and deleted after (``retire``);
* ``progress``: one row per (job, pipeline, sink, table): the owner incarnation,
  the incarnation a start-over took the claim from, and ``batch``, the highest
  batch whose commit the ledger has recorded; raised by ``forget`` (the
  markers of those batches are still there, so a crash loses nothing).

What the sink holds committed is therefore ``max(progress.batch, batch of every
committed marker of the owner)``: it survives any crash, because both parts are
committed PostgreSQL rows. A claim is the row itself: ``INSERT .. ON CONFLICT DO
NOTHING`` then ``SELECT .. FOR UPDATE`` in one transaction, so two jobs
claiming at the same instant are serialised by the row lock and the second sees
the first's owner.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from sinks.base import JobScope
from sinks.naming import TxnName, scope_prefix
from sinks.progress import SinkProgress, conflict, may_claim

PROGRESS_DDL = """
CREATE TABLE IF NOT EXISTS {progress} (
    job text NOT NULL,
    pipeline text NOT NULL,
    sink text NOT NULL,
    target text NOT NULL,
    owner text NOT NULL,
    batch bigint NOT NULL DEFAULT -1,
    previous text,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, pipeline, sink, target)
)
"""

_KEY = "job = %s AND pipeline = %s AND sink = %s AND target = %s"


def _starting(prefix: str) -> sql.Composable:
    """A ``LIKE`` pattern for the gids that start with ``prefix``, as a literal:
    the planner then uses the marker table's ``text_pattern_ops`` index (a
    bound parameter would let a generic plan scan the table)."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return sql.Literal(escaped + "%")


class ProgressTable:
    """Reads and writes the progress of one PostgreSQL sink (one target table)."""

    def __init__(
        self,
        progress: sql.Composable,
        markers: sql.Composable,
        target: str,
        where: str,
        *,
        audit_columns: bool = False,
    ):
        self.progress = progress
        self.markers = markers
        self.audit_columns = audit_columns
        """whether the marker table has the batch column (else: batches from gids)"""
        self.target = target
        self.where = where

    def _key(self, scope: JobScope) -> tuple[str, str, str, str]:
        return (scope.job, scope.pipeline, scope.sink_id, self.target)

    def _committed_marker_batch(self, conn: psycopg.Connection, scope: JobScope, owner: str) -> int:
        prefix = scope_prefix(scope.job, scope.pipeline, scope.sink_id, owner)
        recorded = -1
        legacy_only = sql.SQL("")
        if self.audit_columns:
            row = conn.execute(
                sql.SQL("SELECT max(batch) FROM {} WHERE gid LIKE {}").format(
                    self.markers, _starting(prefix)
                )
            ).fetchone()
            recorded = int(row[0]) if row is not None and row[0] is not None else -1
            legacy_only = sql.SQL(" AND batch IS NULL")
        legacy = conn.execute(  # markers that do not record their batch: from the gid
            sql.SQL("SELECT gid FROM {} WHERE gid LIKE {}").format(self.markers, _starting(prefix))
            + legacy_only
        ).fetchall()
        names = [TxnName.parse(r[0]) for r in legacy]
        return max([recorded, *(n.batch_id for n in names if n is not None)])

    def read(
        self, conn: psycopg.Connection, scope: JobScope, *, lock: bool = False
    ) -> SinkProgress:
        row = conn.execute(
            sql.SQL("SELECT owner, batch, previous FROM {} WHERE " + _KEY).format(self.progress)
            + (sql.SQL(" FOR UPDATE") if lock else sql.SQL("")),
            self._key(scope),
        ).fetchone()
        if row is None:
            return SinkProgress(owner=None)
        owner, batch, previous = row
        return SinkProgress(
            owner=owner,
            batch=max(int(batch), self._committed_marker_batch(conn, scope, owner)),
            previous=previous,
        )

    def settled_batch(self, conn: psycopg.Connection, scope: JobScope) -> int:
        """The batch up to which the ledger recorded this scope's commits (-1)."""
        row = conn.execute(
            sql.SQL("SELECT batch FROM {} WHERE " + _KEY + " AND owner = %s").format(self.progress),
            (*self._key(scope), scope.incarnation),
        ).fetchone()
        return int(row[0]) if row else -1

    def claim(
        self, conn: psycopg.Connection, scope: JobScope, start_over_from: str | None
    ) -> SinkProgress:
        """Make ``scope.incarnation`` the owner, atomically (see module docstring)."""
        ours = scope.incarnation
        assert ours is not None
        with conn.transaction():
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (job, pipeline, sink, target, owner) "
                    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"
                ).format(self.progress),
                (*self._key(scope), ours),
            )
            found = self.read(conn, scope, lock=True)
            if not may_claim(found, ours, start_over_from):
                raise conflict(self.where, scope.key(), found, ours)
            if found.owner != ours:
                conn.execute(
                    sql.SQL(
                        "UPDATE {} SET owner = %s, batch = -1, previous = %s, "
                        "claimed_at = now() WHERE " + _KEY
                    ).format(self.progress),
                    (ours, found.owner, *self._key(scope)),
                )
                return SinkProgress(owner=ours, batch=-1, previous=found.owner)
            return found

    def check_owner(self, conn: psycopg.Connection, scope: JobScope) -> None:
        """Raise when another incarnation took the claim over (at commit time)."""
        found = self.read(conn, scope)
        ours = scope.incarnation
        assert ours is not None
        if found.owner is not None and found.owner != ours:
            raise conflict(self.where, scope.key(), found, ours, at_commit=True)

    def settle(self, conn: psycopg.Connection, scope: JobScope, batch: int) -> None:
        """Raise the recorded batch of the owner (its markers stay for audits)."""
        with conn.transaction():
            conn.execute(
                sql.SQL(
                    "UPDATE {} SET batch = greatest(batch, %s) WHERE " + _KEY + " AND owner = %s"
                ).format(self.progress),
                (batch, *self._key(scope), scope.incarnation),
            )

    def retire(self, conn: psycopg.Connection, scope: JobScope, before_batch: int) -> int:
        """Delete the markers of ``scope`` below ``before_batch`` whose batch the
        progress row records (the ledger keeps no audit evidence of them any
        more); a marker of a version that did not record its batch goes by the
        batch its gid names. Returns how many went."""
        prefix = scope_prefix(scope.job, scope.pipeline, scope.sink_id, scope.incarnation)
        settled = self.settled_batch(conn, scope)
        below = min(before_batch, settled + 1)
        with conn.transaction():
            gone = 0
            legacy_only = sql.SQL("")
            if self.audit_columns:
                gone = conn.execute(  # no parameters: the pattern holds a literal %
                    sql.SQL("DELETE FROM {} WHERE gid LIKE {} AND batch < {}").format(
                        self.markers, _starting(prefix), sql.Literal(below)
                    )
                ).rowcount
                legacy_only = sql.SQL(" AND batch IS NULL")
            legacy = conn.execute(
                sql.SQL("SELECT gid FROM {} WHERE gid LIKE {}").format(
                    self.markers, _starting(prefix)
                )
                + legacy_only
            ).fetchall()
            old = [
                g for (g,) in legacy if (n := TxnName.parse(g)) is not None and n.batch_id < below
            ]
            if old:
                conn.execute(
                    sql.SQL("DELETE FROM {} WHERE gid = ANY(%s)").format(self.markers), (old,)
                )
        return gone + len(old)
