"""The example sink of "Write your own sink" (``examples/dbapi_sink.py``): a
table of any DB-API database, without prepared transactions.

In-process, on a real PostgreSQL (and once on SQLite): commits are one
transaction and idempotent, replays are refused, a loss is found before
anything commits, two incarnations cannot both hold the claim, a sweep
deletes only its own scope's orphans, audits check the markers. Then the
example job (``examples/dbapi_job.py``) under the kit's ``crash_test``:
SIGKILLed at random instants and at named points of the protocol, then
checked with the kit's verifiers, nothing left staged, and the audit clean.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from examples.dbapi_sink import Connect, DbApiSink
from lifecycle.ledger import read_ledger
from lifecycle.testing import assert_exactly_once_postgres, crash_test
from sinks.audit import CheckpointEvidence, Verdict
from sinks.base import REPAYS, Committable, JobScope, Outcome, WriteContext
from sinks.errors import TransactionLostError
from sinks.progress import IncarnationConflictError
from tests.procs import twophase
from tests.tiers import SLOW

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "dbapi_job.py"
SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64())])
TABLE = "CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, name text, amount float8)"
A, B = "0123456789ab", "ba9876543210"  # two incarnations


def _sink(dsn: str, sink_id: str | None = None) -> DbApiSink:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(TABLE)
    sink = DbApiSink(Connect("psycopg", dsn), "orders", sink_id=sink_id)
    sink.preflight(SCHEMA)
    return sink


def _scope(sink: DbApiSink, incarnation: str = A, pipeline: str = "load") -> JobScope:
    return JobScope("job", pipeline, sink.sink_id, incarnation)


def _prepare(
    sink: DbApiSink, scope: JobScope, batch: int, part: int, ids: list[int], run: int = 1
) -> Committable:
    """What a task of ``batch`` does on an executor: write ``ids``, prepare, close."""
    ctx = WriteContext(scope, run, batch, part, attempt=1000 * run + 10 * batch + part)
    writer = sink.open_writer(ctx, SCHEMA)
    names = [f"name-{i}" for i in ids]
    writer.write(pa.record_batch([ids, names, [i * 0.5 for i in ids]], schema=SCHEMA))
    committable = writer.prepare()
    writer.close()
    assert committable == {"txn": str(ctx.txn_name()), "rows": len(ids)}
    return committable


def _one(dsn: str, sql: str, *args: Any) -> Any:
    with psycopg.connect(dsn) as c:
        row = c.execute(sql, args).fetchone()
        assert row is not None
        return row[0]


def _ids(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as c:
        return [r[0] for r in c.execute("SELECT id FROM orders ORDER BY id").fetchall()]


def _staged(dsn: str) -> int:
    return int(_one(dsn, "SELECT count(*) FROM orders_staged"))


def test_a_commit_is_one_transaction_and_idempotent(pg_dsn: str) -> None:
    sink = _sink(pg_dsn)
    scope = _scope(sink)
    committer = sink.committer()
    committer.claim(scope)
    a, b = _prepare(sink, scope, 0, 0, [0, 1, 2]), _prepare(sink, scope, 0, 1, [3, 4])
    assert _ids(pg_dsn) == [] and _staged(pg_dsn) == 5  # durable, and invisible
    assert set(committer.classify([a, b]).values()) == {Outcome.PREPARED}
    committer.commit([a, b])
    committer.commit([a, b])  # a crash before the ledger recorded it: committed again
    c = _prepare(sink, scope, 1, 0, [5])
    committer.commit([a, b, c])
    assert _ids(pg_dsn) == [0, 1, 2, 3, 4, 5]
    assert _staged(pg_dsn) == 0
    assert set(committer.classify([a, b, c]).values()) == {Outcome.COMMITTED}
    assert committer.progress(scope).held_by(A) and committer.progress(scope).batch == 1


def test_a_replay_of_a_committed_batch_is_deleted_and_a_repayment_commits(pg_dsn: str) -> None:
    sink = _sink(pg_dsn)
    scope = _scope(sink)
    committer = sink.committer()
    committer.claim(scope)
    committer.commit([_prepare(sink, scope, 0, 0, [0, 1]), _prepare(sink, scope, 1, 0, [2])])
    replay = _prepare(sink, scope, 0, 0, [0, 1], run=2)  # batch 0 written again
    committer.commit([replay])
    assert _ids(pg_dsn) == [0, 1, 2] and _staged(pg_dsn) == 0
    repaid = {**_prepare(sink, scope, 1, 1, [3], run=2), REPAYS: True}  # rule 5's rewrite
    committer.commit([repaid])
    committer.commit([repaid])  # once more: its marker, not the progress, says it is done
    assert _ids(pg_dsn) == [0, 1, 2, 3] and committer.progress(scope).batch == 1


@pytest.mark.parametrize("how", ["deleted", "one row gone"])
def test_lost_staged_rows_are_found_before_anything_commits(pg_dsn: str, how: str) -> None:
    sink = _sink(pg_dsn)
    scope = _scope(sink)
    committer = sink.committer()
    committer.claim(scope)
    kept, lost = _prepare(sink, scope, 0, 0, [0, 1]), _prepare(sink, scope, 0, 1, [2, 3])
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        where = "txn = %s" + (" AND id = 3" if how == "one row gone" else "")
        c.execute(f"DELETE FROM orders_staged WHERE {where}", (lost["txn"],))
    verdicts = committer.classify([kept, lost])
    assert verdicts == {kept["txn"]: Outcome.PREPARED, lost["txn"]: Outcome.LOST}
    with pytest.raises(TransactionLostError, match=lost["txn"]):
        committer.commit([kept, lost])
    assert _ids(pg_dsn) == []  # none of the call committed
    assert _one(pg_dsn, "SELECT count(*) FROM orders_commits") == 0
    assert committer.progress(scope).batch == -1
    committer.commit([kept])  # what the coordinator then does with the rest (rule 5)
    assert _ids(pg_dsn) == [0, 1]


def test_two_incarnations_cannot_both_hold_the_claim(pg_dsn: str) -> None:
    old, new = _sink(pg_dsn), _sink(pg_dsn)  # two drivers, each with its state
    first, second = _scope(old, A), _scope(new, B)
    old.committer().claim(first)
    with pytest.raises(IncarnationConflictError, match=A):
        new.committer().claim(second)
    assert new.committer().progress(second).owner == A
    old.committer().commit([_prepare(old, first, 0, 0, [0])])
    late = _prepare(old, first, 1, 0, [1])
    taken = new.committer().claim(second, start_over_from=A)
    assert (taken.owner, taken.previous, taken.batch) == (B, A, -1)
    with pytest.raises(IncarnationConflictError, match="took the claim over"):
        old.committer().commit([late])
    assert _ids(pg_dsn) == [0]
    with pytest.raises(IncarnationConflictError):
        old.committer().claim(first)  # the old state, restored, still refuses
    # the start-over aborts what the old incarnation left (lifecycle.claims)
    assert new.committer().sweep(first, lambda n: n.incarnation == A) == [late["txn"]]
    assert _staged(pg_dsn) == 0


def test_a_sweep_deletes_only_the_orphans_of_its_own_scope(pg_dsn: str) -> None:
    sink, neighbour = _sink(pg_dsn), _sink(pg_dsn, sink_id="neighbour")
    mine = _scope(sink)
    orphan, owned = _prepare(sink, mine, 0, 0, [0]), _prepare(sink, mine, 0, 1, [1])
    others = [
        _prepare(sink, _scope(sink, B), 0, 0, [2]),  # another incarnation's
        _prepare(sink, _scope(sink, pipeline="other"), 0, 0, [3]),  # another pipeline's
        _prepare(neighbour, _scope(neighbour), 0, 0, [4]),  # another sink's, same table
    ]
    swept = sink.committer().sweep(mine, lambda n: str(n) != owned["txn"])
    assert swept == [orphan["txn"]]
    assert _staged(pg_dsn) == 4
    listed = [t.txn for t in sink.committer().lingering("job", "load")]
    assert sorted(listed) == sorted([owned["txn"], others[0]["txn"]])


def test_a_task_leaves_nothing_staged_unless_it_prepared(pg_dsn: str) -> None:
    sink = _sink(pg_dsn)
    scope = _scope(sink)
    batch = pa.record_batch([[1], ["a"], [0.5]], schema=SCHEMA)
    for attempt, prepare in enumerate([False, True]):
        writer = sink.open_writer(WriteContext(scope, 1, 0, 0, attempt), SCHEMA)
        writer.write(batch)
        if prepare:
            assert writer.prepare() is not None
        writer.close(failed=True)  # the task failed (after its prepare, the second time)
        assert _staged(pg_dsn) == 0
    empty = sink.open_writer(WriteContext(scope, 1, 0, 1, 9), SCHEMA)
    empty.write(batch.slice(0, 0))
    assert empty.prepare() is None


def test_an_audit_checks_each_marker_and_old_markers_retire(pg_dsn: str) -> None:
    sink = _sink(pg_dsn)
    scope = _scope(sink)
    committer = sink.committer()
    committer.claim(scope)
    first, second = _prepare(sink, scope, 0, 0, [0, 1]), _prepare(sink, scope, 1, 0, [2])
    committer.commit([first])
    committer.commit([second])
    evidence = [
        CheckpointEvidence(n, 0.0, [committer.evidence(c)]) for n, c in [(1, first), (2, second)]
    ]
    assert [f.verdict for f in committer.audit(scope, evidence)] == [Verdict.OK, Verdict.OK]
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("UPDATE orders_commits SET n_rows = 7 WHERE txn = %s", (second["txn"],))
    assert [f.verdict for f in committer.audit(scope, evidence)] == [Verdict.OK, Verdict.MISMATCH]
    committer.retire_evidence(scope, before_batch=1)
    assert _one(pg_dsn, "SELECT count(*) FROM orders_commits WHERE txn = %s", first["txn"]) == 0
    assert _one(pg_dsn, "SELECT count(*) FROM orders_commits") == 1


def test_the_sink_runs_on_sqlite_too(tmp_path: Path) -> None:
    """Another driver, another paramstyle (``qmark``): the same protocol."""
    db = str(tmp_path / "orders.db")
    with sqlite3.connect(db) as c:
        c.execute(TABLE.replace("float8", "real"))
    sink = DbApiSink(Connect("sqlite3", db), "orders")
    assert sink.paramstyle == "qmark"
    sink.preflight(SCHEMA)
    scope = _scope(sink)
    sink.committer().claim(scope)
    a, b = _prepare(sink, scope, 0, 0, [0, 1]), _prepare(sink, scope, 0, 1, [2])
    orphan = _prepare(sink, scope, 0, 2, [3])
    sink.committer().commit([a, b])
    sink.committer().commit([a, b])
    assert sink.committer().sweep(scope, lambda n: str(n) == orphan["txn"]) == [orphan["txn"]]
    with sqlite3.connect(db) as c:
        assert [r[0] for r in c.execute("SELECT id FROM orders ORDER BY id")] == [0, 1, 2]
        assert c.execute("SELECT count(*) FROM orders_staged").fetchone() == (0,)


# -- the example job under kills --------------------------------------------------------


def _line(row: dict[str, Any]) -> str:
    return json.dumps(row) + "\n"


def _job_input(dsn: str, tmp_path: Path, files: int, per_batch: int) -> list[str]:
    """Input files of 200 rows each, the table, and the job's arguments."""
    (tmp_path / "in").mkdir()
    for f in range(files):
        ids = range(f * 200, f * 200 + 200)
        rows = ({"id": i, "name": f"name-{i}", "amount": i * 0.5} for i in ids)
        (tmp_path / "in" / f"part-{f:03d}.json").write_text("".join(map(_line, rows)))
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(TABLE)
    args = ["--dsn", dsn, "--state", str(tmp_path / "state"), "--input", str(tmp_path / "in")]
    return [*args, "--files-per-batch", str(per_batch)]


def _verify(dsn: str, tmp_path: Path, n: int) -> None:
    """Every row once (the kit's verifier), nothing staged or lingering, and
    ``twophase audit`` clean: the command rebuilds the sink from the settings
    the ledger recorded (its DSN from the environment) and checks every
    committed transaction's evidence against the markers."""
    assert_exactly_once_postgres(dsn, "orders", range(n), key="id", job="dbapi")
    assert _staged(dsn) == 0
    sink = DbApiSink(Connect("psycopg", dsn), "orders")
    assert sink.committer().lingering("dbapi", "load") == []
    state = str(tmp_path / "state")
    # the job imported the sink as dbapi_sink: the command needs it importable so
    path = {"PYTHONPATH": os.pathsep.join([str(JOB.parent), os.environ.get("PYTHONPATH", "")])}
    unimportable = twophase("audit", "--all", "--json", state, cwd=ROOT)
    assert unimportable.returncode == 2, unimportable
    assert "cannot import dbapi_sink:DbApiSink" in unimportable.stderr, unimportable.stderr
    refused = twophase("audit", "--all", "--json", state, env=path, cwd=ROOT)
    assert refused.returncode == 2 and "TWOPHASE_DBAPI_ORDERS_DSN" in refused.stderr, refused
    secret = {"TWOPHASE_DBAPI_ORDERS_DSN": dsn}
    done = twophase("audit", "--all", "--json", state, env={**path, **secret}, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    verdicts = [f["verdict"] for c in report["checks"] for f in c["findings"] if f["txn"] != "-"]
    assert verdicts and set(verdicts) == {"ok"}, report


def _crash(dsn: str, tmp_path: Path, files: int, per_batch: int, least: int, **kw: Any) -> None:
    """``examples/dbapi_job.py`` on ``files`` input files, ``per_batch`` a batch,
    under ``crash_test(**kw)``, killed ``least`` times at least; then
    ``_verify``."""
    args = _job_input(dsn, tmp_path, files, per_batch)
    report = crash_test(
        JOB,
        args=args,
        verify=lambda: _verify(dsn, tmp_path, 200 * files),
        log=tmp_path / "crash.log",
        **kw,
    )
    print(report)
    assert report.kills >= least, f"runs ended before their kill:\n{report}"


@pytest.mark.crash
def test_the_example_job_survives_kills_exactly_once(pg_dsn: str, tmp_path: Path) -> None:
    """A kill at a random instant of the start (claims, recovery), then one
    right after the first checkpoint's commit, before the ledger records it
    (the next start commits the same work again: nothing twice), then a run to
    the end."""
    _crash(
        pg_dsn,
        tmp_path,
        files=12,
        per_batch=2,
        least=2,
        kills=2,
        seed=11,
        fault_points=["driver.after_commit"],
        min_delay=4.0,
        max_delay=9.0,
    )


@SLOW
@pytest.mark.crash
def test_the_example_job_survives_many_kills_exactly_once(pg_dsn: str, tmp_path: Path) -> None:
    """Eight kills over 36 batches: four at random instants, and one at each
    named point this sink reaches, at the first batch or checkpoint of its run
    (``driver.mid_commit`` is hit inside the project's own sinks only)."""
    _crash(
        pg_dsn,
        tmp_path,
        files=36,
        per_batch=1,
        least=7,
        kills=8,
        seed=23,
        fault_points=[
            "driver.before_record",
            "driver.before_commit",
            "driver.after_record",
            "driver.after_commit",
        ],
        min_delay=10.0,
        max_delay=24.0,
    )


@SLOW
@pytest.mark.crash
def test_staged_rows_lost_while_the_job_is_down_are_written_again(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Rule 5 end to end: the job dies with a checkpoint decided and not
    committed; someone deletes the staged rows of one of its transactions;
    the next start finds the loss before committing anything of that sink,
    owes the batch, writes it again from its source (``REPAYS``) and ends with
    every row once."""
    args = _job_input(pg_dsn, tmp_path, files=8, per_batch=2)
    command = [sys.executable, str(JOB), *args]
    with open(tmp_path / "job.log", "wb") as log:
        env = {**os.environ, "TWOPHASE_FAULT": "driver.before_commit=kill"}
        first = subprocess.run(command, env=env, stdout=log, stderr=log, timeout=300)
        assert first.returncode == -signal.SIGKILL
        doc = read_ledger(tmp_path / "state")
        assert doc is not None
        pending = sorted(int(b) for b in doc["pending"]["load"])
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            txn = c.execute(
                "SELECT min(txn) FROM orders_staged WHERE txn LIKE %s", (f"%.b{pending[0]}.p%",)
            ).fetchone()[0]
            assert txn is not None
            c.execute("DELETE FROM orders_staged WHERE txn = %s", (txn,))
        second = subprocess.run(command, stdout=log, stderr=log, timeout=300)
    text = (tmp_path / "job.log").read_text()
    assert second.returncode == 0, text[-3000:]
    assert "owed to it" in text and txn in text, text[-3000:]
    _verify(pg_dsn, tmp_path, 200 * 8)
