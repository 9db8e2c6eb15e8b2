"""The driver side of the PostgreSQL sink: claim its scopes, commit, abort,
classify and sweep prepared transactions (what Flink calls the sink's
committer), and record what the ledger holds committed.

The commit path: :meth:`PreparedCommitter.commit` issues ``COMMIT PREPARED``
for every committable, over a few connections at once (each ``COMMIT
PREPARED`` waits for its WAL flush; the server flushes concurrent ones
together). It is idempotent: a gid that is no longer prepared was either
committed before (its marker row, written inside the prepared transaction, is
visible) or lost (no marker): the latter raises
:class:`~sinks.errors.TransactionLostError`, never silence. Before committing,
the scope's claim is checked (another owner refuses) and transactions of
batches the sink's progress row already holds are replays: rolled back.

The claim, the progress row and the commit markers are the sink's memory of
its own progress (:mod:`sinks.postgres.progress`): claimed before any commit
(:meth:`PreparedCommitter.claim`), raised once the ledger recorded a commit
(:meth:`PreparedCommitter.forget`), and markers deleted once the ledger keeps
no audit evidence of their checkpoints (:meth:`PreparedCommitter.retire_evidence`).

A partition replace commits differently (:class:`sinks.postgres.replace.ReplaceCommitter`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from sinks import _faults
from sinks._parallel import run_parts, slices
from sinks._retry import retry_transient
from sinks.audit import CheckpointEvidence, Finding
from sinks.capabilities import Audits, RetiresEvidence
from sinks.committer import REPAYS, Committable, Committer, LingeringTxn, OrphanTest, Outcome
from sinks.errors import REWRITE_ADVICE, TransactionLostError
from sinks.naming import TxnName, scope_prefixes
from sinks.postgres import audit as pg_audit
from sinks.postgres import catalog
from sinks.postgres.progress import ProgressTable
from sinks.progress import SinkProgress
from sinks.scope import ClaimedScopes, JobScope

log = logging.getLogger("sinks.postgres")

TRANSIENT = (psycopg.OperationalError,)


@dataclass
class PreparedCommitter(Audits, RetiresEvidence, Committer):
    """Commits, aborts and sweeps one sink's prepared transactions: the
    PostgreSQL sink's :class:`~sinks.committer.Committer`."""

    where: str
    """the sink, for messages"""
    sink_id: str
    connect: Callable[[str], AbstractContextManager[psycopg.Connection]]
    """a connection of the sink for one ``with`` block, given an application
    name (kept between uses: :mod:`sinks.postgres.kept`)"""
    markers: sql.Composable
    marker_table: tuple[str, str]
    """the marker table's schema and name"""
    progress_table: Callable[[], ProgressTable]
    claims: ClaimedScopes
    ensure_markers: Callable[[psycopg.Connection], None]
    """creates the marker and progress tables when missing (before a claim)"""
    commit_timeout: float
    commit_connections: int

    def _retry(self, fn: Callable[[], object], what: str, **kw: Any) -> object:
        return retry_transient(
            fn, what=f"{what} {self.where}", transient=TRANSIENT, deadline=self.commit_timeout, **kw
        )

    # -- progress and claims -----------------------------------------------------------

    def progress(self, scope: JobScope) -> SinkProgress:
        """The owner of ``scope`` and the batch up to which it holds it committed."""

        def read() -> SinkProgress:
            with self.connect("twophase-progress") as conn:
                return self.progress_table().read(conn, scope)

        return self._retry(read, f"read of the progress of {scope.key()} in")  # type: ignore[return-value]

    def claim(self, scope: JobScope, *, start_over_from: str | None = None) -> SinkProgress:
        """Make ``scope.incarnation`` the owner of ``scope``
        (:meth:`~sinks.postgres.progress.ProgressTable.claim`) and remember the
        scope as this sink's."""

        def claim() -> SinkProgress:
            with self.connect("twophase-claim") as conn:
                self.ensure_markers(conn)
                return self.progress_table().claim(conn, scope, start_over_from)

        found: SinkProgress = self._retry(claim, f"claim of {scope.key()} in")  # type: ignore[assignment]
        self.claims.remember(scope)
        return found

    # -- commit ----------------------------------------------------------------------

    def commit(self, committables: Sequence[Committable]) -> None:
        gids = [c["txn"] for c in committables]
        repaying = {c["txn"] for c in committables if c.get(REPAYS)}  # never replays
        if gids:
            doing: list[str] = []  # the statement in flight, for a commit that hangs
            self._retry(
                lambda: self._commit_once(gids, doing, repaying),
                f"commit of {len(gids)} transaction(s) to",
                in_flight=lambda: doing[-1] if doing else None,
            )

    def _commit_once(self, gids: list[str], doing: list[str], repaying: set[str]) -> None:
        with self.connect("twophase-commit") as conn:
            prepared = self.prepared(conn, gids)
            missing = [g for g in gids if g not in prepared]
            if missing:
                self.check_committed(conn, missing)
            replays: list[str] = []
            progress = self.progress_table()
            ordinary = (g for g in prepared if g not in repaying)
            for scope, names in self.claims.group(map(TxnName.require, ordinary)).items():
                if scope.incarnation is None:
                    continue  # first-format work of a ledger that never claimed
                progress.check_owner(conn, scope)
                settled = progress.settled_batch(conn, scope)
                replays += sorted(str(n) for n in names if n.batch_id <= settled)
            if replays:
                log.warning(
                    "%s: %d transaction(s) re-write batches this sink holds committed "
                    "already (a replay); rolling them back instead of committing: %s",
                    self.where,
                    len(replays),
                    replays[:5],
                )
                self.rollback(replays)
            todo = [g for g in gids if g in prepared and g not in replays]
            parts = slices(todo, most=self.commit_connections)
            count = itertools.count(1)  # the fault point is after the first COMMIT PREPARED

            def commit_part(c: psycopg.Connection, part: list[str]) -> None:
                for gid in part:
                    doing.append(f"COMMIT PREPARED '{gid}'")
                    try:
                        c.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
                    except psycopg.errors.UndefinedObject:
                        self.check_committed(c, [gid])  # committed concurrently, or lost
                    if next(count) == 1 and len(prepared) > 1:
                        _faults.hit("driver.mid_commit", sink="postgres")

            run_parts(
                parts,
                commit_part,
                conn,
                lambda: self.connect("twophase-commit"),
                name="twophase-pg-commit",
            )

    # -- what the server says ----------------------------------------------------------

    @staticmethod
    def prepared(conn: psycopg.Connection, gids: list[str]) -> set[str]:
        """The ``gids`` prepared in this database."""
        rows = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            " AND gid = ANY(%s)",
            (gids,),
        ).fetchall()
        return {r[0] for r in rows}

    def marked(self, conn: psycopg.Connection, gids: list[str]) -> set[str]:
        """The ``gids`` whose commit marker is visible: committed."""
        rows = conn.execute(
            sql.SQL("SELECT gid FROM {} WHERE gid = ANY(%s)").format(self.markers), (gids,)
        ).fetchall()
        return {r[0] for r in rows}

    def check_committed(self, conn: psycopg.Connection, gids: list[str]) -> None:
        lost = sorted(set(gids) - self.marked(conn, gids))
        if lost:
            raise TransactionLostError(
                f"{self.where}: {len(lost)} prepared transaction(s) are gone without "
                f"having been committed (rolled back by someone else?): {', '.join(lost[:5])}"
                + (" ..." if len(lost) > 5 else "")
                + ". Their rows are not in the table. "
                + REWRITE_ADVICE
            )

    def classify(self, committables: Sequence[Committable]) -> dict[str, Outcome]:
        """Prepared (in ``pg_prepared_xacts``), committed (its marker is
        visible) or lost (neither): the checks of :meth:`commit`."""
        gids = [c["txn"] for c in committables]
        if not gids:
            return {}

        def read() -> dict[str, Outcome]:
            with self.connect("twophase-classify") as conn:
                return self._classify(conn, committables)

        return self._retry(read, f"check of {len(gids)} transaction(s) in")  # type: ignore[return-value]

    def _classify(
        self, conn: psycopg.Connection, committables: Sequence[Committable]
    ) -> dict[str, Outcome]:
        gids = [c["txn"] for c in committables]
        prepared = self.prepared(conn, gids)
        marked = self.marked(conn, [g for g in gids if g not in prepared])
        return {
            g: Outcome.PREPARED
            if g in prepared
            else Outcome.COMMITTED
            if g in marked
            else Outcome.LOST
            for g in gids
        }

    # -- abort and sweep ---------------------------------------------------------------

    def abort(self, committables: Sequence[Committable]) -> None:
        gids = [c["txn"] for c in committables]
        if gids:
            self._retry(lambda: self.rollback(gids), f"abort of {len(gids)} transaction(s) in")

    def rollback(self, gids: list[str]) -> None:
        with self.connect("twophase-abort") as conn:
            for gid in sorted(self.prepared(conn, gids)):
                with contextlib.suppress(psycopg.errors.UndefinedObject):  # already gone
                    conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))

    @staticmethod
    def prepared_named(
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
        the database, of every incarnation: what :meth:`sweep` looks at."""

        def read() -> list[LingeringTxn]:
            with self.connect("twophase-lingering") as conn:
                found = self.prepared_named(conn, scope_prefixes(job, pipeline, self.sink_id))
            return [
                LingeringTxn(gid, name, "prepared", f"prepared at {when}")
                for gid, name, when in found
            ]

        return self._retry(read, "listing of prepared transactions in")  # type: ignore[return-value]

    def sweep(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        """Roll back every prepared transaction of ``scope`` that ``is_orphan``;
        return their names."""

        def sweep() -> list[str]:
            with self.connect("twophase-recover") as conn:
                found = self.prepared_named(conn, scope.own_prefixes())
                staged = self._sweep_more(conn, scope, is_orphan)
            orphans = [gid for gid, name, _ in found if is_orphan(name)]
            if orphans:
                self.rollback(orphans)
            return orphans + staged

        aborted: list[str] = self._retry(sweep, "sweep of lingering transactions in")  # type: ignore[assignment]
        if aborted:
            log.info("rolled back %d lingering transaction(s): %s", len(aborted), aborted)
        return aborted

    def _sweep_more(
        self, conn: psycopg.Connection, scope: JobScope, is_orphan: OrphanTest
    ) -> list[str]:
        """What else a sweep removes (a replace's staged rows); nothing here."""
        return []

    # -- after the ledger recorded the commit --------------------------------------------

    def forget(self, committables: Sequence[Committable]) -> None:
        """Record the committed batches in the progress row (their markers stay
        while the ledger keeps their audit evidence: :meth:`retire_evidence`)."""
        gids = [c["txn"] for c in committables]
        if not gids:
            return
        try:
            with self.connect("twophase-cleanup") as conn:
                for scope, names in self.claims.group(map(TxnName.require, gids)).items():
                    batch = max(n.batch_id for n in names)
                    self.progress_table().settle(conn, scope, batch)
        except psycopg.OperationalError as e:  # harmless: the markers still say it
            log.warning(
                "could not record the progress of %d committed transactions (%s); their "
                "commit markers stay and say the same",
                len(gids),
                e,
            )

    def retire_evidence(self, scope: JobScope, before_batch: int) -> None:
        """Delete the commit markers of ``scope`` below ``before_batch``."""
        try:
            with self.connect("twophase-cleanup") as conn:
                self.progress_table().retire(conn, scope, before_batch)
        except psycopg.OperationalError as e:  # harmless: the next retirement deletes them
            log.warning("could not delete old commit markers of %s: %s", self.where, e)

    # -- audits ----------------------------------------------------------------------

    def evidence(self, committable: Committable) -> dict[str, Any]:
        return pg_audit.evidence(committable)

    def audit(self, scope: JobScope, checkpoints: Sequence[CheckpointEvidence]) -> list[Finding]:
        with self.connect("twophase-audit") as conn:
            schema, name = self.marker_table
            have = {c.name for c in catalog.table_columns(conn, schema, name) or []}
            complete = set(catalog.MARKER_LATER_COLUMNS) <= have
            return pg_audit.audit(conn, self.markers, checkpoints, columns=complete)
