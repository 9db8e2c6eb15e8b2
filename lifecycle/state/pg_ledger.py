"""The ledger in PostgreSQL, for a driver that can restart on another machine.

Tables: :mod:`lifecycle.state.pg_schema`; the location URI:
:mod:`lifecycle.state.pg_location`.

**Exclusivity.** Opening takes the session-level advisory lock of (schema,
job) with ``pg_try_advisory_lock`` on a connection kept for the ledger's life
(the *lock session*), and refuses with :class:`LedgerLockedError` when another
session holds it. In the same transaction it increments the job row's
``fencing_token`` and keeps the new value.

**Fencing.** A session lock vanishes silently with its connection, so the
lock alone cannot stop a driver that lost it. Every change is one transaction
on a second connection that first locks the job row (``SELECT ... FOR
UPDATE``) and checks (a) the fencing token is still this ledger's: another
driver that opened the ledger since moved it on, and (b) the advisory lock is
still held (``pg_try_advisory_xact_lock`` fails): if it is free, the lock
session is dead. Either way :class:`LedgerLostError` is raised, nothing is
written, and the ledger refuses every later change: the driver must stop. A
new opener's token increment waits for the row lock of a change in flight,
and it reads the ledger after that change committed; a change that comes
after the increment fails its check.

**Changes and reads.** The state is loaded once, when the ledger opens (in
the transaction that takes the lock), and every read is answered from it.
A change is applied to it inside its transaction and written as the rows it
touches (:func:`lifecycle.state.pg_rows.write_op`); when the transaction
fails after that (the connection lost, or the commit's outcome unknown) the
state in memory may be ahead of the database, so the ledger refuses further
changes until it is reopened. The database holds the state before or after
the change, never a part of it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

import psycopg
from psycopg import sql

from lifecycle.state import pg_access
from lifecycle.state.base import StateLedger
from lifecycle.state.model import (
    DIGEST_WINDOW,
    FORMAT,
    HISTORY,
    READABLE_FORMATS,
    LedgerState,
    Op,
)
from lifecycle.state.pg_location import PgLocation, lock_key, lock_tag
from lifecycle.state.pg_rows import load_doc, write_op
from lifecycle.state.pg_schema import Statements, ensure_schema, has_evidence_column
from lifecycle.state.protocol import LedgerLockedError, LedgerLostError, new_incarnation
from sinks.errors import ConfigError
from sinks.postgres import grants
from sinks.postgres.liveness import dead_peer_options

log = logging.getLogger("lifecycle.ledger")


def connect(where: PgLocation, purpose: str, **kwargs: Any) -> psycopg.Connection:
    """A connection to the ledger's database; a failure names the (password-free) URI."""
    try:
        conninfo = where.conninfo()
        return psycopg.connect(
            conninfo,
            application_name=f"twophase ledger {purpose}",
            **{**dead_peer_options(conninfo), **kwargs},
        )
    except psycopg.OperationalError as e:
        if grants.connect_denied(e):
            raise pg_access.connect_refused(where) from e
        raise ConfigError(f"cannot connect to the ledger at {where.display()}: {e}") from e


def _held_session(where: PgLocation, purpose: str) -> psycopg.Connection:
    """A session kept for the ledger's life (autocommit), exempt from the server's
    ``idle_session_timeout`` (PostgreSQL 14+), which would end it while idle."""
    conn = connect(where, purpose, autocommit=True)
    conn.execute(
        "SELECT set_config('idle_session_timeout', '0', false) "
        "WHERE current_setting('idle_session_timeout', true) IS NOT NULL"
    )
    return conn


class PostgresLedger(StateLedger):
    """The ledger of ``job`` in the PostgreSQL database of ``location`` (a URI, see
    :mod:`lifecycle.state.pg_location`). Thread-safe within one process.

    ``history`` and ``digest_window``: as for the file ledger. ``new_state``:
    the caller starts a new state of the job (its state_dir never used this
    ledger); then a ledger of the job that already began a run is refused (one
    ledger per job name and schema)."""

    def __init__(
        self,
        location: str,
        job: str,
        *,
        history: int = HISTORY,
        digest_window: int = DIGEST_WINDOW,
        new_state: bool = False,
    ) -> None:
        if history < 0 or digest_window < 0:
            raise ValueError("history and digest_window must not be negative")
        super().__init__()
        where = PgLocation.parse(location)
        if where.job is not None and where.job != job:
            raise ConfigError(f"the ledger URI names job {where.job!r}, not {job!r}")
        self.location = where.with_job(job)
        self.schema = where.schema
        self._st = Statements(where.schema)
        self._key = lock_key(where.schema, job)
        self._lock_conn: psycopg.Connection | None = None
        self._writer: psycopg.Connection | None = None
        self._unusable: str | None = None  # why no further change may be made
        self._lost: str | None = None  # why this driver no longer holds the ledger
        self._token = 0  # the fencing token this ledger holds
        try:
            self._lock_conn = _held_session(self.location, "lock")
            pg_access.check(self._lock_conn, self.location)
            if not ensure_schema(self._lock_conn, where.schema):
                self._st = Statements(where.schema, evidence=False)
            doc = self._take(job, history, digest_window, new_state)
            self._state = LedgerState.from_doc(doc)
            self._writer = _held_session(self.location, "writes")
            if (self._state.history_limit, self._state.digest_window) != (history, digest_window):
                self._change({"op": "limits", "history": history, "digests": digest_window})
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"PostgresLedger({self.location.display()!r})"

    def _take(self, job: str, history: int, digest_window: int, new_state: bool) -> dict[str, Any]:
        """Take the lock, move the fencing token on, load the ledger (one transaction)."""
        conn = self._lock_conn
        assert conn is not None
        st = self._st
        with conn.transaction():
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (self._key,)).fetchone()
            if row is None or not row[0]:
                raise LedgerLockedError(
                    f"the ledger of job {job!r} at {self.location.display()} is in use by "
                    "another process: is the job already running with this ledger?"
                )
            found = conn.execute(st.lock_row, (job,)).fetchone()
            if found is None:
                limits = (history, digest_window)
                bumped = conn.execute(st.create, (job, FORMAT, new_incarnation(), *limits))
            else:
                fmt, incarnation, run = found
                if fmt not in READABLE_FORMATS:
                    raise ConfigError(
                        f"the ledger of job {job!r} at {self.location.display()} has the "
                        f"unknown format {fmt!r}"
                    )
                if new_state and run > 0:
                    raise ConfigError(self._second_state(job, incarnation, run))
                if fmt != FORMAT:  # a version before refuses the ledger from now on
                    conn.execute(st.set_format, (FORMAT, job))
                bumped = conn.execute(st.bump_token, (job,))
            self._token = bumped.fetchone()[0]  # type: ignore[index]
            doc = load_doc(conn, st, job)
        assert doc is not None
        log.info(
            "ledger of job %s at %s opened (fencing token %d)",
            job,
            self.location.display(),
            self._token,
        )
        return doc

    def _second_state(self, job: str, incarnation: str, run: int) -> str:
        s = self.schema
        return (
            f"job {job!r} already has a ledger in schema {s!r} of "
            f"{self.location.with_job(job).display()} (incarnation {incarnation}, {run} "
            "run(s)), and this is a new state of the job (a state_dir that never used "
            "this ledger). A job name has one ledger per schema: to resume that state, run "
            f"with its state_dir; for a second, independent state of job {job!r}, pass "
            f"another schema (?schema=NAME in the ledger URI) or drop the old ledger "
            f"(DELETE FROM {s}.ledgers WHERE job = '{job}' deletes all of it)"
        )

    def close(self) -> None:
        """Close both sessions (the lock is released); the ledger cannot change afterwards.

        The lock is released explicitly first: a closed session's backend drops its
        advisory locks only as it exits, after the client has gone, so a ledger
        opened right after the close could still find the lock taken."""
        if self._lock_conn is not None:
            with contextlib.suppress(Exception):
                self._lock_conn.execute("SELECT pg_advisory_unlock(%s)", (self._key,))
        for conn in (self._writer, self._lock_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        self._writer = self._lock_conn = None
        if self._unusable is None:
            self._unusable = "it is closed"

    # -- changes -----------------------------------------------------------------------

    def _writer_conn(self) -> psycopg.Connection:
        if self._writer is None or self._writer.closed or self._writer.broken:
            if self._writer is not None:
                with contextlib.suppress(Exception):
                    self._writer.close()
            self._writer = _held_session(self.location, "writes")
        return self._writer

    def _fence(self, conn: psycopg.Connection) -> None:
        """Inside a write transaction: lock the job row, check the token and the lock."""
        row = conn.execute(self._st.fence, (self._key, self.job)).fetchone()
        where = self.location.display()
        if row is None:
            raise LedgerLostError(
                f"the ledger of job {self.job!r} at {where} was deleted while this driver "
                "held it: this driver must stop"
            )
        token, lock_free = row
        if token != self._token:
            raise LedgerLostError(
                f"the ledger of job {self.job!r} at {where} was taken over by another "
                f"driver (its fencing token is now {token}, this driver's {self._token}): "
                "this driver lost its lock and must stop; nothing more is written through it"
            )
        if lock_free:
            raise LedgerLostError(
                f"the session holding the lock of the ledger of job {self.job!r} at {where} "
                "ended (its connection was lost or terminated): this driver no longer holds "
                "the ledger and must stop; running the job again recovers"
            )

    def _change(self, op: Op) -> None:
        payload = json.dumps(op, separators=(",", ":"))  # TypeError: not JSON
        record: Op = json.loads(payload)  # exactly what a reload gives back
        with self._mutex:
            if self._lost is not None:
                raise LedgerLostError(self._lost)
            if self._unusable is not None:
                raise RuntimeError(f"{self!r} must be reopened: {self._unusable}")
            for attempt in (1, 2):
                conn = self._writer_conn()
                applied = False
                try:
                    with conn.transaction():
                        self._fence(conn)
                        applied = True
                        self._state.apply(record)
                        write_op(conn, self._st, self.job, record, self._state)
                    return
                except LedgerLostError as e:
                    self._lost = str(e)
                    raise
                except BaseException as e:
                    if not applied and attempt == 1 and conn.broken:
                        # the write session was lost (an idle timeout, a restarted proxy)
                        # before this change wrote anything: once more, on a new session
                        log.warning("the ledger's write session was lost (%s); reconnecting", e)
                        continue
                    if applied:
                        self._unusable = f"a change failed in the database ({e!r})"
                        log.error("%r must be reopened: %s", self, self._unusable)
                    raise


def _resolve_job(conn: psycopg.Connection, st: Statements, where: PgLocation) -> str | None:
    """The job ``where`` names, or the only job of its schema (None: no ledger)."""
    if where.job is not None:
        return where.job
    jobs = [j for (j,) in conn.execute(st.jobs)]
    if len(jobs) > 1:
        raise ConfigError(
            f"schema {where.schema!r} of {where.display()} holds the ledgers of jobs {jobs}: "
            "name one with ?job=NAME in the ledger URI"
        )
    return jobs[0] if jobs else None


def _has_tables(conn: psycopg.Connection, st: Statements) -> bool:
    name = sql.Identifier(st.schema, "ledgers").as_string(conn)
    return conn.execute("SELECT to_regclass(%s)", (name,)).fetchone() != (None,)


def read_pg_ledger(location: str) -> dict[str, Any] | None:
    """The document of a PostgreSQL ledger for display, without taking its lock
    (the job may be running): the same keys as the file ledger's
    (:func:`lifecycle.state.file_ledger.read_ledger`), read in one snapshot; None
    when there is no ledger. ``location`` names the job with ``?job=``, unless
    its schema holds only one."""
    where = PgLocation.parse(location)
    st = Statements(where.schema)
    with connect(where, "reader") as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        with conn.transaction():
            if not _has_tables(conn, st):
                return None
            if not has_evidence_column(conn, where.schema):  # a schema of an earlier version
                st = Statements(where.schema, evidence=False)
            job = _resolve_job(conn, st, where)
            doc = load_doc(conn, st, job) if job is not None else None
    return LedgerState.from_doc(doc).to_doc() if doc is not None else None


def pg_is_locked(location: str) -> bool:
    """Whether a process holds the ledger of ``location`` (its advisory lock, in ``pg_locks``)."""
    where = PgLocation.parse(location)
    st = Statements(where.schema)
    with connect(where, "reader", autocommit=True) as conn:
        if where.job is None:
            if not _has_tables(conn, st):
                return False
            job = _resolve_job(conn, st, where)
            if job is None:
                return False
        else:
            job = where.job
        classid, objid = lock_tag(lock_key(where.schema, job))
        row = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database()) AND "
            "classid::bigint = %s AND objid::bigint = %s AND objsubid = 1 AND granted)",
            (classid, objid),
        ).fetchone()
    return bool(row and row[0])
