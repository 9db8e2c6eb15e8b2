"""SparkSession settings for tests and test jobs (small, local, fast).

Test jobs run on ``local[2,2]`` unless the cluster tests point them at a
standalone cluster (``tests/sparkcluster.py``) through the environment:

* ``TWOPHASE_TEST_MASTER``: the master URL (``spark://127.0.0.1:PORT``);
* ``TWOPHASE_TEST_EXECUTOR_ENV``: the executors' packed Python environment
  (``tests/executor_env.py``), shipped with ``spark.archives`` and run as
  ``./environment/bin/python``, as docs/deploying.md says.

With those set, ``tests/procs.py`` starts the job with ``spark-submit``, which
passes master and archive itself; here only the executors' settings are added.

On a cluster every ``TWOPHASE_*`` variable of the driver (fault injection) is
passed to the executors with ``spark.executorEnv.*``: executors inherit the
Worker's environment, not the driver's.
"""

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


MASTER_ENV = "TWOPHASE_TEST_MASTER"
EXECUTOR_ENV_ENV = "TWOPHASE_TEST_EXECUTOR_ENV"
SPECULATION_ENV = "TWOPHASE_TEST_SPECULATION"
"""set: a cluster job runs with ``spark.speculation`` on, eager (Spark never
speculates in local mode)"""


def make_spark(
    app: str,
    master: str = "local[2,2]",
    jvm_packages: bool = False,
    conf: dict[str, str] | None = None,
) -> SparkSession:
    """A local session (``local[N,F]`` lets a failed task be retried F times),
    or, in a job ``spark-submit`` started on a cluster, that cluster's session.

    ``jvm_packages`` adds delta-spark and Spark's Kafka source to a local session
    when their jars are cached: the tests' own session reads with them; a job
    process asks for them only when it reads Kafka, since they cost each JVM
    start about 1.5 s here. ``conf``: more settings (S3A's, a classpath), set
    last."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # else spark-submit's --master stands
        builder = builder.master(master)
    if os.environ.get(MASTER_ENV):
        builder = (
            builder.config("spark.executor.memory", "1g")
            .config("spark.executor.cores", "1")
            .config("spark.task.maxFailures", "4")
        )
        for k, v in os.environ.items():
            if k.startswith("TWOPHASE_") and k not in (MASTER_ENV, EXECUTOR_ENV_ENV):
                builder = builder.config(f"spark.executorEnv.{k}", v)
        if os.environ.get(SPECULATION_ENV):
            builder = (
                builder.config("spark.speculation", "true")
                .config("spark.speculation.interval", "100ms")
                .config("spark.speculation.quantile", "0.5")
                .config("spark.speculation.multiplier", "1.5")
                .config("spark.speculation.minTaskRuntime", "500ms")
            )
    if jvm_packages and "PYSPARK_GATEWAY_PORT" not in os.environ:
        # A local session gets delta-spark and Spark's Kafka source when their jars are
        # cached (lifecycle/testing/jars.py); spark-submit's driver JVM is started already.
        builder = _with_jvm_packages(builder)
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    return (
        builder.appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.streaming.schemaInference", "false")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )


def _with_jvm_packages(builder: SparkSession.Builder) -> SparkSession.Builder:
    from lifecycle.testing import jars

    found = [
        str(p) for name in ("delta", "spark-kafka") if jars.available(name) for p in jars.jars(name)
    ]
    if found:
        builder = builder.config("spark.jars", ",".join(found))
    if jars.available("delta"):
        for k, v in jars.DELTA_SQL_CONF.items():
            builder = builder.config(k, v)
        # delta-spark rebuilds a snapshot (each version read, each DML) in a shuffle of
        # 50 partitions by default; the tests' tables hold a handful of files, and on
        # two cores one partition makes a versionAsOf read about three times faster
        builder = builder.config("spark.databricks.delta.snapshotPartitions", "1")
        # and VACUUM lists a table's directories in as many tasks as this (10,000)
        builder = builder.config("spark.sql.sources.parallelPartitionDiscovery.parallelism", "2")
    return builder


def delta_spark_available() -> bool:
    """Whether the test sessions have delta-spark (its jars are cached)."""
    from lifecycle.testing import jars

    return jars.available("delta")


EVENT_SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("ts", TimestampType()),
        StructField("amount", DoubleType()),
    ]
)
