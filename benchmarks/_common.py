"""What the benchmarks share: their input, their SparkSession, their source."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession

from lifecycle import Job
from lifecycle.ledger import read_ledger
from sinks.base import Sink


def make_input(directory: Path, rows: int, files: int) -> None:
    """Parquet files of rows {id, name, amount, qty}, ids 0..rows-1."""
    directory.mkdir(parents=True)
    per = rows // files
    for f in range(files):
        start = f * per
        n = per if f < files - 1 else rows - start
        r = range(start, start + n)
        table = pa.table(
            {
                "id": pa.array(r, pa.int64()),
                "name": pa.array([f"customer-{i % 1000}" for i in r]),
                "amount": pa.array([i * 0.25 for i in r], pa.float64()),
                "qty": pa.array([i % 50 for i in r], pa.int32()),
            }
        )
        pq.write_table(table, directory / f"part-{f:04d}.parquet")


def add_conf_option(ap: argparse.ArgumentParser) -> None:
    """``--conf KEY=VALUE`` (repeatable): a Spark setting of the session, for
    :func:`bench_spark`'s ``conf``."""
    ap.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting of the session (e.g. delta-spark's "
        "spark.databricks.delta.snapshotPartitions=2, which its defaults leave at 50)",
    )


def bench_spark(
    app: str,
    *,
    jar_sets: Sequence[str] = (),
    conf: Sequence[str] = (),
    start_conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A quiet ``local[2]`` session (the machine the numbers are measured on),
    with the cached jars of ``jar_sets`` (``python -m lifecycle.testing.jars
    fetch`` caches them): ``delta`` also gets delta-spark's SQL extension, as
    its users run it; ``jdbc`` is the PostgreSQL JDBC driver. ``conf``: more
    settings, each ``KEY=VALUE`` (:func:`add_conf_option`); ``start_conf``:
    settings that must be there before the JVM starts (a driver class path,
    Hadoop's ``spark.hadoop.*``)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
    )
    if jar_sets:
        from lifecycle.testing import jars

        found = [str(p) for name in jar_sets for p in jars.jars(name)]
        builder = builder.config("spark.jars", ",".join(found))
        if "delta" in jar_sets:
            for k, v in jars.DELTA_SQL_CONF.items():
                builder = builder.config(k, v)
    for k, v in (start_conf or {}).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    for kv in conf:
        key, _, value = kv.partition("=")
        spark.conf.set(key, value)
    return spark


def parquet_stream(spark: SparkSession, directory: Path, files_per_batch: int) -> DataFrame:
    """The input as a bounded stream of ``files_per_batch`` files per micro-batch."""
    schema = spark.read.parquet(str(directory)).schema
    return (
        spark.readStream.schema(schema)
        .option("maxFilesPerTrigger", files_per_batch)
        .parquet(str(directory))
    )


def time_foreach_batch(
    src: DataFrame, each: Callable[[DataFrame, int], None], checkpoint: Path
) -> float:
    """Seconds to run ``src`` to its end through a plain ``foreachBatch`` (the baselines)."""
    t0 = time.perf_counter()
    query = (
        src.writeStream.foreachBatch(each)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return time.perf_counter() - t0


def time_job(
    spark: SparkSession, src: DataFrame, sink: Sink, state: Path, interval: float
) -> float:
    """Seconds to run ``src`` to its end through ``sink`` in a Job (exactly-once)."""
    job = Job(spark, "bench", state, checkpoint_interval=interval)
    job.add_pipeline("load", src, [sink], bounded=True)
    t0 = time.perf_counter()
    result = job.run(handle_signals=False)
    secs = time.perf_counter() - t0
    assert result.committed, result
    return secs


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank (of 30 values, p99
    is the greatest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def commit_latencies(state: Path) -> list[float]:
    """``committed_at - decided_at`` of each checkpoint of the job at ``state``
    that committed rows."""
    doc = read_ledger(state)
    assert doc is not None, f"no ledger in {state}"
    return [
        cp["committed_at"] - cp["decided_at"]
        for cp in doc["history"]
        if cp.get("committed_at") is not None and sum(cp.get("rows", {}).values()) > 0
    ]
