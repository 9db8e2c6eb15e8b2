"""Keyed PostgreSQL writes without the shuffle by key, through real Spark jobs.

A keyed sink has its batch repartitioned by its key so that one key is
written by one task (:func:`lifecycle.binding.precommit`). These tests show,
by the physical plans Spark ran, that a batch whose plan already keeps each
key in one partition (hash-partitioned by a part of the key) is written
without that shuffle and one that is not is still shuffled; and that a user's
declaration (``PostgresSink(partitioned_by_key=True)``) skips it, writes every
row once when true, and when false fails the batch in seconds with the batch
and the declaration named (:mod:`sinks.postgres.lock_watch`), never after the
``lock_timeout``, leaving nothing committed, and nothing prepared once the
next start has recovered. Writer by writer (no Spark): a task waiting for an
earlier batch's prepared key goes on waiting past the watch's looks and
finishes once that batch commits; one waiting for its own batch fails.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from lifecycle import Job, TaskFailedError
from lifecycle.partitioning import clustered_by
from sinks import ConfigError, KeySpansTasksError, PostgresSink
from sinks.base import Committable, JobScope, WriteContext
from tests.pgcheck import job_prepared
from tests.sparkutil import INPUT_SCHEMA

REPARTITION = "REPARTITION_BY_COL"
"""how Spark's plans name the shuffle of a ``DataFrame.repartition(columns)``"""


def _rows(dsn: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as c:
        return c.execute(query).fetchall()


def _json_rows(path: Path, name: str, rows: list[dict[str, object]]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def _executions(spark: SparkSession) -> list[tuple[int, str]]:
    """Every SQL execution of the session so far: its id and physical plan."""
    listed = spark._jsparkSession.sharedState().statusStore().executionsList()
    out = []
    for i in range(listed.size()):
        e = listed.apply(i)
        out.append((int(e.executionId()), str(e.physicalPlanDescription())))
    return out


def _write_plans(spark: SparkSession, after: int) -> list[str]:
    """The plans of the sinks' writes (``mapInArrow``) since execution ``after``."""
    return [p for i, p in _executions(spark) if i > after and "MapInArrow" in p]


def _last_execution(spark: SparkSession) -> int:
    return max((i for i, _ in _executions(spark)), default=-1)


def test_the_plan_is_read_by_attribute_identity(spark: SparkSession) -> None:
    base = spark.range(0, 200).select(
        (F.col("id") % 20).alias("a"), (F.col("id") % 7).alias("b"), F.col("id").alias("v")
    )
    by_a = base.groupBy("a").agg(F.sum("v").alias("s")).withColumn("b", F.col("s") % 3)
    assert clustered_by(by_a, ["a", "b"])  # hash-partitioned by a part of the key
    assert clustered_by(by_a, ["a"])  # by the key itself
    assert clustered_by(by_a.withColumnRenamed("a", "renamed"), ["renamed", "b"])
    assert not clustered_by(by_a, ["b"])  # another column
    assert not clustered_by(by_a, ["A", "b"])  # a name that is no column of it, exactly
    assert not clustered_by(by_a.withColumn("a", F.col("a") + 1), ["a"])  # a new column "a"
    assert not clustered_by(base, ["a"])  # partitioned by nothing of the key
    assert not clustered_by(base, [])
    other = base.select("a", F.col("v").alias("w"))
    spark.conf.set("spark.sql.autoBroadcastJoinThreshold", "-1")
    try:  # a sort-merge join by a: adaptive execution may split a skewed partition
        assert not clustered_by(base.join(other, "a"), ["a"])
    finally:
        spark.conf.unset("spark.sql.autoBroadcastJoinThreshold")


def _aggregating_job(
    spark: SparkSession, dsn: str, tmp_path: Path, name: str, key: list[str]
) -> Job:
    """Orders summed per customer in update mode: each batch's rows are
    hash-partitioned by ``name`` (Spark's state store partitions)."""
    _json_rows(
        tmp_path / "in",
        "part-0.json",
        [{"id": i, "name": f"c{i % 40}", "amount": float(i)} for i in range(400)],
    )
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "CREATE TABLE totals (name text, orders bigint, amount float8, "
            f"PRIMARY KEY ({', '.join(key)}))"
        )
    sink = PostgresSink(dsn, "totals", key=key)
    job = Job(spark, name, tmp_path / "state", checkpoint_interval=0)
    df = spark.readStream.schema(INPUT_SCHEMA).json(str(tmp_path / "in"))

    def totals(d: DataFrame) -> DataFrame:
        return d.groupBy("name").agg(F.count("*").alias("orders"), F.sum("amount").alias("amount"))

    job.add_pipeline("sum", df, [sink], bounded=True, output_mode="update", transform=totals)
    return job


@pytest.mark.parametrize("key", [["name"], ["name", "orders"]], ids=["key", "part-of-key"])
def test_a_batch_aggregated_by_the_key_or_a_part_of_it_is_not_shuffled_again(
    spark: SparkSession, pg_dsn: str, tmp_path: Path, key: list[str]
) -> None:
    before = _last_execution(spark)
    _aggregating_job(spark, pg_dsn, tmp_path, "agg", key).run()
    plans = _write_plans(spark, before)
    assert plans and all(REPARTITION not in p for p in plans), plans
    assert _rows(pg_dsn, "SELECT count(*), sum(orders), sum(amount) FROM totals") == [
        (40, 400, float(sum(range(400))))
    ]
    assert job_prepared(pg_dsn, "agg") == []


def test_a_batch_not_partitioned_by_the_key_is_shuffled(
    spark: SparkSession, pg_dsn: str, tmp_path: Path
) -> None:
    _json_rows(tmp_path / "in", "part-0.json", [{"id": i, "name": "x"} for i in range(100)])
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, name text, amount float8)")
    before = _last_execution(spark)
    job = Job(spark, "plain", tmp_path / "state", checkpoint_interval=0)
    df = spark.readStream.schema(INPUT_SCHEMA).json(str(tmp_path / "in"))
    job.add_pipeline("load", df, [PostgresSink(pg_dsn, "t", key=["id"])], bounded=True)
    job.run()
    plans = _write_plans(spark, before)
    assert plans and all(REPARTITION in p for p in plans), plans
    assert _rows(pg_dsn, "SELECT count(*), count(DISTINCT id) FROM t") == [(100, 100)]


def test_the_declaration_needs_a_key_and_no_deletes() -> None:
    with pytest.raises(ConfigError, match="partitioned_by_key=True needs key="):
        PostgresSink("host=127.0.0.1", "t", partitioned_by_key=True)
    with pytest.raises(ConfigError, match="no delete_when"):
        PostgresSink("host=127.0.0.1", "t", key=["id"], partitioned_by_key=True, delete_when="d")
    sink = PostgresSink("host=127.0.0.1", "t", key=["id"], partitioned_by_key=True)
    assert sink.partition_columns() is None
    again = PostgresSink.from_settings(sink.settings(), {})
    assert again.partitioned_by_key and again.partition_columns() is None


def _declared_job(
    spark: SparkSession, dsn: str, tmp_path: Path, transform: Any, lock_timeout: float
) -> Job:
    sink = PostgresSink(
        dsn,
        "t",
        key=["id"],
        order_by="amount",
        partitioned_by_key=True,
        lock_timeout=lock_timeout,
        sink_id="pg",
    )
    job = Job(spark, "declared", tmp_path / "state", checkpoint_interval=0)
    df = spark.readStream.schema(INPUT_SCHEMA).json(str(tmp_path / "in"))
    job.add_pipeline("load", df, [sink], bounded=True, transform=transform)
    return job


class _FirstPrepared:
    """Notes when a transaction whose gid starts with ``prefix`` is first
    prepared (polled every 50 ms while the ``with`` block runs)."""

    def __init__(self, dsn: str, prefix: str) -> None:
        self.dsn, self.prefix = dsn, prefix
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> _FirstPrepared:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            while self.at is None and not self._stop.wait(0.05):
                q = "SELECT 1 FROM pg_prepared_xacts WHERE starts_with(gid, %s)"
                if c.execute(q, (self.prefix,)).fetchone() is not None:
                    self.at = time.monotonic()


def test_a_wrong_declaration_fails_in_seconds_and_a_true_one_writes_each_row_once(
    spark: SparkSession, pg_dsn: str, tmp_path: Path
) -> None:
    """Every id twice, amount 0 and 1 (the greater wins), the batch split in
    two tasks by amount: every id spans both. The task that waits for the
    other's prepared transaction must fail within seconds, not after the 60 s
    lock_timeout; the next start, with the batch partitioned by id, rolls the
    other task's work back and writes every id once."""
    for n in range(2):
        rows = [{"id": i, "name": f"n{i}", "amount": float(n)} for i in range(200)]
        _json_rows(tmp_path / "in", f"part-{n}.json", rows)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, name text, amount float8)")
    wrong = _declared_job(
        spark, pg_dsn, tmp_path, lambda d: d.repartitionByRange(2, "amount"), 60.0
    )
    first = _FirstPrepared(pg_dsn, "tp2.declared.")
    with first, pytest.raises(TaskFailedError) as e:
        wrong.run()
    assert first.at is not None, "no task of the batch prepared"
    took = time.monotonic() - first.at  # the wait began after a task prepared
    message = str(e.value)
    assert "KeySpansTasksError" in message or "writes one key in two of its tasks" in message
    assert "batch 0 writes one key in two of its tasks" in message, message
    assert "partitioned_by_key=True" in message and "PostgreSQL table public.t" in message
    assert took < 20, f"failed {took:.1f}s after the first prepare, lock_timeout is 60s"
    assert _rows(pg_dsn, "SELECT count(*) FROM t") == [(0,)]

    right = _declared_job(spark, pg_dsn, tmp_path, lambda d: d.repartition(2, "id"), 60.0)
    right.run()
    assert _rows(pg_dsn, "SELECT count(*), count(DISTINCT id), min(amount) FROM t") == [
        (200, 200, 1.0)
    ]
    assert job_prepared(pg_dsn, "declared") == []


def _prepare(sink: PostgresSink, batch_id: int, partition: int, ids: list[int]) -> Committable:
    """One task of ``batch_id``: upsert ``ids`` and prepare."""
    scope = JobScope("writers", "p", sink.sink_id, "0123456789ab")
    ctx = WriteContext(scope, 1, batch_id, partition, batch_id * 10 + partition)
    w = sink.open_writer(ctx, _SCHEMA)
    failed = True
    try:
        w.write(pa.RecordBatch.from_pydict({"id": ids, "v": [batch_id] * len(ids)}, _SCHEMA))
        c = w.prepare()
        failed = False
    finally:
        w.close(failed=failed)
    assert c is not None
    return c


_SCHEMA = pa.schema([pa.field("id", pa.int64()), pa.field("v", pa.int64())])


def _writers_sink(dsn: str) -> PostgresSink:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE w (id bigint PRIMARY KEY, v bigint)")
    sink = PostgresSink(dsn, "w", key=["id"], partitioned_by_key=True, lock_timeout=60)
    sink.preflight(_SCHEMA)
    sink.committer().claim(JobScope("writers", "p", sink.sink_id, "0123456789ab"))
    return sink


def test_a_wait_for_an_earlier_batch_goes_on_until_its_commit(pg_dsn: str) -> None:
    sink = _writers_sink(pg_dsn)
    earlier = _prepare(sink, 0, 0, [1, 2, 3])
    with ThreadPoolExecutor(1) as pool:
        later = pool.submit(_prepare, sink, 1, 1, [3, 4])
        time.sleep(3.5)  # past the watch's first look and two more
        assert not later.done(), later.exception() if later.done() else None
        sink.committer().commit([earlier])
        committed = later.result(timeout=30)
    sink.committer().commit([committed])
    assert _rows(pg_dsn, "SELECT id, v FROM w ORDER BY id") == [(1, 0), (2, 0), (3, 1), (4, 1)]


def test_a_wait_for_another_task_of_the_batch_fails_in_seconds(pg_dsn: str) -> None:
    sink = _writers_sink(pg_dsn)
    other = _prepare(sink, 0, 0, [1, 2, 3])
    started = time.monotonic()
    with pytest.raises(KeySpansTasksError) as e:
        _prepare(sink, 0, 1, [3, 4])
    took = time.monotonic() - started
    assert took < 10, f"failed after {took:.1f}s, lock_timeout is 60s"
    assert f"waited for the prepared transaction {other['txn']} of the same batch" in str(e.value)
    assert "partitioned_by_key=True" in str(e.value)
    sink.committer().abort([other])
    assert _rows(pg_dsn, "SELECT count(*) FROM w") == [(0,)]
    assert job_prepared(pg_dsn, "writers") == []
