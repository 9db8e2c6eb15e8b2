"""Sinks that share a Spark job (:func:`lifecycle.binding.write_plan`): one pass
over each micro-batch writes every sink that needs nothing else of it.

What must hold: every row exactly once in every sink, the batch read by one job
(no second job, nothing persisted), a failure blamed on the sink that failed,
and a failed batch leaving nothing visible in any sink of the shared job.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from lifecycle import Job
from lifecycle.binding import write_plan
from lifecycle.errors import TaskFailedError
from sinks import DeltaSink, KafkaSink, PostgresSink
from tests import deltacheck
from tests.conftest import write_input
from tests.kafkacheck import assert_exactly_once as kafka_exactly_once
from tests.kafkacheck import assert_nothing_open
from tests.pgcheck import assert_exactly_once as pg_exactly_once
from tests.pgcheck import job_prepared

INPUT_SCHEMA = "id long, name string, amount double"
DDL = "CREATE TABLE {t} (id bigint PRIMARY KEY, name text NOT NULL, amount float8)"


def _ids(steps: list[list[object]]) -> list[list[str]]:
    return [[s.sink_id for s in step] for step in steps]  # type: ignore[attr-defined]


def test_the_plan_groups_sinks_by_what_they_need_of_the_batch() -> None:
    dsn = "postgresql://nobody@127.0.0.1:1/none"
    pg = PostgresSink(dsn, "t", sink_id="pg")
    pg_keyed = PostgresSink(dsn, "k", key=["id"], sink_id="pgk")
    pg_keyed_too = PostgresSink(dsn, "k2", key=["id"], sink_id="pgk2")
    kafka = KafkaSink("127.0.0.1:1", "t", sink_id="kafka")
    # appends share one job; the Kafka sink (its work expires) prepares last in it
    assert _ids(write_plan([kafka, pg])) == [["pg", "kafka"]]
    # sinks keyed by the same columns share the shuffle, the rest another job
    plan = _ids(write_plan([pg_keyed, kafka, pg_keyed_too, pg]))
    assert plan == [["pgk", "pgk2"], ["pg", "kafka"]]
    # one sink: one job, as before
    assert _ids(write_plan([pg_keyed])) == [["pgk"]]
    # a keyed sink declared partitioned needs nothing of the batch, but its upserts
    # wait for the earlier batch's commit: Kafka's transactions get a job of their own
    declared = PostgresSink(dsn, "d", key=["id"], partitioned_by_key=True, sink_id="pgd")
    assert _ids(write_plan([declared, pg, kafka])) == [["pgd", "pg"], ["kafka"]]


def _job(spark: SparkSession, tmp_path: Path, sinks: list[object], name: str) -> tuple[Job, str]:
    job_name = f"{name}{uuid.uuid4().hex[:6]}"
    job = Job(spark, job_name, tmp_path / "state", checkpoint_interval=0)
    df = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1)
    job.add_pipeline("load", df.json(str(tmp_path / "in")), sinks, bounded=True)  # type: ignore[arg-type]
    return job, job_name


def _spark_jobs(spark: SparkSession, job: Job) -> int:
    """How many Spark jobs the pipeline's query ran (Spark puts them in a job
    group named after the query's run)."""
    query = job._pipelines["load"].query
    assert query is not None
    return len(spark.sparkContext.statusTracker().getJobIdsForGroup(str(query.runId)))


def _writers(table: Path) -> set[str]:
    """Which Parquet writers wrote the table's files (their ``created_by``)."""
    return {
        str(pq.ParquetFile(p).metadata.created_by).split(" ")[0] for p in table.rglob("*.parquet")
    }


def test_three_sinks_write_each_batch_in_one_job_exactly_once(
    spark: SparkSession,
    tmp_path: Path,
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_topic,  # type: ignore[no-untyped-def]
) -> None:
    n = write_input(tmp_path / "in", files=3, rows_per_file=200)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(DDL.format(t="orders"))
    topic = kafka_topic(2)
    table = tmp_path / "delta"
    sinks = [
        DeltaSink(str(table), create_table=True, sink_id="delta"),
        PostgresSink(pg_dsn, "orders", sink_id="pg"),
        KafkaSink(kafka_bootstrap, topic, key="id", sink_id="kafka"),
    ]
    job, name = _job(spark, tmp_path, sinks, "shared")
    result = job.run(handle_signals=False)
    assert result.committed
    # Delta's Arrow writer joined the others' job (no Spark Parquet writer), and
    # each of the 3 batches ran one Spark job: the shared pre-commit
    assert _ids(write_plan(sinks)) == [["delta", "pg", "kafka"]]
    assert _writers(table) == {"parquet-cpp-arrow"}
    assert _spark_jobs(spark, job) == 3
    deltacheck.assert_exactly_once(table, n)
    deltacheck.assert_nothing_staged(table)
    assert not deltacheck.spark_staging(table)
    pg_exactly_once(pg_dsn, "orders", n)
    assert not job_prepared(pg_dsn, name)
    kafka_exactly_once(kafka_bootstrap, topic, n)
    assert_nothing_open(kafka_bootstrap, topic, name)


def test_a_failure_in_a_shared_job_names_its_sink_and_leaves_nothing_visible(
    spark: SparkSession,
    tmp_path: Path,
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_topic,  # type: ignore[no-untyped-def]
) -> None:
    """A NOT NULL violation in the second of two PostgreSQL sinks fails batch 0
    in the job it shares with the first, Kafka and Delta: the error names that
    sink (not the step's first, nor one whose id is a prefix of its own), and
    no sink shows a row of the batch (Kafka's transaction aborted, Delta's
    files unreferenced)."""
    rows = [{"id": i, "name": None if i == 7 else f"n{i}", "amount": 1.0} for i in range(20)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "part-0.json").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(DDL.format(t="orders"))
        c.execute("CREATE TABLE lenient (id bigint PRIMARY KEY, name text, amount float8)")
    topic = kafka_topic(1)
    table = tmp_path / "delta"
    sinks = [
        KafkaSink(kafka_bootstrap, topic, key="id", sink_id="kafka"),
        PostgresSink(pg_dsn, "lenient", sink_id="pg"),
        PostgresSink(pg_dsn, "orders", sink_id="pg2"),
        DeltaSink(str(table), create_table=True, sink_id="delta"),
    ]
    job, name = _job(spark, tmp_path, sinks, "blame")
    with pytest.raises(TaskFailedError) as e:
        job.run(handle_signals=False)
    assert _ids(write_plan(sinks)) == [["pg", "pg2", "delta", "kafka"]]  # one job
    first = str(e.value).splitlines()[0]
    assert "sink 'pg2'" in first and "batch 0" in first and "NOT NULL" in first, first
    assert not job_prepared(pg_dsn, name)
    with psycopg.connect(pg_dsn) as c:
        assert c.execute("SELECT count(*) FROM orders").fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM lenient").fetchone() == (0,)
    assert_nothing_open(kafka_bootstrap, topic, name)
    kafka_exactly_once(kafka_bootstrap, topic, 0)
    assert deltacheck.read_rows(table).num_rows == 0
