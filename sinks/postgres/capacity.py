"""The server's room for prepared transactions (``max_prepared_transactions``).

Each task of a batch holds a prepared transaction until the checkpoint commits
it, and the server refuses a ``PREPARE TRANSACTION`` beyond its limit (shared
by every database and job on it). So the limit is read at preflight
(:func:`max_prepared`: 0 refuses the job), compared at job start with what the
job may hold between two checkpoints (:meth:`PreparedCapacity.warn`), and
watched in every batch's barrier (:meth:`PreparedCapacity.pressure`), which asks
for an early checkpoint before the server is full.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psycopg

from sinks.base import Committable, ExpectedLoad
from sinks.errors import PreflightError

log = logging.getLogger("sinks.postgres")


def max_prepared(conn: psycopg.Connection, where: str) -> int:
    """The server's ``max_prepared_transactions``; a server that has 0 cannot
    prepare transactions, so exactly-once is impossible there: refused."""
    row = conn.execute("SHOW max_prepared_transactions").fetchone()
    assert row is not None  # SHOW answers one row
    mpt = int(row[0])
    if mpt == 0:
        raise PreflightError(
            f"{where}: max_prepared_transactions is 0, so PostgreSQL "
            "cannot prepare transactions and exactly-once is impossible. Set "
            "max_prepared_transactions in postgresql.conf to at least the number of "
            "Spark tasks that write at once times the batches awaiting commit "
            "(e.g. 100), and restart the server."
        )
    return mpt


@dataclass
class PreparedCapacity:
    """Compares one sink's prepared transactions with the server's limit (on
    the driver, over a connection kept from one batch to the next)."""

    where: str
    """the sink, for messages"""
    connect: Callable[[str], psycopg.Connection]
    """a connection of the sink, given an application name"""
    limit: Callable[[], int | None]
    """the server's ``max_prepared_transactions``, read at preflight (None before)"""
    last_seen: tuple[int, int] | None = field(default=None, init=False)
    """the server's prepared transactions and its limit at the last check"""
    _conn: psycopg.Connection | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def warn(self, load: ExpectedLoad) -> None:
        """Warn when this sink alone may hold more prepared transactions between
        two checkpoints than the server's ``max_prepared_transactions``."""
        limit = self.limit()
        if limit is None or load.transactions < limit:
            return
        log.warning(
            "%s: max_prepared_transactions is %d, and this sink may hold about %d prepared "
            "transactions between two checkpoints (%d tasks per batch x %d batches). Set "
            "max_prepared_transactions to at least %d in postgresql.conf (a server restart; "
            "other jobs on the server count too), or checkpoint more often. Meanwhile the "
            "job takes a checkpoint early when the server comes close to the limit",
            self.where,
            limit,
            load.transactions,
            load.tasks_per_batch,
            load.batches_per_checkpoint,
            2 * load.transactions,
        )

    def pressure(self, batch: Sequence[Committable]) -> str | None:
        """A reason to checkpoint now when the server's prepared transactions
        (all databases, all jobs) leave less room than two more batches like
        this one; None otherwise (also when the server cannot be asked)."""
        limit = self.limit()
        if not batch or limit is None:
            return None
        try:
            held = self.held()
        except psycopg.OperationalError:
            return None  # the commit will say what is wrong with the server
        self.last_seen = (held, limit)
        if held + 2 * len(batch) <= limit:
            return None
        return (
            f"{self.where}: {held} of max_prepared_transactions={limit} are prepared "
            f"and the last batch prepared {len(batch)}"
        )

    def held(self) -> int:
        """How many transactions the server holds prepared (every database and
        job), over a connection kept from one batch to the next: the check runs
        in every batch's barrier, where a new connection would cost more than
        the query. A connection that fails is dropped; the next check opens one."""
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed:
                conn = self._conn = self.connect("twophase-capacity")
            try:
                row = conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()
            except psycopg.Error:
                self._conn = None
                with contextlib.suppress(Exception):
                    conn.close()
                raise
            return int(row[0]) if row else 0

    def close(self) -> None:
        """Close the kept connection (the next check opens another)."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
