"""An exactly-once sink for a table of any SQL database reached through a plain
DB-API 2.0 driver, for targets without prepared transactions: the example of
"Write your own sink" (``docs/sinks/write-your-own.md``), written against the
public protocol alone (:mod:`sinks.base`, :mod:`sinks.committer`, :mod:`sinks.capabilities`).

Beside the target ``T`` (which must exist), ``preflight`` creates the sink's tables:
``T_staged`` (the written columns and ``txn``: each task inserts its rows there
under its transaction name and commits them at ``prepare``, durable and
invisible to readers of ``T``); ``T_commits`` (a marker per committed
transaction: txn, scope, owner, batch, n_rows); ``T_progress`` (per scope
``job/pipeline/sink``: the incarnation that owns it, the highest batch it
committed, the one a start-over took it from).

Recovery rules (:mod:`lifecycle.coordinator`), and how this sink meets them:

1, 2. Decided or Spark-completed work is committed, again after any crash:
   ``commit`` is ONE database transaction per call (claim checked, staged rows
   moved, markers written, progress raised, staged rows deleted) and skips a
   transaction whose marker exists, so a retry from any point commits nothing twice.
3. ``abort`` deletes staged rows (none left: nothing to do).
4. A task that dies before ``prepare`` leaves nothing (the database rolls its
   transaction back); work prepared but never registered stays staged under its
   name until ``sweep`` deletes it, once the coordinator calls it an orphan.
5. ``commit`` counts each transaction's staged rows first: when a count is not
   what ``prepare`` wrote, it commits nothing and raises ``TransactionLostError``
   (``classify`` says LOST). ``REPAYS`` work commits though the progress holds its batch.

Claims: every commit first updates the scope's progress row where ``owner`` is
its incarnation, which checks the claim and locks the row until the commit ends
(a takeover waits); work of a batch at or below the progress that is not
``REPAYS`` is a replay: its staged rows are deleted, never committed.

The ``twophase`` commands rebuild it from its recorded settings
(:meth:`DbApiSink.from_settings`; its DSN, never recorded, from
``TWOPHASE_<SINK>_DSN``) when it was made with :class:`Connect`.

Limits: plain lower-case table and column names (never quoted); a driver
``paramstyle`` of ``qmark``, ``format`` or ``pyformat``. Tested on
PostgreSQL (psycopg) and SQLite.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow as pa

from sinks.audit import CheckpointEvidence, Finding, Verdict
from sinks.base import Sink, SinkWriter, WriteContext
from sinks.capabilities import Audits, RetiresEvidence
from sinks.committer import REPAYS, Committable, Committer, LingeringTxn, OrphanTest, Outcome
from sinks.errors import REWRITE_ADVICE, ConfigError, PreflightError, TransactionLostError
from sinks.naming import TxnName, check_id, scope_prefixes
from sinks.progress import SinkProgress, conflict, may_claim
from sinks.scope import ClaimedScopes, JobScope
from sinks.settings import env_name

log = logging.getLogger("examples.dbapi_sink")
T = TypeVar("T")
_NAME = re.compile(r"[a-z_][a-z0-9_]*")
TABLES = {
    "_staged": "CREATE TABLE {t}_staged AS SELECT {cols} FROM {t} WHERE 1 = 0;"
    "ALTER TABLE {t}_staged ADD COLUMN txn VARCHAR(255);"
    "CREATE INDEX {n}_staged_txn ON {t}_staged (txn)",
    "_commits": "CREATE TABLE {t}_commits (txn VARCHAR(255) PRIMARY KEY, scope VARCHAR(130) "
    "NOT NULL, owner VARCHAR(12) NOT NULL, batch BIGINT NOT NULL, n_rows BIGINT NOT NULL)",
    "_progress": "CREATE TABLE {t}_progress (scope VARCHAR(130) PRIMARY KEY, owner VARCHAR(12) "
    "NOT NULL, batch BIGINT NOT NULL, previous VARCHAR(12), version BIGINT NOT NULL)",
}
"""the sink's tables (``version``: a claim check changes the row, so that every
driver's ``rowcount`` counts it)"""


@dataclass(frozen=True)
class Connect:
    """A picklable connection factory: ``module.connect(dsn)`` of a DB-API driver."""

    module: str
    """the driver's module: ``psycopg``, ``sqlite3``, ..."""
    dsn: str = field(repr=False)  # it may hold a password: never in messages

    def __call__(self) -> Any:
        return importlib.import_module(self.module).connect(self.dsn)

    @property
    def paramstyle(self) -> str:
        """The driver's DB-API ``paramstyle``."""
        return str(importlib.import_module(self.module).paramstyle)


def columns(conn: Any, table: str) -> list[str] | None:
    """The column names of ``table``; None (and a rollback) when it is missing."""
    cur = conn.cursor()
    try:
        cur.execute(f"SELECT * FROM {table} WHERE 1 = 0")
    except Exception:
        conn.rollback()
        return None
    return [d[0] for d in cur.description]


class DbApiSink(Sink):
    """Appends to ``table`` through ``connect``, a picklable factory of DB-API
    connections (:class:`Connect`, or a module-level function); module docstring."""

    kind = "dbapi"
    speculation_safe = True  # every attempt stages under its own name; sweeps end the rest
    _driver_only = ("_committer",)

    def __init__(
        self,
        connect: Callable[[], Any],
        table: str,
        *,
        sink_id: str | None = None,
        paramstyle: str | None = None,
        commit_timeout: float = 120.0,
    ) -> None:
        if not all(_NAME.fullmatch(p) for p in table.split(".", 1)):
            raise ConfigError(f"table {table!r}: use a plain lower-case name, or schema.name")
        self.connect, self.table, self.commit_timeout = connect, table, commit_timeout
        self._sink_id = check_id("sink_id", sink_id or "dbapi-" + table.replace(".", "-"))
        self.paramstyle = paramstyle or getattr(connect, "paramstyle", "format")
        if self.paramstyle not in ("qmark", "format", "pyformat"):
            raise ConfigError(f"paramstyle {self.paramstyle!r}: qmark, format or pyformat only")
        self._init_driver_state()

    def _init_driver_state(self) -> None:
        self._committer = DbApiCommitter(self)

    @property
    def sink_id(self) -> str:
        """``dbapi-<table>`` unless given: part of every transaction name."""
        return self._sink_id

    def describe(self) -> str:
        """The target, for messages (and the coordinator's lanes and claim order)."""
        return f"DB-API table {self.table}"

    def sql(self, text: str) -> str:
        """``text`` with ``{t}`` the table (``{n}`` without its schema) and
        ``?`` in the driver's paramstyle."""
        text = text.replace("{t}", self.table).replace("{n}", self.table.rpartition(".")[2])
        return text if self.paramstyle == "qmark" else text.replace("?", "%s")

    def preflight(self, schema: pa.Schema) -> None:
        """Refuse columns this sink cannot write; create the sink's tables."""
        with contextlib.closing(self.connect()) as conn:
            have = columns(conn, self.table)
            bad = [n for n in schema.names if not _NAME.fullmatch(n) or n not in (have or [])]
            if have is None or bad:
                raise PreflightError(
                    f"{self.describe()} is missing, or has no column {bad} (plain lower-case "
                    "names only): create the table with every column of the DataFrame"
                )
            for suffix, ddl in TABLES.items():
                if columns(conn, self.table + suffix) is None:
                    for statement in ddl.replace("{cols}", ", ".join(schema.names)).split(";"):
                        conn.cursor().execute(self.sql(statement))
                    conn.commit()
            if set(schema.names) - set(columns(conn, self.table + "_staged") or []):
                raise PreflightError(f"{self.table}_staged lacks columns: drop it (while empty)")

    def open_writer(self, ctx: WriteContext, schema: pa.Schema) -> SinkWriter:
        """A task's writer, staging under the task attempt's transaction name."""
        return DbApiWriter(self, str(ctx.txn_name()), schema.names)

    def committer(self) -> DbApiCommitter:
        """The one committer of this sink (driver-only: never pickled)."""
        return self._committer

    def settings(self) -> dict[str, Any]:
        """What the ledger records to build the sink again for the ``twophase``
        commands (:meth:`from_settings`): never the DSN, which may hold a password."""
        if not isinstance(self.connect, Connect):
            return super().settings()  # a function of the job's: not rebuilt
        return {
            **super().settings(),
            "driver": self.connect.module,
            "table": self.table,
            "paramstyle": self.paramstyle,
            "commit_timeout": self.commit_timeout,
        }

    @classmethod
    def from_settings(cls, s: Mapping[str, Any], secrets: Mapping[str, str]) -> DbApiSink:
        """The sink of ``settings()``, its DSN from ``TWOPHASE_<SINK>_DSN``."""
        name = env_name(s["sink_id"], "dsn")
        if "driver" not in s or not secrets.get(name):
            raise ConfigError(f"sink {s['sink_id']!r}: set {name} to its DSN to rebuild it")
        return cls(
            Connect(s["driver"], secrets[name]),
            s["table"],
            sink_id=s["sink_id"],
            paramstyle=s["paramstyle"],
            commit_timeout=s["commit_timeout"],
        )


class DbApiWriter(SinkWriter):
    """One task attempt: its rows go to the staged table in one database
    transaction, committed by ``prepare``."""

    def __init__(self, sink: DbApiSink, txn: str, names: list[str]) -> None:
        self.sink, self.txn, self.rows, self.prepared = sink, txn, 0, False
        self.conn: Any = None  # a DB-API connection, opened at the first row
        marks = ", ".join("?" * (len(names) + 1))
        self.insert = sink.sql(
            f"INSERT INTO {{t}}_staged ({', '.join(names)}, txn) VALUES ({marks})"
        )

    def write(self, batch: pa.RecordBatch) -> None:
        """Insert the rows into the staged table, in the task's open transaction."""
        if batch.num_rows:
            self.conn = self.conn or self.sink.connect()
            cols = [c.to_pylist() for c in batch.columns]
            self.conn.cursor().executemany(
                self.insert, [(*r, self.txn) for r in zip(*cols, strict=True)]
            )
            self.rows += batch.num_rows

    def prepare(self) -> Committable | None:
        """Commit the staged rows: durable, invisible in the target."""
        if self.conn is None:
            return None  # nothing written
        self.conn.commit()  # durable; readers of the target see none of it
        self.prepared = True
        return {"txn": self.txn, "rows": self.rows}

    def close(self, failed: bool = False) -> None:
        """Roll back unprepared rows; delete prepared ones when the task ``failed``."""
        if self.conn is None:
            return
        with contextlib.closing(self.conn) as conn:
            if not self.prepared:
                conn.rollback()
            elif failed:  # prepared, but the task failed: its work will never be used
                conn.cursor().execute(
                    self.sink.sql("DELETE FROM {t}_staged WHERE txn = ?"), (self.txn,)
                )
                conn.commit()


class DbApiCommitter(Audits, RetiresEvidence, Committer):
    """The driver side: claims the scopes, commits, aborts and sweeps staged rows."""

    def __init__(self, sink: DbApiSink) -> None:
        self.sink, self.where, self.claims = sink, sink.describe(), ClaimedScopes()

    def _run(self, what: str, work: Callable[[Any], T]) -> T:
        """``work(connection)`` on a new connection, retried on the driver's
        ``OperationalError`` (a lost connection, a deadlock) for ``commit_timeout``."""
        deadline = time.monotonic() + self.sink.commit_timeout
        while True:
            try:
                with contextlib.closing(self.sink.connect()) as conn:
                    return work(conn)
            except Exception as e:
                transient = any(k.__name__ == "OperationalError" for k in type(e).__mro__)
                if not transient or time.monotonic() > deadline:
                    raise
                log.warning("%s of %s failed, retrying: %s", what, self.where, e)
                time.sleep(1.0)

    def _q(self, conn: Any, text: str, *args: Any) -> Any:
        cur = conn.cursor()
        cur.execute(self.sink.sql(text), args)
        return cur

    def _states(self, conn: Any, txns: Iterable[str]) -> tuple[dict[str, int], dict[str, int]]:
        """Of ``txns``: the committed ones (rows of their markers), the staged ones
        (rows staged)."""
        txns = sorted(set(txns))
        if not txns:
            return {}, {}
        marks = ", ".join("?" * len(txns))
        marked = self._q(
            conn, f"SELECT txn, n_rows FROM {{t}}_commits WHERE txn IN ({marks})", *txns
        )
        sql = f"SELECT txn, COUNT(*) FROM {{t}}_staged WHERE txn IN ({marks}) GROUP BY txn"
        return dict(marked.fetchall()), dict(self._q(conn, sql, *txns).fetchall())

    # -- claims and progress -----------------------------------------------------------

    def _read(self, conn: Any, scope: JobScope) -> SinkProgress:
        sql = "SELECT owner, batch, previous FROM {t}_progress WHERE scope = ?"
        row = self._q(conn, sql, scope.key()).fetchone()
        return SinkProgress(row[0], int(row[1]), row[2]) if row else SinkProgress(owner=None)

    def progress(self, scope: JobScope) -> SinkProgress:
        """The scope's progress row (owner None: no row)."""
        return self._run("read of progress", lambda conn: self._read(conn, scope))

    def claim(self, scope: JobScope, *, start_over_from: str | None = None) -> SinkProgress:
        """Insert the scope's progress row, or take it over from ``start_over_from``
        (compare-and-set on the owner read); a claim that loses a race refuses."""
        ours = str(scope.incarnation)

        def claim(conn: Any) -> SinkProgress:
            found = self._read(conn, scope)
            if found.owner != ours and may_claim(found, ours, start_over_from):
                if found.owner is None:
                    sql = "INSERT INTO {t}_progress VALUES (?, ?, -1, NULL, 0)"
                    args: list[Any] = [scope.key(), ours]
                else:  # a start-over: compare-and-set on the owner read
                    sql = "UPDATE {t}_progress SET owner = ?, batch = -1, previous = ?, "
                    sql += "version = version + 1 WHERE scope = ? AND owner = ?"
                    args = [ours, found.owner, scope.key(), found.owner]
                try:
                    self._q(conn, sql, *args)
                    conn.commit()
                except Exception:  # another claim inserted the row first: read it
                    conn.rollback()
                    if self._read(conn, scope).owner is None:
                        raise
                found = self._read(conn, scope)
            if found.owner != ours:
                raise conflict(self.where, scope.key(), found, ours)
            return found

        claimed: SinkProgress = self._run("claim", claim)
        self.claims.remember(scope)
        return claimed

    def _hold(self, conn: Any, scope: JobScope) -> int:
        """Check that ``scope.incarnation`` holds the claim and lock its row
        until the transaction ends; the batch it holds committed."""
        sql = "UPDATE {t}_progress SET version = version + 1 WHERE scope = ? AND owner = ?"
        if self._q(conn, sql, scope.key(), scope.incarnation).rowcount != 1:
            found = self._read(conn, scope)
            if found.owner is None:
                raise PreflightError(f"{self.where}: {scope.key()} was never claimed")
            raise conflict(self.where, scope.key(), found, str(scope.incarnation), at_commit=True)
        return self._read(conn, scope).batch

    # -- commit, classify, abort -------------------------------------------------------

    def commit(self, committables: Sequence[Committable]) -> None:
        """Move the staged rows of ``committables`` into the target: one database
        transaction per call (module docstring, rules 1, 2 and 5)."""
        if committables:
            self._run("commit", lambda conn: self._commit_once(conn, committables))

    def _commit_once(self, conn: Any, committables: Sequence[Committable]) -> None:
        work = {c["txn"]: c for c in committables}
        cols = ", ".join(c for c in columns(conn, self.sink.table + "_staged") or [] if c != "txn")
        marked, staged = self._states(conn, work)
        moves, replays = [], []  # (scope, name, txn, rows) / txn
        for scope, names in self.claims.group(
            TxnName.require(t) for t in work if t not in marked
        ).items():
            held = self._hold(conn, scope)
            for n in names:
                if n.batch_id <= held and not work[str(n)].get(REPAYS):
                    replays.append(str(n))
                else:
                    moves.append((scope, n, str(n), int(work[str(n)]["rows"])))
        lost = [t for _, _, t, rows in moves if staged.get(t) != rows]
        for scope, n, t, rows in moves:
            sql = f"INSERT INTO {{t}} ({cols}) SELECT {cols} FROM {{t}}_staged WHERE txn = ?"
            if lost or self._q(conn, sql, t).rowcount != rows:  # or deleted meanwhile
                conn.rollback()  # nothing of this call commits
                raise TransactionLostError(
                    f"{self.where}: the staged rows of {lost or [t]} are gone or changed "
                    f"without having been committed; nothing was committed. {REWRITE_ADVICE}"
                )
            sql = "INSERT INTO {t}_commits VALUES (?, ?, ?, ?, ?)"
            self._q(conn, sql, t, scope.key(), scope.incarnation, n.batch_id, rows)
            sql = "UPDATE {t}_progress SET batch = ? WHERE scope = ? AND owner = ? AND batch < ?"
            self._q(conn, sql, n.batch_id, scope.key(), scope.incarnation, n.batch_id)
        if replays:
            log.warning("%s: replays of committed batches, deleted: %s", self.where, replays)
        for t in [t for _, _, t, _ in moves] + replays:
            self._q(conn, "DELETE FROM {t}_staged WHERE txn = ?", t)
        conn.commit()

    def classify(self, committables: Sequence[Committable]) -> dict[str, Outcome]:
        """COMMITTED with a marker, PREPARED with every row staged, else LOST."""

        def read(conn: Any) -> dict[str, Outcome]:
            marked, staged = self._states(conn, work)
            return {
                t: Outcome.COMMITTED
                if t in marked
                else Outcome.PREPARED
                if staged.get(t) == int(c["rows"])
                else Outcome.LOST
                for t, c in work.items()
            }

        work = {c["txn"]: c for c in committables}
        return self._run("check", read)

    def _delete(self, conn: Any, txns: Iterable[str]) -> None:
        for t in txns:
            self._q(conn, "DELETE FROM {t}_staged WHERE txn = ?", t)
        conn.commit()

    def abort(self, committables: Sequence[Committable]) -> None:
        """Delete the staged rows of ``committables``."""
        if committables:
            self._run("abort", lambda conn: self._delete(conn, [c["txn"] for c in committables]))

    # -- what is left staged -----------------------------------------------------------

    def _staged(self, conn: Any, prefixes: tuple[str, ...]) -> dict[str, tuple[TxnName, int]]:
        """Staged transactions whose names start with one of ``prefixes``."""
        rows = self._q(conn, "SELECT txn, COUNT(*) FROM {t}_staged GROUP BY txn").fetchall()
        named = ((t, TxnName.parse(t), int(n)) for t, n in rows if t.startswith(prefixes))
        return {t: (name, n) for t, name, n in named if name is not None}

    def lingering(self, job: str, pipeline: str) -> list[LingeringTxn]:
        """Staged transactions of (``job``, ``pipeline``, this sink), every incarnation."""
        prefixes = scope_prefixes(job, pipeline, self.sink.sink_id)
        found = self._run("listing", lambda conn: self._staged(conn, prefixes))
        return [
            LingeringTxn(t, nm, "staged", f"{n} row(s)") for t, (nm, n) in sorted(found.items())
        ]

    def sweep(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        """Delete the staged rows of the orphans under ``scope.own_prefixes()``."""

        def sweep(conn: Any) -> list[str]:
            found = self._staged(conn, scope.own_prefixes())
            orphans = sorted(t for t, (name, _) in found.items() if is_orphan(name))
            self._delete(conn, orphans)
            return orphans

        return self._run("sweep", sweep)

    # -- audits ------------------------------------------------------------------------

    def evidence(self, committable: Committable) -> dict[str, Any]:
        """What the ledger keeps of a commit: its name and rows."""
        return {"txn": committable["txn"], "rows": int(committable["rows"])}

    def audit(self, scope: JobScope, checkpoints: Sequence[CheckpointEvidence]) -> list[Finding]:
        """OK where the transaction's marker holds the rows the ledger says."""
        txns = [str(c["txn"]) for cp in checkpoints for c in cp.committed]
        marked = self._run("audit", lambda conn: self._states(conn, txns)[0])
        return [
            Finding(cp.checkpoint, t, Verdict.OK, "", rows)
            if marked.get(t := str(c["txn"])) == (rows := int(c["rows"]))
            else Finding(cp.checkpoint, t, Verdict.MISMATCH, f"marker: {marked.get(t)} rows", rows)
            for cp in checkpoints
            for c in cp.committed
        ]

    def retire_evidence(self, scope: JobScope, before_batch: int) -> None:
        """Delete this incarnation's markers of batches the ledger no longer audits."""

        def retire(conn: Any) -> None:
            sql = "DELETE FROM {t}_commits WHERE scope = ? AND owner = ? AND batch < ?"
            self._q(conn, sql, scope.key(), scope.incarnation, before_batch)
            conn.commit()

        self._run("retirement of markers", retire)
