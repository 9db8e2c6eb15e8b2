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

Where a job's ledger is: :func:`open_ledger` takes the location (the job's
``ledger=``: None, the local directory ``STATE_DIR/ledger``; a local
directory DIR: ``DIR/ledger``; a ``postgresql://`` URI: that database) and the
state_dir or its state store (:mod:`lifecycle.state.store`). A state_dir that
is a URI holds no file ledger (it needs ``fsync`` and ``flock``): its ledger
is, by default, the store ledger (:class:`StoreLedger`, in
:mod:`lifecycle.state.store_ledger`: one object per change, each created
only if its name is free, on HDFS or S3), or in PostgreSQL, or in a local
directory named by ``ledger=``. A state_dir whose ledger is in PostgreSQL
holds the URI without its password in ``STATE_DIR/ledger.location``, written
and read through the state store, which is how :func:`read_ledger`,
:func:`is_locked` and the ``twophase`` commands find it (:func:`locate`); a
store ledger is found in the state_dir itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from lifecycle import heartbeat
from lifecycle.state import file_ledger
from lifecycle.state.file_ledger import FileLedger
from lifecycle.state.files import atomic_write
from lifecycle.state.frames import CorruptLedgerError
from lifecycle.state.model import DIGEST_WINDOW, FORMAT, HISTORY, KINDS, Checkpoint, Pending
from lifecycle.state.pg_ledger import PostgresLedger, pg_is_locked, read_pg_ledger
from lifecycle.state.pg_location import PgLocation, is_pg_location
from lifecycle.state.protocol import Ledger, LedgerLockedError, LedgerLostError
from lifecycle.state.snapshot import generations, journal_generations
from lifecycle.state.store import LocalStore, open_store
from lifecycle.state.store_interface import StateStore
from lifecycle.state.store_ledger import StoreLedger, holds_ledger, read_store_ledger
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
    "StoreLedger",
    "atomic_write",
    "check_location",
    "is_locked",
    "ledger_directory",
    "locate",
    "new_state_advice",
    "open_ledger",
    "read_ledger",
    "stored_location",
]

LOCATION_FILE = "ledger.location"
"""In a state_dir whose ledger is in PostgreSQL: its URI, without the password
(in the state store, so a URI state_dir holds it too)."""

StateDir = str | os.PathLike[str]
State = StateDir | StateStore
"""a state_dir, or its store when the caller has opened it (a job: in its SparkSession)"""
Location = str | os.PathLike[str] | None
"""a job's ``ledger=``: None, a PostgreSQL URI or a local directory"""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_CONNINFO = re.compile(r"(^|\s)(host|hostaddr|dbname|user|password|port|service)\s*=")


def check_location(location: Location) -> str | Path | None:
    """``location`` as a ledger location: None (the file ledger in
    ``STATE_DIR/ledger``), a PostgreSQL URI (a str, checked) or a local directory
    (a Path: the file ledger in ``DIR/ledger``). Raises ConfigError for anything
    else (another scheme, a libpq keyword string), without showing a password."""
    if location is None:
        return None
    text = os.fspath(location)
    if isinstance(location, str) and is_pg_location(text):
        PgLocation.parse(text)
        return text
    scheme = _SCHEME.match(text)
    if scheme is not None and not isinstance(location, str):
        raise ConfigError(
            f"ledger={text!r} looks like a URI but was given as a path object (which "
            "collapses '//'): pass the URI as a str"
        )
    if scheme is not None or _CONNINFO.search(text):
        what = f"a {scheme.group(1)}: URI" if scheme else "a libpq keyword string"
        raise ConfigError(
            f"ledger= is {what}: a ledger location is a PostgreSQL URI "
            "(postgresql://user@host/dbname), a local directory (the file ledger in its "
            "ledger/), or None (STATE_DIR/ledger)"
        )
    return Path(text)


def _store(state: State) -> StateStore:
    """The store of ``state`` (a URI without a SparkSession: a JVM of its own)."""
    return state if isinstance(state, StateStore) else open_store(state, None)


def stored_location(state: State) -> str | None:
    """The PostgreSQL ledger URI recorded in ``state`` (None: its ledger is a file
    ledger), read through the state store."""
    data = _store(state).read(LOCATION_FILE)
    text = data.decode().strip() if data is not None else ""
    return text or None


def ledger_directory(store: StateStore, location: str | Path | None) -> Path | None:
    """The local directory of the job's file ledger: ``DIR/ledger`` for a
    ``location`` DIR, else ``STATE_DIR/ledger`` of a local state_dir; None for
    a URI state_dir, whose ledger is a :class:`StoreLedger` in it."""
    if isinstance(location, Path):
        return location / "ledger"
    if location is not None:
        raise ValueError(f"not the location of a file ledger: {location}")
    if isinstance(store, LocalStore):
        return store.path("ledger")
    return None


def _check_store_ledger(store: StateStore) -> None:
    """Refuse a URI state_dir whose store has no atomic create (the store ledger's need)."""
    if not store.creates_atomically:
        raise ConfigError(
            f"state_dir {store.uri()!r}: its ledger needs a create-if-absent that is atomic, "
            "which this file system lacks here (hdfs://, s3a://, viewfs:// and file:// have "
            'one): pass ledger="postgresql://..." (a ledger that a driver restarting on '
            "another host reaches) or ledger=LOCAL_DIR (a file ledger on this host only)"
        )


def _holds_file_ledger(directory: Path) -> bool:
    return bool(
        generations(directory) or journal_generations(directory) or (directory / LEGACY).exists()
    )


def new_state_advice(location: Location) -> str:
    """How to give a job a new state (after a state was lost or reset)."""
    where = check_location(location)
    if where is None:
        return "a new state_dir"
    if isinstance(where, Path):
        return (
            f"a new state_dir together with a new ledger directory (ledger=) or the old "
            f"ledger removed ({where / 'ledger'})"
        )
    schema = PgLocation.parse(where).schema
    return (
        f"a new state_dir together with another ledger schema (?schema=NAME in the ledger "
        f"URI) or the old ledger dropped (DELETE FROM {schema}.ledgers WHERE job = ...)"
    )


def open_ledger(location: Location, state: State, job: str, **opts: Any) -> Ledger:
    """Open (creating if needed) the ledger of ``job`` whose state is ``state`` (a
    state_dir, or its store).

    ``location`` None: the embedded ledger in ``STATE_DIR/ledger`` (a local
    state_dir only). A local directory: the embedded ledger in ``DIR/ledger``.
    A ``postgresql://`` (or ``postgres://``) URI: a :class:`PostgresLedger`,
    whose URI without the password is then recorded in
    ``STATE_DIR/ledger.location``, through the state store (so on a URI
    state_dir too). A state_dir that never used the PostgreSQL ledger is a new
    state: a ledger of the job that already began a run is refused there (one
    per job name and schema). A state_dir is never switched between a file and
    a PostgreSQL ledger (the other's state would be ignored): that is refused
    too. ``opts``: the backend's options (``history``, ``digest_window``; the
    file ledger's ``compact_bytes``)."""
    where = check_location(location)
    store = _store(state)
    stored = stored_location(store)
    local = store.path("ledger") if isinstance(store, LocalStore) else None
    in_store = local is None and holds_ledger(store)
    if where is not None and in_store:
        raise ConfigError(
            f"state_dir {store.uri()} holds its own ledger ({store.uri('ledger')}); a ledger "
            "elsewhere would ignore its state: run without ledger=, or use a new state_dir"
        )
    if not isinstance(where, str):
        if stored is not None:
            raise ConfigError(
                f"the ledger of state_dir {store.uri()} is in PostgreSQL ({stored}, recorded "
                f"in {store.uri(LOCATION_FILE)}): pass Job(ledger=...) with that URI"
            )
        directory = ledger_directory(store, where)
        if directory is None:
            _check_store_ledger(store)
            if not in_store and (store.exists(heartbeat.PATH) or store.list("pipelines")):
                raise ConfigError(
                    f"state_dir {store.uri()} has run before (a heartbeat, Spark checkpoints) "
                    "but holds no ledger: its ledger is where the job's ledger= put it; pass "
                    "that (a directory, or the PostgreSQL URI). A new ledger here would "
                    "ignore what it recorded; to start over, use a new state_dir"
                )
            live = heartbeat.judge(heartbeat.read(store))
            if live.alive:
                raise LedgerLockedError(
                    f"the ledger in {store.uri('ledger')} is in use: its job is running "
                    f"({live.why}). A driver that is gone is taken over once its heartbeat "
                    f"lapses ({heartbeat.LAPSE_FACTOR * heartbeat.EVERY_S:.0f} s)"
                )
            return StoreLedger(store, job, **opts)
        moved = local is not None and directory.resolve() != local.resolve()
        if moved and local is not None and _holds_file_ledger(local):
            raise ConfigError(
                f"state_dir {store.uri()} holds a local ledger ({local}); a ledger in "
                f"{directory} would ignore its state: run without ledger=, or use a new "
                "state_dir"
            )
        return FileLedger(directory, job, **opts)
    if local is not None and _holds_file_ledger(local):
        raise ConfigError(
            f"state_dir {store.uri()} holds a local ledger ({local}); a PostgreSQL "
            "ledger would ignore its state: run without ledger=, or use a new state_dir"
        )
    ledger = PostgresLedger(where, job, new_state=stored is None, **opts)
    try:
        record = ledger.location.display()
        if stored != record:
            store.write_atomic(LOCATION_FILE, f"{record}\n".encode())
    except BaseException:
        ledger.close()
        raise
    return ledger


def locate(state: State | None, location: Location | StateStore = None) -> str | Path | StateStore:
    """Where the ledger of ``state`` (or at ``location``) is: a PostgreSQL URI (with
    the job of the state's record when it names none), the directory whose
    ``ledger/`` holds a file ledger, or the store of a URI state_dir that holds
    a :class:`StoreLedger`. ``location`` (the job's ``ledger=``) wins; else the
    state's ``ledger.location`` (read through the store: a URI state_dir
    starts a JVM then), else the state_dir itself. Raises ConfigError for a URI
    state_dir that records no PostgreSQL ledger and holds none. A ``location``
    that is a store (what this returned before) is that store's ledger."""
    if isinstance(location, StateStore):
        return location
    where = check_location(location)
    if isinstance(where, Path):
        return where
    if where is not None:
        if state is None or PgLocation.parse(where).job is not None:
            return where
        stored = stored_location(state)
        job = PgLocation.parse(stored).job if stored is not None else None
        return where if job is None else where + ("&" if "?" in where else "?") + f"job={job}"
    if state is None:
        raise ValueError("needs a state_dir or a ledger location")
    store = _store(state)
    stored = stored_location(store)
    if stored is not None:
        return stored
    if not isinstance(store, LocalStore):
        if holds_ledger(store):
            return store
        raise ConfigError(
            f"state_dir {store.uri()} holds no ledger and records no PostgreSQL ledger "
            f"({LOCATION_FILE}): its ledger is where the job's ledger= put it; pass it "
            "(--ledger DIR, or the PostgreSQL URI)"
        )
    return store.root


def read_ledger(
    state_dir: State | None = None, location: Location | StateStore = None
) -> dict[str, Any] | None:
    """The ledger document of ``state_dir`` (or of the ledger at ``location``: a
    PostgreSQL URI or a file ledger's directory, see :func:`locate`) for
    display, without taking the lock (the job may be running): keys ``format``,
    ``job``, ``incarnation``, ``run``, ``next_checkpoint``, ``pending``
    (pipeline -> str(batch) -> sink -> committables), ``decided``,
    ``history``, ``finished``, ``totals``, ``abandoned``, ``sinks``
    (``pipeline/sink_id`` -> recorded settings) and the rest of
    ``LedgerState.to_doc``; None when there is no ledger."""
    where = locate(state_dir, location)
    if isinstance(where, StateStore):
        return read_store_ledger(where)
    if isinstance(where, str):
        return read_pg_ledger(where)
    return file_ledger.read_ledger(where)


def is_locked(state_dir: State | None = None, location: Location | StateStore = None) -> bool:
    """Whether a job currently holds the ledger of ``state_dir`` (or at
    ``location``). A store ledger has no lock: its job's heartbeat answers."""
    where = locate(state_dir, location)
    if isinstance(where, StateStore):
        return heartbeat.judge(heartbeat.read(where)).alive
    if isinstance(where, str):
        return pg_is_locked(where)
    return file_ledger.is_locked(where)
