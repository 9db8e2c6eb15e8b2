"""Crash tests of the Kafka sink: SIGKILL the driver at every phase of the commit
protocol, restart it with the same state_dir, and check exactly-once in the log.

Each run is ``tests/jobs/kafka_job.py`` as a real driver process (its own JVM and
Python workers), faults injected through ``TWOPHASE_FAULT`` (``sinks/_faults.py``),
as in ``test_postgres_crash.py``. The first run must die by SIGKILL (proving the
point was reached); the second, without a fault, must exit 0 and leave every
input row committed exactly once and no transaction of the job open, decided
from the control markers in the raw log (``tests/kafkacheck.py``).
"""

from __future__ import annotations

import json
import signal
import uuid
from collections import defaultdict
from pathlib import Path

import psycopg
import pytest

from lifecycle.ledger import read_ledger
from sinks.kafka.log import TopicLog
from sinks.naming import TxnName
from tests import tiers
from tests.conftest import write_input
from tests.kafkacheck import assert_exactly_once, assert_nothing_open, row_id, txn_outcomes
from tests.pgcheck import assert_exactly_once as pg_exactly_once
from tests.pgcheck import job_prepared
from tests.procs import JobProcess, run_job

pytestmark = pytest.mark.crash


class Run:
    """One crash-test scenario: input, topic, state_dir, and the job's command line."""

    def __init__(self, tmp: Path, bootstrap: str, topic: str, dsn: str | None = None) -> None:
        self.tmp = tmp
        self.bootstrap = bootstrap
        self.topic = topic
        self.dsn = dsn
        self.job = f"kc{uuid.uuid4().hex[:8]}"  # the registry topic is shared by all tests
        self.state = tmp / "state"

    def args(self, interval: float, files_per_batch: int) -> list[str]:
        args = [
            "--bootstrap",
            self.bootstrap,
            "--topic",
            self.topic,
            "--state",
            str(self.state),
            "--input",
            str(self.tmp / "in"),
            "--job",
            self.job,
            "--interval",
            str(interval),
            "--files-per-batch",
            str(files_per_batch),
        ]
        if self.dsn:
            args += ["--sinks", "kafka,pg", "--dsn", self.dsn]
        return args

    def start(
        self, fault: str | None = None, interval: float = 0.0, files_per_batch: int = 1
    ) -> JobProcess:
        log = self.tmp / f"job-{'fault' if fault else 'clean'}.log"
        return run_job("kafka_job.py", self.args(interval, files_per_batch), log, fault, 180)

    def check(self, n: int) -> TopicLog:
        """Exactly once, nothing open, nothing undecided in the ledger."""
        log = assert_exactly_once(self.bootstrap, self.topic, n)
        # what was aborted (replayed batches, failed attempts) was committed once later
        assert {row_id(r) for r in log.aborted} <= set(range(n))
        assert_nothing_open(self.bootstrap, self.topic, self.job)
        doc = read_ledger(self.state)
        assert doc is not None and doc["pending"] == {} and doc["decided"] is None
        assert doc["finished"] == ["load"]
        if self.dsn:
            pg_exactly_once(self.dsn, "orders", n)
            assert job_prepared(self.dsn, self.job) == []
        return log


def _crash_and_recover(
    run: Run, fault: str, interval: float = 0.0, files_per_batch: int = 1
) -> TopicLog:
    n = write_input(run.tmp / "in", files=4, rows_per_file=150)
    if run.dsn:
        with psycopg.connect(run.dsn, autocommit=True) as c:
            c.execute("CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8)")
    first = run.start(fault, interval, files_per_batch)
    assert first.proc.returncode == -signal.SIGKILL, (
        f"the fault {fault} did not kill the driver (exit {first.proc.returncode}):\n"
        + first.tail(3000)
    )
    second = run.start(None, interval, files_per_batch)
    assert second.proc.returncode == 0, second.tail(5000)
    return run.check(n)


# fault -> whether recovery must have aborted something (ABORT markers in the log):
# work prepared but never registered is swept (rule 4), a registered batch Spark did
# not complete is rolled back (rule 3); later faults leave it to timing (Spark may
# have been writing the next batch at the kill).
CRASH_POINTS = {
    "while executors write": ("executor.write@2=kill-driver", None),
    "after prepare, before the ledger record": ("driver.before_record@2=kill", True),
    "after the ledger record, before Spark's commit log": ("driver.after_record@2=kill", True),
    "after Spark's commit log, before our commit": ("driver.before_commit@2=kill", None),
}


@pytest.mark.parametrize(
    "point",
    tiers.params(
        CRASH_POINTS,
        # "after Spark's commit log, before our commit" is the slow tier's: a
        # restart that commits Kafka transactions another process prepared is the
        # default run's test_crash_with_postgres_and_kafka[driver.mid_commit.kafka=kill],
        # and the phase is killed for PostgreSQL there (test_postgres_crash.py)
        keep=["after prepare, before the ledger record"],
    ),
)
def test_crash_at_each_phase(kafka_bootstrap, kafka_topic, tmp_path, point):  # type: ignore[no-untyped-def]
    fault, must_abort = CRASH_POINTS[point]
    log = _crash_and_recover(Run(tmp_path, kafka_bootstrap, kafka_topic(3)), fault)
    if must_abort:
        assert log.n_aborted > 0, "recovery did not abort the interrupted batch"


def test_crash_in_the_middle_of_committing(kafka_bootstrap, kafka_topic, tmp_path):  # type: ignore[no-untyped-def]
    """Several transactions per checkpoint (2 files per batch, grouped batches):
    the driver dies after the first EndTxn of a checkpoint; the restart finishes
    the decided checkpoint, re-committing the first transaction harmlessly."""
    run = Run(tmp_path, kafka_bootstrap, kafka_topic(3))
    _crash_and_recover(run, "driver.mid_commit=kill", interval=3.0, files_per_batch=2)


@pytest.mark.parametrize(
    ("action", "evidence"),
    [
        pytest.param("raise", "injected fault at executor.prepared", marks=tiers.SLOW),
        ("kill", "exited unexpectedly"),
    ],
)
def test_task_fails_after_flush_and_is_retried(  # type: ignore[no-untyped-def]
    kafka_bootstrap, kafka_topic, tmp_path, action, evidence
):
    """Every first task attempt fails after its transaction was flushed (an
    exception, or its Python worker SIGKILLed); Spark retries it. The failed
    attempt's transaction must end in an ABORT (by the task itself, or by the
    driver's sweep of the registry), the retry's in a COMMIT."""
    run = Run(tmp_path, kafka_bootstrap, kafka_topic(3))
    n = write_input(tmp_path / "in", files=4, rows_per_file=100)
    proc = run.start(f"executor.prepared#0={action}")
    assert proc.proc.returncode == 0, proc.tail(5000)
    assert evidence in proc.output()  # the failure happened
    result = proc.result()
    assert sum(result["rows"].values()) == n
    run.check(n)

    attempts: dict[str, dict[int, str]] = defaultdict(dict)
    for tid, verdict in txn_outcomes(kafka_bootstrap, run.job, settle=15).items():
        name = TxnName.parse(tid)
        assert name is not None
        attempts[name.partition_prefix()][name.attempt] = verdict
    assert len(attempts) >= 4  # one (batch, partition) at least per file
    for where, verdicts in attempts.items():
        ordered = [verdicts[a] for a in sorted(verdicts)]
        assert ordered[-1] == "committed" and ordered[:-1] == ["aborted"] * (len(ordered) - 1), (
            f"{where}: {json.dumps(verdicts)}"
        )
        assert len(ordered) >= 2, f"{where}: the first attempt did not fail"


@pytest.mark.parametrize(
    "fault",
    tiers.params(
        ["driver.after_record@2=kill", "driver.mid_commit.kafka=kill"],
        keep=["driver.mid_commit.kafka=kill"],
    ),
)
def test_crash_with_postgres_and_kafka(  # type: ignore[no-untyped-def]
    kafka_bootstrap, kafka_topic, pg_dsn, tmp_path, fault
):
    """One pipeline writing to Kafka and PostgreSQL (committed in that order):
    killed after the ledger record, or after the first Kafka EndTxn of a
    checkpoint (PostgreSQL not yet committed); after the restart each row is
    exactly once in both."""
    run = Run(tmp_path, kafka_bootstrap, kafka_topic(3), dsn=pg_dsn)
    if fault.startswith("driver.mid_commit"):
        _crash_and_recover(run, fault, interval=3.0, files_per_batch=2)
    else:
        _crash_and_recover(run, fault)
