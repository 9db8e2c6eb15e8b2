"""SparkSession settings for tests and test jobs (small, local, fast)."""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession
from pyspark.sql.types import (
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

INPUT_SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("name", StringType()),
        StructField("amount", DoubleType()),
    ]
)


def make_spark(app: str, master: str = "local[2,2]") -> SparkSession:
    """A local session; ``local[N,F]`` lets a failed task be retried (F attempts)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.streaming.schemaInference", "false")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )


EVENT_SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("ts", TimestampType()),
        StructField("amount", DoubleType()),
    ]
)
