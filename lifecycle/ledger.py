"""The ledger: durable, crash-atomic record of committables and checkpoints.

What it holds:

* ``incarnation``: a random id drawn when the ledger is created, never changed;
* ``run``: incremented at every start (part of transaction names, so a zombie
  task of an earlier run can never collide with a task of this run);
* ``pending``: committables of every pre-committed batch not yet committed,
  by pipeline, batch and sink, with each batch's offsets digest;
* ``decided``: the checkpoint whose commit is under way, if any. Once written,
  the decision is final: a restart finishes it before anything else;
* ``history``: the last checkpoints that committed (id, kind, cut per pipeline,
  finished pipelines, rows per sink, times), and ``finished`` pipelines;
* per pipeline, the highest batch Spark reported complete, the highest batch
  committed, and the digests of the last committed batches;
* ``totals``: rows committed per sink over the job's life; ``abandoned``:
  every abandonment recorded (``twophase abandon``), kept for the record;
* ``sinks``: every sink's non-secret settings, so that the ``twophase``
  commands can rebuild the sinks without the job's code (secrets come from the
  environment, see :mod:`sinks.settings`).

The embedded ledger (:class:`FileLedger`, in :mod:`lifecycle.state.file_ledger`)
is a snapshot and an append-only journal: each change appends one
self-checking record and fsyncs it before it takes effect, so a change costs
the same however many committables are pending, and after a crash at any
instant the ledger holds every change that returned. The journal is compacted
into a new snapshot as it grows; committed batches leave ``pending`` and the
history is trimmed, so the ledger stays small however long the job runs. A
lock file keeps a second job from opening the same ledger.

The PostgreSQL ledger (:class:`PostgresLedger`, in
:mod:`lifecycle.state.pg_ledger`) holds the same state as rows (a row per job,
per pending batch, per checkpoint, ...), each change one transaction of the
rows it touches; an advisory lock and a fencing token keep it to one driver.
It is for a driver that can restart on another machine:
``Job(..., ledger="postgresql://...")``. Both implement :class:`Ledger`.

Where a job's ledger is: :func:`open_ledger` takes the location (None: the
local directory ``STATE_DIR/ledger``; a ``postgresql://`` URI: that
database) and the state_dir. A state_dir whose ledger is in PostgreSQL holds
the URI without its password in ``STATE_DIR/ledger.location``, which is how
:func:`read_ledger`, :func:`is_locked` and the ``twophase`` commands find it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lifecycle.state import file_ledger
from lifecycle.state.file_ledger import FileLedger
from lifecycle.state.files import atomic_write
from lifecycle.state.frames import CorruptLedgerError
from lifecycle.state.model import DIGEST_WINDOW, FORMAT, HISTORY, KINDS, Checkpoint, Pending
from lifecycle.state.pg_ledger import PostgresLedger, pg_is_locked, read_pg_ledger
from lifecycle.state.pg_location import PgLocation
from lifecycle.state.protocol import Ledger, LedgerLockedError, LedgerLostError
from lifecycle.state.snapshot import generations, journal_generations
from lifecycle.state.upgrade import LEGACY
from sinks.errors import ConfigError

__all__ = [
    "DIGEST_WINDOW",
    "FORMAT",
    "HISTORY",
    "KINDS",
    "LOCATION_FILE",
    "Checkpoint",
    "CorruptLedgerError",
    "FileLedger",
    "Ledger",
    "LedgerLockedError",
    "LedgerLostError",
    "Pending",
    "PostgresLedger",
    "atomic_write",
    "check_location",
    "is_locked",
    "new_state_advice",
    "open_ledger",
    "read_ledger",
    "stored_location",
]

LOCATION_FILE = "ledger.location"
"""In a state_dir whose ledger is in PostgreSQL: its URI, without the password."""

StateDir = str | os.PathLike[str]


def check_location(location: str | None) -> str | None:
    """``location`` when it is a valid ledger location (None or a PostgreSQL URI);
    raises ConfigError otherwise."""
    if location is not None:
        PgLocation.parse(location)
    return location


def stored_location(state_dir: StateDir) -> str | None:
    """The PostgreSQL ledger URI recorded in ``state_dir`` (None: its ledger is local)."""
    try:
        text = (Path(state_dir) / LOCATION_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def _holds_file_ledger(directory: Path) -> bool:
    return bool(
        generations(directory) or journal_generations(directory) or (directory / LEGACY).exists()
    )


def new_state_advice(location: str | None) -> str:
    """How to give a job a new state (after a state was lost or reset)."""
    if location is None:
        return "a new state_dir"
    schema = PgLocation.parse(location).schema
    return (
        f"a new state_dir together with another ledger schema (?schema=NAME in the ledger "
        f"URI) or the old ledger dropped (DELETE FROM {schema}.ledgers WHERE job = ...)"
    )


def open_ledger(location: str | None, state_dir: StateDir, job: str, **opts: Any) -> Ledger:
    """Open (creating if needed) the ledger of ``job`` whose state is ``state_dir``.

    ``location`` None: the embedded ledger in ``state_dir/ledger``. A
    ``postgresql://`` (or ``postgres://``) URI: a :class:`PostgresLedger`, whose
    URI without the password is then recorded in ``state_dir/ledger.location``.
    A state_dir that never used the PostgreSQL ledger is a new state: a ledger
    of the job that already began a run is refused there (one per job name and
    schema). A state_dir is never switched between a local and a PostgreSQL
    ledger (the other's state would be ignored): that is refused too.
    ``opts``: the backend's options (``history``, ``digest_window``; the file
    ledger's ``compact_bytes``)."""
    state = Path(state_dir)
    stored = stored_location(state)
    if location is None:
        if stored is not None:
            raise ConfigError(
                f"the ledger of state_dir {state} is in PostgreSQL ({stored}, recorded in "
                f"{state / LOCATION_FILE}): pass Job(ledger=...) with that URI"
            )
        return FileLedger(state / "ledger", job, **opts)
    if _holds_file_ledger(state / "ledger"):
        raise ConfigError(
            f"state_dir {state} holds a local ledger ({state / 'ledger'}); a PostgreSQL "
            "ledger would ignore its state: run without ledger=, or use a new state_dir"
        )
    ledger = PostgresLedger(location, job, new_state=stored is None, **opts)
    try:
        record = ledger.location.display()
        if stored != record:
            state.mkdir(parents=True, exist_ok=True)
            atomic_write(state / LOCATION_FILE, f"{record}\n".encode())
    except BaseException:
        ledger.close()
        raise
    return ledger


def _pg_location(state_dir: StateDir | None, location: str | None) -> str | None:
    """The PostgreSQL ledger to read: ``location`` (its job, when it names none,
    from the state_dir's record), else the state_dir's record; None: a file ledger."""
    stored = stored_location(state_dir) if state_dir is not None else None
    if location is None:
        return stored
    where = PgLocation.parse(location)
    if where.job is None and stored is not None:
        job = PgLocation.parse(stored).job
        if job is not None:
            return location + ("&" if "?" in location else "?") + f"job={job}"
    return location


def read_ledger(
    state_dir: StateDir | None = None, location: str | None = None
) -> dict[str, Any] | None:
    """The ledger document of ``state_dir`` (or of the PostgreSQL ledger at
    ``location``) for display, without taking the lock (the job may be
    running): keys ``format``, ``job``, ``incarnation``, ``run``,
    ``next_checkpoint``, ``pending`` (pipeline -> str(batch) -> sink ->
    committables), ``decided``, ``history``, ``finished``, ``totals``,
    ``abandoned``, ``sinks`` (``pipeline/sink_id`` -> recorded settings) and
    the rest of ``LedgerState.to_doc``; None when there is no ledger."""
    where = _pg_location(state_dir, location)
    if where is not None:
        return read_pg_ledger(where)
    if state_dir is None:
        raise ValueError("read_ledger needs a state_dir or a PostgreSQL location")
    return file_ledger.read_ledger(state_dir)


def is_locked(state_dir: StateDir | None = None, location: str | None = None) -> bool:
    """Whether a job currently holds the ledger of ``state_dir`` (or at ``location``)."""
    where = _pg_location(state_dir, location)
    if where is not None:
        return pg_is_locked(where)
    if state_dir is None:
        raise ValueError("is_locked needs a state_dir or a PostgreSQL location")
    return file_ledger.is_locked(state_dir)
