"""What the benchmarks share: their input, their SparkSession, their source."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession


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


def bench_spark(app: str) -> SparkSession:
    """A quiet ``local[2]`` session (the machine the numbers are measured on)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def parquet_stream(spark: SparkSession, directory: Path, files_per_batch: int) -> DataFrame:
    """The input as a bounded stream of ``files_per_batch`` files per micro-batch."""
    schema = spark.read.parquet(str(directory)).schema
    return (
        spark.readStream.schema(schema)
        .option("maxFilesPerTrigger", files_per_batch)
        .parquet(str(directory))
    )
