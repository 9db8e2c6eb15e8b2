"""What every test job script does around its Job: set up the driver process,
and report the result on one ``RESULT {json}`` line that the tests parse."""

from __future__ import annotations

import json
import os

from pyspark.sql import SparkSession

from lifecycle import JobResult, configure_logging
from tests.sparkutil import make_spark


def start_driver(
    job: str, jvm_packages: bool = False, conf: dict[str, str] | None = None
) -> SparkSession:
    """Logging, the driver pid for executor-side faults, and a SparkSession
    (``jvm_packages``: with Spark's Kafka source and delta-spark, for a job that
    reads Kafka; ``conf``: more settings of the session)."""
    os.environ["TWOPHASE_DRIVER_PID"] = str(os.getpid())
    configure_logging()
    spark = make_spark(f"job-{job}", jvm_packages=jvm_packages, conf=conf)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def probe_executors(spark: SparkSession, driver_path: str) -> None:
    """Print one ``EXECUTORS [json]`` line: for a few tasks, where the executor's
    Python imported ``sinks`` from, its interpreter and working directory, and
    whether ``driver_path`` (a path on the driver's disk) is visible to it."""

    def probe(_: object) -> object:
        import os
        import sys

        import sinks

        yield {
            "sinks": sinks.__file__,
            "python": sys.executable,
            "cwd": os.getcwd(),
            "sees_driver_path": os.path.exists(driver_path),
        }

    rows = spark.sparkContext.parallelize(range(4), 4).mapPartitions(probe).collect()
    print("EXECUTORS " + json.dumps(rows), flush=True)


def finish(spark: SparkSession, result: JobResult) -> int:
    """Print the RESULT line, stop Spark; exit status 0 only if the run committed."""
    summary = {
        "checkpoints": result.checkpoints,
        "rows": result.rows_committed,
        "final": result.final_checkpoint,
        "committed": result.committed,
        "drained": result.drained,
        "stopped": result.stopped,
        "end_of_input_to_exit": result.end_of_input_to_exit,
        "pipelines": {k: v.value for k, v in result.pipelines.items()},
    }
    print("RESULT " + json.dumps(summary), flush=True)
    spark.stop()
    return 0 if result.committed else 1
