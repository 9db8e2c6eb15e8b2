"""Crash tests: SIGKILL the driver process at every phase of the commit
protocol, restart it with the same state_dir, and check exactly-once.

Each test runs ``tests/jobs/pg_job.py`` as a real driver process (its own JVM
and Python workers). The fault is injected through ``TWOPHASE_FAULT`` (see
``sinks/_faults.py``): the process under test kills itself (or, from an
executor, kills the driver) at the named point. The first run must die by
SIGKILL (proving the point was reached); the second run, with no fault, must
exit 0 and leave every input row in the table exactly once and no prepared
transaction of the job behind.

The crash matrix runs with the embedded (file) ledger; two of its points run
again with the ledger in PostgreSQL (``Job(ledger=URI)``, in the test's
database), where the restarted driver takes the ledger's advisory lock over
from the killed one.
"""

from __future__ import annotations

import signal
from pathlib import Path

import psycopg
import pytest

from lifecycle.ledger import read_ledger
from tests import procs, tiers
from tests.conftest import write_input
from tests.ledgers import pg_uri
from tests.pgcheck import assert_exactly_once, job_prepared
from tests.procs import JobProcess

pytestmark = pytest.mark.crash


def run_job(
    dsn: str,
    state: Path,
    inp: Path,
    *,
    fault: str | None = None,
    interval: float = 0.0,
    files_per_batch: int = 1,
    timeout: float = 240,
    ledger: str | None = None,
) -> JobProcess:
    """Run ``tests/jobs/pg_job.py`` to its end (log in ``state``'s parent);
    ``ledger``: a PostgreSQL URI for ``Job(ledger=...)``."""
    args = [
        "--dsn",
        dsn,
        "--state",
        str(state),
        "--input",
        str(inp),
        "--interval",
        str(interval),
        "--files-per-batch",
        str(files_per_batch),
        *(["--ledger", ledger] if ledger else []),
    ]
    return procs.run_job("pg_job.py", args, state.parent / "job.log", fault, timeout)


def _create(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8)")


def _crash_and_recover(dsn: str, tmp: Path, fault: str, **kw: object) -> None:
    n = write_input(tmp / "in", files=6, rows_per_file=150)
    _create(dsn)
    state = tmp / "state"
    first = run_job(dsn, state, tmp / "in", fault=fault, **kw)  # type: ignore[arg-type]
    assert first.proc.returncode == -signal.SIGKILL, (
        f"the fault {fault} did not kill the driver (exit {first.proc.returncode}):\n"
        + first.tail()
    )
    second = run_job(dsn, state, tmp / "in", **kw)  # type: ignore[arg-type]
    assert second.proc.returncode == 0, second.tail()
    assert_exactly_once(dsn, "orders", n)
    assert job_prepared(dsn, "crash") == []
    doc = read_ledger(state)  # from the ledger's location, when it is in PostgreSQL
    assert doc is not None and doc["pending"] == {} and doc["decided"] is None
    assert doc["finished"] == ["load"] and doc["run"] == 2
    assert (state / "ledger").exists() == (kw.get("ledger") is None)


CRASH_POINTS = {
    "while executors write": "executor.write@2=kill-driver",
    "after prepare, before the ledger record": "driver.before_record@2=kill",
    "after the ledger record, before Spark's commit log": "driver.after_record@2=kill",
    "after Spark's commit log, before our commit": "driver.before_commit@2=kill",
}


@pytest.mark.parametrize(
    "point",
    tiers.params(
        CRASH_POINTS,
        # the next phase is killed by test_crash_with_the_ledger_in_postgresql
        keep=["after the ledger record, before Spark's commit log"],
    ),
)
def test_crash_at_each_phase(pg_dsn: str, tmp_path: Path, point: str) -> None:
    _crash_and_recover(pg_dsn, tmp_path, CRASH_POINTS[point])


PG_LEDGER_POINTS = [
    "after the ledger record, before Spark's commit log",
    "after Spark's commit log, before our commit",
]


@pytest.mark.parametrize("point", tiers.params(PG_LEDGER_POINTS, keep=PG_LEDGER_POINTS[1:]))
def test_crash_with_the_ledger_in_postgresql(pg_dsn: str, tmp_path: Path, point: str) -> None:
    """The driver is SIGKILLed holding the ledger's advisory lock (its sessions die
    with it); the restart takes the lock, moves the fencing token on, recovers."""
    _crash_and_recover(pg_dsn, tmp_path, CRASH_POINTS[point], ledger=pg_uri(pg_dsn))


@tiers.SLOW
def test_crash_in_the_middle_of_committing(pg_dsn: str, tmp_path: Path) -> None:
    """Several transactions per checkpoint (2 files per batch, grouped batches):
    the driver dies after the first COMMIT PREPARED of a checkpoint."""
    _crash_and_recover(pg_dsn, tmp_path, "driver.mid_commit=kill", interval=3.0, files_per_batch=2)


@pytest.mark.parametrize(
    "fault",
    tiers.params(
        ["driver.after_record@3=kill", "driver.before_commit=kill"],
        keep=["driver.before_commit=kill"],
    ),
)
def test_crash_with_grouped_checkpoints(pg_dsn: str, tmp_path: Path, fault: str) -> None:
    _crash_and_recover(pg_dsn, tmp_path, fault, interval=2.0)


@pytest.mark.parametrize(
    ("action", "evidence"),
    [
        pytest.param("raise", "injected fault at executor.prepared", marks=tiers.SLOW),
        ("kill", "exited unexpectedly"),
    ],
)
def test_task_fails_after_prepare_and_is_retried(
    pg_dsn: str, tmp_path: Path, action: str, evidence: str
) -> None:
    """Every first task attempt fails after PREPARE TRANSACTION (an exception, or
    its Python worker is SIGKILLed); Spark retries it. The retry writes the same
    keys (the table has a primary key), so the failed attempt's prepared
    transaction must be rolled back, not left to block the retry or to commit."""
    n = write_input(tmp_path / "in", files=4, rows_per_file=100)
    _create(pg_dsn)
    proc = run_job(
        pg_dsn,
        tmp_path / "state",
        tmp_path / "in",
        fault=f"executor.prepared#0={action}",
        timeout=180,
    )
    assert proc.proc.returncode == 0, proc.tail()
    assert evidence in proc.output()  # the failure happened
    assert_exactly_once(pg_dsn, "orders", n)
    assert job_prepared(pg_dsn, "crash") == []
    assert sum(proc.result()["rows"].values()) == n
