"""The ledger backends behind one test face (the ``ledger_factory`` fixture in
``conftest.py``): the file ledger in a state_dir, the PostgreSQL ledger in a
fresh database of the test server (``pg_dsn``), found through the same
state_dir, and the store ledger (a URI state_dir's) on a local directory
(its logic; the stores' own creates are ``test_store_ledger.py``'s)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from lifecycle.ledger import Ledger, is_locked, open_ledger, read_ledger
from lifecycle.state.pg_location import PgLocation, lock_key, lock_tag
from lifecycle.state.store import LocalStore
from lifecycle.state.store_ledger import StoreLedger, read_store_ledger


def pg_uri(dsn: str, **params: str) -> str:
    """A ``postgresql://`` URI for a conninfo string (the tests' ``pg_dsn``)."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    user = f"{info['user']}@" if info.get("user") else ""
    query = "&".join(f"{k}={v}" for k, v in params.items())
    uri = f"postgresql://{user}{info['host']}:{info['port']}/{info['dbname']}"
    return f"{uri}?{query}" if query else uri


@dataclass
class LedgerBackend:
    """One backend of the ledger, for the tests: ``open`` it, ``read`` its document."""

    kind: str  # "file", "postgres" or "store"
    state_dir: Path
    location: str | None
    """the PostgreSQL URI (None: the file ledger)"""
    opened: list[Ledger] = field(default_factory=list)

    def open(self, job: str = "j", **opts: Any) -> Ledger:
        """Open the ledger of ``job`` (``compact_bytes`` applies to the file ledger only)."""
        if self.kind == "postgres":
            opts.pop("compact_bytes", None)
        if self.kind == "store":
            store = StoreLedger(LocalStore(self.state_dir), job, **opts)
            self.opened.append(store)
            return store
        ledger = open_ledger(self.location, self.state_dir, job, **opts)
        self.opened.append(ledger)
        return ledger

    def read(self) -> dict[str, Any]:
        if self.kind == "store":
            doc = read_store_ledger(LocalStore(self.state_dir))
        else:
            doc = read_ledger(self.state_dir)
        assert doc is not None
        return doc

    @property
    def locks(self) -> bool:
        """Whether a second opener is refused (the store ledger has no lock: a
        second opener is fenced at its first change instead)."""
        return self.kind != "store"

    def locked(self) -> bool:
        return is_locked(self.state_dir)

    def other(self, name: str) -> LedgerBackend:
        """An independent ledger of the same kind (another state_dir; another schema)."""
        location = None
        if self.location is not None:
            location = f"{self.location}{'&' if '?' in self.location else '?'}schema={name}"
        return LedgerBackend(self.kind, self.state_dir.with_name(name), location, self.opened)

    def footprint(self, job: str = "j") -> object:
        """Changes whenever a change is written: the journal's size (file), the
        transaction that last locked or changed the job's row (PostgreSQL: every
        write transaction locks it first)."""
        if self.kind == "store":
            return sum(f.stat().st_size for f in (self.state_dir / "ledger").glob("journal.*/*"))
        if self.location is None:
            return sum(f.stat().st_size for f in (self.state_dir / "ledger").glob("journal.*"))
        where = PgLocation.parse(self.location)
        table = sql.Identifier(where.schema, "ledgers")
        with psycopg.connect(where.conninfo()) as conn:
            query = sql.SQL("SELECT xmin::text, xmax::text FROM {} WHERE job = %s").format(table)
            return conn.execute(query, (job,)).fetchone()

    def close_all(self) -> None:
        for ledger in self.opened:
            with contextlib.suppress(Exception):
                ledger.close()


def lock_holder(dsn: str, location: str, job: str = "j") -> int | None:
    """The pid of the session holding the advisory lock of ``job``'s ledger."""
    classid, objid = lock_tag(lock_key(PgLocation.parse(location).schema, job))
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid::bigint = %s "
            "AND objid::bigint = %s AND objsubid = 1 AND granted",
            (classid, objid),
        ).fetchone()
    return row[0] if row else None


def terminate(dsn: str, pid: int) -> None:
    """Terminate a backend (as a lost connection or a killed session would end)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
