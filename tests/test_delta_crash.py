"""Crash tests of a pipeline writing the same batches to Delta, PostgreSQL and
Kafka: SIGKILL the driver at every phase of the commit protocol, restart it
with the same state_dir, and check every sink.

Each run is ``tests/jobs/multi_sink_job.py`` as a real driver process (its own
JVM and Python workers), the fault injected through ``TWOPHASE_FAULT``
(``sinks/_faults.py``), as in ``test_postgres_crash.py``. The first run must die
by SIGKILL (proving the point was reached); the second, without a fault, must
exit 0 and leave:

* every input row exactly once in the Delta table, the PostgreSQL table and the
  Kafka topic (decided from the control markers in the raw log);
* no staged Delta file outside the table's snapshot and no staging marker, no
  prepared PostgreSQL transaction and no open Kafka transaction of the job;
* a ledger whose checkpoints each committed all three sinks, for the same
  rows, and one Delta version per checkpoint holding exactly its batches.

The Delta sink stages its files with Spark's own Parquet writer (its default
for local tables, :mod:`sinks.delta.spark_stage`), so two more points kill the
driver between Spark's job commit and the files' moves (``driver.spark_staged``)
and in the middle of the moves (``driver.mid_move``): the restart's sweep must
find them from Spark's staging directory and the markers. The points that only
the sink's own writer has run with ``write_with="arrow"``, where Delta is the
first sink of the pipeline, so the executor-side kill hits a Delta task in the
middle of staging files. ``driver.mid_commit.delta`` (which
Delta hits right after its version is written, before its staging markers are
deleted; the other sinks commit at the same time) leaves Delta committed and
PostgreSQL and Kafka committed or still prepared: the restart must recognise
the Delta version as done and commit what the other two have not.

Last, a Delta-only run whose first task attempts are SIGKILLed right after
staging their files (Spark retries them): the checkpoints sweep the dead
attempts' files while the job runs.
"""

from __future__ import annotations

import signal

import psycopg
import pytest

from tests import deltacheck, tiers
from tests.conftest import write_input
from tests.multisink import LABELS, Run

pytestmark = pytest.mark.crash


# fault -> (checkpoint_interval, files per batch, run whose files of batch 2 the
# table must hold: 2 when Spark replays the batch after the crash, 1 when the
# crash came after Spark completed it; None: not checked)
CRASH_POINTS = {
    "while executors write": ("executor.write@2=kill-driver", 0.0, 1, 2),
    "after prepare, before the ledger record": ("driver.before_record@2=kill", 0.0, 1, 2),
    "after the ledger record, before Spark's commit log": (
        "driver.after_record@2=kill",
        0.0,
        1,
        2,
    ),
    "after Spark's commit log, before our commit": ("driver.before_commit@2=kill", 0.0, 1, 1),
    "in the middle of committing": ("driver.mid_commit.delta=kill", 1.0, 2, None),
    "after Spark's job, before the files move": ("driver.spark_staged@2=kill", 0.0, 1, 2),
    "while the staged files move": ("driver.mid_move@2=kill", 0.0, 1, 2),
}
ROUTES = {
    "while executors write": ("spark", "arrow"),
    "after Spark's job, before the files move": ("spark",),
    "while the staged files move": ("spark",),
}
CASES = [(p, r) for p in CRASH_POINTS for r in ROUTES.get(p, ("spark",))]


DEFAULT_CASES = [
    ("while the staged files move", "spark"),
    ("in the middle of committing", "spark"),
    ("while executors write", "arrow"),
]
"""the cases of the default run (the rest are in the slow tier, tests/tiers.py):
the phases only Delta has, and one of the Arrow route; the default runs of
test_kafka_crash and test_postgres_crash kill the others"""


@pytest.mark.parametrize(
    ("point", "route"),
    [
        pytest.param(p, r, id=f"{p}, {r}", marks=() if (p, r) in DEFAULT_CASES else tiers.SLOW)
        for p, r in CASES
    ],
)
def test_crash_at_each_phase(pg_dsn, kafka_bootstrap, kafka_topic, tmp_path, point, route):  # type: ignore[no-untyped-def]
    fault, interval, files_per_batch, batch2_run = CRASH_POINTS[point]
    run = Run(tmp_path, pg_dsn, kafka_bootstrap, kafka_topic(3), delta_write_with=route)
    files = 3 if files_per_batch == 1 else 4  # batches 0, 1, 2; or 0, 1 of 2 files each
    n = write_input(tmp_path / "in", files=files, rows_per_file=100)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(
            "CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8, part bigint)"
        )

    first = run.start(fault, interval, files_per_batch)
    assert first.proc.returncode == -signal.SIGKILL, (
        f"the fault {fault} did not kill the driver (exit {first.proc.returncode}):\n"
        + first.tail(3000)
    )
    left = deltacheck.markers(run.delta)
    if fault.startswith("driver.mid_commit"):
        # Delta committed its version, then the driver died before deleting its markers
        assert left and deltacheck.versions(run.delta)[-1].operation == "WRITE"
    elif fault.startswith("driver.spark_staged"):
        assert deltacheck.spark_staging(run.delta), "Spark's writer staged nothing"
    elif not fault.startswith("executor."):
        assert left, "the killed run left no staged Delta work behind"

    second = run.start(None, interval, files_per_batch)
    assert second.proc.returncode == 0, second.tail(5000)
    assert second.result()["committed"] is True
    ours = run.check(n)
    if batch2_run is not None:
        assert deltacheck.runs_of_batch(ours, 2) == {batch2_run}
    if fault.startswith("driver.mid_commit"):
        assert "committed already" in second.output()  # not committed twice


@tiers.SLOW
def test_task_killed_after_staging_is_retried(tmp_path):  # type: ignore[no-untyped-def]
    """Every first task attempt has its Python worker SIGKILLed right after it
    staged its files (they stay on disk, with their markers); Spark retries the
    task. The retry's files are committed, the dead attempts' files are swept by
    the checkpoints (they are in no ledger entry), and nothing is left staged."""
    run = Run(tmp_path, None, None, None, delta_write_with="arrow")  # Delta only, own writer
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    proc = run.start("executor.prepared#0=kill")
    assert proc.proc.returncode == 0, proc.tail(5000)
    out = proc.output()
    assert "exited unexpectedly" in out  # the first attempts died
    assert "deleted the staged files of" in out  # and their files were swept
    result = proc.result()
    assert result["rows"] == {LABELS["delta"]: n}
    ours = run.check(n)
    assert set().union(*(v.batches() for v in ours)) == {0, 1, 2}
