"""The PostgreSQL server misbehaves between pre-commit and commit."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pyspark.sql.pandas.types import to_arrow_schema

from lifecycle import CheckpointCommitError, Job, JobFailedError
from lifecycle.ledger import read_ledger
from lifecycle.testing.postgres_server import PostgresServer
from sinks import LockWaitError, PostgresSink, PreflightError, _faults
from tests.conftest import write_input
from tests.pgcheck import assert_exactly_once, job_prepared, rollback_prepared
from tests.procs import JobProcess, wait_for
from tests.sparkutil import INPUT_SCHEMA


def _job(spark, dsn: str, tmp: Path, name: str, **sink: Any) -> Job:  # type: ignore[no-untyped-def]
    df = spark.readStream.schema(INPUT_SCHEMA).json(str(tmp / "in"))  # one batch
    job = Job(spark, name, tmp / "state", checkpoint_interval=0)
    sinks = [PostgresSink(dsn, "orders", **{"commit_timeout": 60, **sink})]
    job.add_pipeline("load", df, sinks, bounded=True)
    return job


def _create(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8)")


def test_commit_waits_for_a_restarting_server(spark, pg_server, pg_dsn, tmp_path, caplog):  # type: ignore[no-untyped-def]
    if pg_server is None:
        pytest.skip("needs the test-managed PostgreSQL server (TWOPHASE_PG_DSN is set)")
    n = write_input(tmp_path / "in", files=3, rows_per_file=200)
    _create(pg_dsn)
    events: dict[str, float] = {}

    def restart_later() -> None:
        time.sleep(4)
        pg_server.start()
        events["started"] = time.monotonic()

    def stop_server() -> None:
        events["prepared"] = len(job_prepared(pg_dsn, "restart"))
        pg_server.stop("fast")
        events["stopped"] = time.monotonic()
        threading.Thread(target=restart_later, daemon=True).start()

    _faults.register("driver.before_commit", stop_server)
    caplog.set_level(logging.WARNING, logger="sinks.retry")
    job = _job(spark, pg_dsn, tmp_path, "restart")
    try:
        job.run()
    finally:
        _faults.clear()
        if not pg_server.is_running():
            pg_server.start()
    assert events["prepared"] >= 1  # pre-committed, server then stopped
    assert "started" in events  # the commit could only succeed after the restart
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert retries
    # every retry is counted for the sink in the job's metrics
    counted = sum(s.value for s in job.metrics() if s.name == "twophase_commit_retries_total")
    assert counted == len(retries), (counted, len(retries))
    assert_exactly_once(pg_dsn, "orders", n)
    assert job_prepared(pg_dsn, "restart") == []


def test_a_lost_transaction_is_written_again_never_silence(spark, pg_dsn, tmp_path, caplog):  # type: ignore[no-untyped-def]
    """Someone rolls the prepared transactions back before the commit: the
    commit finds them gone, says so, and the run writes the batch again from
    its source (rule 5; the cases are in tests/test_lost_work.py)."""
    n = write_input(tmp_path / "in", files=2, rows_per_file=50)
    _create(pg_dsn)

    _faults.register("driver.before_commit", lambda: rollback_prepared(pg_dsn, "lost"))
    try:
        _job(spark, pg_dsn, tmp_path, "lost").run()
    finally:
        _faults.clear()
    assert "lost its transaction(s) of batch(es) [0]" in caplog.text
    assert_exactly_once(pg_dsn, "orders", n)
    doc = read_ledger(tmp_path / "state")
    assert doc is not None and doc["owed"] == {} and doc["decided"] is None


def test_preflight_refuses_a_server_without_prepared_transactions(spark, tmp_path):  # type: ignore[no-untyped-def]
    server = PostgresServer(settings={"max_prepared_transactions": "0"})
    server.start()
    try:
        schema = to_arrow_schema(INPUT_SCHEMA)
        with pytest.raises(PreflightError, match="max_prepared_transactions is 0"):
            PostgresSink(server.dsn(), "orders", create_table=True).preflight(schema)
    finally:
        server.cleanup()


def test_a_task_blocked_by_a_lock_fails_instead_of_hanging(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """Another application holds a key the job writes, in a prepared transaction
    (so it never times out by itself). The job's tasks give up after
    ``lock_timeout`` and the job fails saying why; once the holder is gone, the
    job is run again and writes every row exactly once."""
    n = write_input(tmp_path / "in", files=2, rows_per_file=50)
    _create(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("BEGIN")
        c.execute("INSERT INTO orders VALUES (7, 'held by another application', 0)")
        c.execute("PREPARE TRANSACTION 'other-app-1'")
    started = time.monotonic()
    with pytest.raises(JobFailedError, match="lock_timeout=2s") as e:
        _job(spark, pg_dsn, tmp_path, "locked", lock_timeout=2).run()
    assert time.monotonic() - started < 60
    assert LockWaitError.__name__ in str(e.value)  # the executor-side error, by name
    assert job_prepared(pg_dsn, "locked") == []  # the failed attempts left nothing
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("ROLLBACK PREPARED 'other-app-1'")
    _job(spark, pg_dsn, tmp_path, "locked", lock_timeout=2).run()
    assert_exactly_once(pg_dsn, "orders", n)
    assert job_prepared(pg_dsn, "locked") == []


def test_upsert_refuses_a_lock_timeout_shorter_than_the_interval(pg_dsn):  # type: ignore[no-untyped-def]
    sink = PostgresSink(pg_dsn, "orders", key=["id"], lock_timeout=5)
    with pytest.raises(PreflightError, match="not longer than checkpoint_interval"):
        sink.check_checkpoint_interval(10.0)
    auto = PostgresSink(pg_dsn, "orders", key=["id"])
    auto.check_checkpoint_interval(100.0)
    assert auto.lock_timeout == 360.0
    PostgresSink(pg_dsn, "orders", lock_timeout=5).check_checkpoint_interval(10.0)  # append: ok


def _commit_backend(dsn: str) -> int:
    with psycopg.connect(dsn) as c:
        row = c.execute(  # the one that just committed (idle kept ones keep their name)
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'twophase-commit'"
            " AND query LIKE 'COMMIT PREPARED%' ORDER BY state_change DESC LIMIT 1"
        ).fetchone()
    assert row is not None, "no commit connection"
    return int(row[0])


def test_a_stopped_backend_fails_the_commit_after_commit_timeout(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """The server process committing the job's transactions is SIGSTOPped between
    two COMMIT PREPAREDs: its connection stays alive (the kernel answers) and it
    answers nothing. The commit fails after commit_timeout naming the gid it
    waited for; with the process resumed, the next start finishes the commit."""
    n = write_input(tmp_path / "in", files=3, rows_per_file=50)
    _create(pg_dsn)
    stopped: list[int] = []

    def stop_backend() -> None:
        pid = _commit_backend(pg_dsn)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    _faults.register("driver.mid_commit", stop_backend)
    started = time.monotonic()
    try:
        with pytest.raises(CheckpointCommitError) as e:
            _job(spark, pg_dsn, tmp_path, "stopped", commit_timeout=6).run()
    finally:
        _faults.clear()
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    took = time.monotonic() - started
    assert stopped and took < 60
    cause = str(e.value)
    assert "got no answer within 6s" in cause and "COMMIT PREPARED 'tp2.stopped." in cause
    doc = read_ledger(tmp_path / "state")
    assert doc is not None and doc["decided"] is not None  # kept for the next start
    _job(spark, pg_dsn, tmp_path, "stopped").run()
    assert_exactly_once(pg_dsn, "orders", n)
    assert job_prepared(pg_dsn, "stopped") == []


def test_server_stopped_while_tasks_write(pg_server, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """The server stops (fast shutdown: every connection cut) while the tasks of
    batch 1 are in the middle of their COPY, and comes back 3 s later. The
    task's transaction is gone with its connection; Spark's next attempt of the
    task (test jobs allow two, ``local[2,2]``) rolls back nothing, writes the
    partition again and prepares it: the job rides the outage out, every row
    exactly once, nothing prepared."""
    if pg_server is None:
        pytest.skip("needs the test-managed PostgreSQL server (TWOPHASE_PG_DSN is set)")
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    _create(pg_dsn)
    args = [
        *("--dsn", pg_dsn, "--state", str(tmp_path / "state"), "--input", str(tmp_path / "in")),
        *("--job", "pgdown", "--files-per-batch", "1"),
    ]
    job = JobProcess("pg_job.py", args, tmp_path / "job.log", "executor.write@1=stall:8")

    def writing() -> bool:
        with psycopg.connect(pg_dsn) as c:
            row = c.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'twophase-writer'"
                " AND state <> 'idle'"
            ).fetchone()
        return bool(row and row[0])

    try:
        wait_for(writing, 120, "a task writing batch 1", job)
        pg_server.stop("fast")
        time.sleep(3)
    finally:
        if not pg_server.is_running():
            pg_server.start()
    assert job.wait(180) == 0, job.tail()
    assert "terminating connection due to administrator command" in job.output(), job.tail()
    assert job.result()["committed"]
    assert_exactly_once(pg_dsn, "orders", n)
    assert job_prepared(pg_dsn, "pgdown") == []
