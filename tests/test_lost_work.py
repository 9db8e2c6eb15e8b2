"""Recovery rule 5: work lost in a target before it committed is written again
from the source, never dropped (:mod:`lifecycle.replay`).

Someone rolls back the PostgreSQL sink's prepared transactions after the
checkpoint was decided. The next start finds the loss before committing the
sink's share, commits the rest (the Delta sink holds the batch already) and
writes the batch again, to PostgreSQL only, from the files with the batch's
own offsets. The same for Kafka transactions that Apache Kafka aborted at their timeout
while the driver was down. When the files are gone, the job stops with a
:class:`~lifecycle.BatchLostError` naming what is missing, the ledger keeps
the debt (``twophase status`` shows it) and a start after the files are back
pays it.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lifecycle import BatchLostError, Job, cli
from lifecycle.ledger import read_ledger
from lifecycle.status import PENDING, format_text, job_status
from sinks import DeltaSink, KafkaSink, PostgresSink, _faults
from sinks.base import Outcome
from tests import deltacheck, tiers
from tests.conftest import write_input
from tests.kafkacheck import consume_ids
from tests.multisink import Run
from tests.pgcheck import assert_exactly_once, job_prepared, rollback_prepared
from tests.sparkutil import INPUT_SCHEMA


def _job(spark: Any, dsn: str, tmp: Path, name: str) -> Job:
    df = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(str(tmp / "in"))
    job = Job(spark, name, tmp / "state", checkpoint_interval=0)
    sinks = [
        PostgresSink(dsn, "orders", sink_id="pg", commit_timeout=60),
        DeltaSink(str(tmp / "delta"), sink_id="delta"),
    ]
    job.add_pipeline("load", df, sinks, bounded=True)
    return job


def _run_losing_the_first_checkpoint(
    spark: Any, dsn: str, tmp: Path, name: str, also: Callable[[], None] | None = None
) -> None:
    """Run, and when the first checkpoint is decided roll the PostgreSQL sink's
    prepared transactions back (and do ``also``): the commit finds them gone,
    and the run writes the batch again itself (rule 5 during a run)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8)")

    def lose() -> None:
        rollback_prepared(dsn, name)
        if also is not None:
            also()

    _faults.register("driver.before_commit", lose)
    try:
        _job(spark, dsn, tmp, name).run()
    finally:
        _faults.clear()


def _owed(tmp: Path) -> dict[str, Any]:
    doc = read_ledger(tmp / "state")
    assert doc is not None
    return dict(doc["owed"])


def test_a_rolled_back_prepared_transaction_is_written_again_from_the_source(
    spark: Any, pg_dsn: str, tmp_path: Path
) -> None:
    n = write_input(tmp_path / "in", files=3, rows_per_file=40)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8)")
    _faults.register("driver.before_commit", lambda: rollback_prepared(pg_dsn, "lostpg"))
    job = _job(spark, pg_dsn, tmp_path, "lostpg")
    try:
        job.run()  # the run writes the lost batch again itself, no operator, no restart
    finally:
        _faults.clear()
    assert_exactly_once(pg_dsn, "orders", n)
    deltacheck.assert_exactly_once(str(tmp_path / "delta"), n)  # not written twice
    assert job_prepared(pg_dsn, "lostpg") == []
    doc = read_ledger(tmp_path / "state")
    assert doc is not None and doc["owed"] == {} and doc["pending"] == {}
    assert doc["totals"] == {"load/pg": n, "load/delta": n}
    assert doc["format"] == 4
    moves = {
        s.labels["rule"]: s.value
        for s in job.metrics()
        if s.name == "twophase_recovery_actions_total" and s.labels.get("sink") == "pg"
    }
    assert moves.get("owe_lost", 0) >= 1 and moves.get("repay_owed", 0) >= 1, moves


@tiers.SLOW  # rule 5's replay is the default run's (the PostgreSQL case above)
def test_staged_files_a_vacuum_removed_are_written_again_from_the_source(
    spark: Any, tmp_path: Path
) -> None:
    """delta-spark's VACUUM with no retention (its safety check turned off)
    deletes every file the snapshot does not reference, and the sink's prepared
    files wait in the table's directories until their commit. The commit finds
    them gone and commits nothing of them; the run owes the batch to the sink
    and writes it again from the source: every row once, nothing left staged,
    and delta-spark reads every version alike."""
    from lifecycle.testing import jars

    jars.require("delta")
    n = write_input(tmp_path / "in", files=3, rows_per_file=40)
    uri = tmp_path / "delta"
    vacuumed: list[int] = []

    def vacuum() -> None:
        if not vacuumed:  # once: the first checkpoint's commit
            spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
            gone = spark.sql(f"VACUUM delta.`{uri}` RETAIN 0 HOURS").collect()
            vacuumed.append(len(gone))

    def job() -> Job:
        df = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1)
        j = Job(spark, "vacuum", tmp_path / "state", checkpoint_interval=0)
        j.add_pipeline("load", df.json(str(tmp_path / "in")), [DeltaSink(str(uri))], bounded=True)
        return j

    _faults.register("driver.before_commit", vacuum)
    try:
        job().run()  # the run writes the batch again itself
    finally:
        _faults.clear()
        spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "true")
    assert vacuumed, "the VACUUM did not run"
    deltacheck.assert_exactly_once(str(uri), n)
    deltacheck.assert_nothing_staged(str(uri))
    doc = read_ledger(tmp_path / "state")
    assert doc is not None and doc["owed"] == {} and doc["pending"] == {}
    deltacheck.assert_delta_spark_reads_every_version(spark, uri)


@pytest.mark.parametrize("then", ["restore the file", "give the batch up"])
def test_a_batch_whose_source_is_gone_stops_the_job_naming_what_is_missing(
    spark: Any, pg_dsn: str, tmp_path: Path, then: str, capsys: pytest.CaptureFixture[str]
) -> None:
    n = write_input(tmp_path / "in", files=1, rows_per_file=40)
    kept = tmp_path / "kept"
    shutil.copytree(tmp_path / "in", kept)
    first = sorted((tmp_path / "in").iterdir())[0]

    with pytest.raises(BatchLostError) as lost:  # the run's own payment finds it gone
        # retention, or someone's clean-up, before the batch is written again
        _run_losing_the_first_checkpoint(spark, pg_dsn, tmp_path, "gone", also=first.unlink)
    e = lost.value
    assert (e.pipeline, e.batch, e.sinks, e.rows) == ("load", 0, {"pg": 40}, 40)
    assert '"logOffset":0' in e.offsets, e.offsets  # the file source's offset of batch 0
    assert "40 row(s) are missing" in str(e) and "pipeline 'load', batch 0" in str(e)
    with pytest.raises(BatchLostError):  # and so does the next start's
        _job(spark, pg_dsn, tmp_path, "gone").run()
    assert _owed(tmp_path) == {"load": {"0": {"pg": {"rows": 40}}}}
    assert deltacheck.read_rows(str(tmp_path / "delta")).num_rows == n  # the rest went on
    with psycopg.connect(pg_dsn) as c:
        assert c.execute("SELECT count(*) FROM orders").fetchone() == (0,)
    doc = read_ledger(tmp_path / "state")
    assert doc is not None
    status = job_status(doc, None)
    assert status["pipelines"]["load"]["owed"] == {"0": {"pg": 40}}
    assert status["exit_code"] == PENDING
    assert "OWED: batch 0 of load to pg 40 row(s)" in format_text(status)
    assert json.loads(json.dumps(status))  # the --json document stays JSON

    if then == "restore the file":
        shutil.copy2(kept / first.name, first)  # the source has the data again
        _job(spark, pg_dsn, tmp_path, "gone").run()
        assert_exactly_once(pg_dsn, "orders", n)
    else:  # the data is gone for good: an operator gives the batch up
        state = str(tmp_path / "state")
        assert cli.main(["abandon", state, "--owed", "load/1", "--yes"]) == 1
        assert cli.main(["abandon", state, "--owed", "load/0", "--yes"]) == 0
        out = capsys.readouterr().out
        assert "giving it up loses 40 row(s) for good" in out, out
        _job(spark, pg_dsn, tmp_path, "gone").run()  # runs on
        with psycopg.connect(pg_dsn) as c:
            assert c.execute("SELECT count(*) FROM orders").fetchone() == (0,)
        doc = read_ledger(tmp_path / "state")
        assert (
            doc is not None
            and "batch 0 of load given up, 40 row(s)" in doc["abandoned"][-1]["note"]
        )
    deltacheck.assert_exactly_once(str(tmp_path / "delta"), n)
    assert _owed(tmp_path) == {}
    assert job_prepared(pg_dsn, "gone") == []


@pytest.fixture
def expiring_kafka() -> Iterator[Any]:
    """An Apache Kafka broker that aborts a transaction soon after its timeout
    (``transaction.max.timeout.ms`` small, the abort sweep every second)."""
    from lifecycle.testing import jars
    from lifecycle.testing.apache_kafka import ApacheKafka

    jars.require("kafka-broker")
    settings = {
        "transaction.max.timeout.ms": "20000",
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
    }
    with ApacheKafka(settings) as broker:
        yield broker


def _until_lost(bootstrap: str, topic: str, state: Path, batch: str, within: float) -> None:
    """Wait until the broker aborted every Kafka transaction of pending ``batch``."""
    doc = read_ledger(state)
    assert doc is not None
    work = doc["pending"]["load"][batch]["kafka"]
    sink = KafkaSink(bootstrap, topic, key="id", sink_id="kafka")
    deadline = time.monotonic() + within
    try:
        while set((verdicts := sink.committer().classify(work)).values()) != {Outcome.LOST}:
            assert time.monotonic() < deadline, f"the broker did not abort them: {verdicts}"
            time.sleep(1)
    finally:
        sink.close()


@pytest.mark.crash
@tiers.SLOW  # rule 5 for Kafka is the default run's in a run (tests/test_kafka_lost_in_run.py,
# test_kafka_transactions_expire_while_postgres_holds_the_commit_back); a start's replay is
# the same code (lifecycle/replay.py), run at a start by the source-gone test above
def test_a_kafka_transaction_the_broker_aborted_is_written_again(
    expiring_kafka: Any, pg_dsn: str, tmp_path: Path
) -> None:
    """The driver is SIGKILLed with checkpoint 2 decided and stays down past the
    Kafka sink's transaction timeout, so Apache Kafka aborts batch 1's
    transactions. The restart owes batch 1 to Kafka, commits it to PostgreSQL
    and Delta, and writes it again into Kafka from the input files: every sink
    exact, read_committed readers see each row once."""
    bootstrap = expiring_kafka.bootstrap
    topic = f"t-{uuid.uuid4().hex[:12]}"
    _make_topic(bootstrap, topic)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id int8 PRIMARY KEY, name text, amount float8, part int8)")
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    run = Run(tmp_path, pg_dsn, bootstrap, topic)
    short = ["--kafka-timeout-ms", "8000"]
    first = run.start(fault="driver.before_commit@1=kill", extra=short)
    assert first.proc.returncode == -signal.SIGKILL, first.tail(3000)
    _until_lost(bootstrap, topic, tmp_path / "state", "1", within=60)

    second = run.start(extra=short)
    assert second.proc.returncode == 0, second.tail(5000)
    assert "are owed to it: written again from the source" in second.output()
    assert "writing batch 1 of pipeline load again from its source" in second.output()
    run.check(n, owed=True)
    ids = consume_ids(bootstrap, topic, "read_committed")
    assert sorted(ids) == list(range(n)), f"{len(ids)} rows read_committed"
    doc = read_ledger(tmp_path / "state")
    assert doc is not None and doc["totals"]["load/kafka"] == n


@pytest.mark.crash
def test_kafka_transactions_expire_while_postgres_holds_the_commit_back(
    expiring_kafka: Any, pg_dsn: str, tmp_path: Path
) -> None:
    """Rule 5 during a run, in a job process of its own. Another session holds
    a lock on the PostgreSQL sink's progress table (its commit reads it) for
    longer than the Kafka sink's transaction timeout, so one checkpoint's
    commit waits, and the Kafka transactions of the batches prepared meanwhile
    expire (Apache Kafka aborts them). Once the lock goes, the next checkpoint
    finds them lost before committing any, commits the rest, and the same run
    writes those batches again into Kafka from the input files: the topic and
    the table exact, and the job finishes with no command from an operator."""
    bootstrap = expiring_kafka.bootstrap
    topic = f"t-{uuid.uuid4().hex[:12]}"
    _make_topic(bootstrap, topic)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id int8 PRIMARY KEY, name text, amount float8, part int8)")
    n = write_input(tmp_path / "in", files=5, rows_per_file=60)
    run = Run(tmp_path, pg_dsn, bootstrap, topic, sinks="pg,kafka")
    job = run.start(extra=["--kafka-timeout-ms", "8000"], wait=False)
    deadline = time.monotonic() + 120
    while not _committed_checkpoints(tmp_path / "state"):
        assert job.proc.poll() is None, job.tail(3000)
        assert time.monotonic() < deadline, "no checkpoint committed"
        time.sleep(0.2)
    with psycopg.connect(pg_dsn) as locker:  # a transaction: the lock lasts until rollback
        locker.execute("LOCK TABLE twophase.progress IN ACCESS EXCLUSIVE MODE")
        time.sleep(20)  # the Kafka timeout (8 s) and the broker's abort sweep (1 s), twice
        locker.rollback()
    assert job.wait() == 0, job.tail(6000)
    out = job.output()
    assert "are owed to it: written again from the source" in out, job.tail(6000)
    assert "writing them again from the source now" in out, job.tail(6000)
    run.check(n, owed=True)
    assert sorted(consume_ids(bootstrap, topic, "read_committed")) == list(range(n))


def _committed_checkpoints(state: Path) -> int:
    doc = read_ledger(state)
    return 0 if doc is None else sum(1 for cp in doc["history"] if cp.get("rows"))


def _make_topic(bootstrap: str, topic: str) -> None:
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    from lifecycle.testing.plugin import wait_for_topic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    finally:
        admin.close()
    wait_for_topic(bootstrap, topic, 3)


@pytest.mark.crash
@tiers.SLOW
def test_a_driver_killed_while_it_pays_a_debt_finishes_the_payment(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Killed (SIGKILL) with checkpoint 1 decided; someone rolls back the
    PostgreSQL sink's prepared transactions; the restart owes batch 0 to it,
    writes it again and is killed once that work is recorded, before it
    commits. The next start commits that very work: the rows are in the table
    once, and the batch was written again only once."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id int8 PRIMARY KEY, name text, amount float8, part int8)")
    n = write_input(tmp_path / "in", files=2, rows_per_file=50)
    run = Run(tmp_path, pg_dsn, None, None, sinks="delta,pg")
    first = run.start(fault="driver.before_commit@0=kill")
    assert first.proc.returncode == -signal.SIGKILL, first.tail(3000)
    rollback_prepared(pg_dsn, run.job)
    second = run.start(fault="driver.before_repay=kill")
    assert second.proc.returncode == -signal.SIGKILL, second.tail(3000)
    assert "writing batch 0 of pipeline load again from its source" in second.output()
    third = run.start()
    assert third.proc.returncode == 0, third.tail(5000)
    assert "written again before the last stop, now committed" in third.output()
    assert "writing batch 0 of pipeline load again" not in third.output()
    run.check(n, owed=True)
