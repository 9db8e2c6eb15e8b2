"""A user's job: orders from JSON files to PostgreSQL (upsert by order id), Kafka and
Delta Lake, exactly once. Configured by the environment, as a deployed job is:

    ORDERS_INPUT   directory of JSON-lines order files (bounded input)
    ORDERS_STATE   the job's state_dir
    ORDERS_DSN     PostgreSQL DSN (table ``orders`` is created when missing)
    ORDERS_KAFKA   Kafka bootstrap servers; ORDERS_TOPIC the topic
    ORDERS_DELTA   the Delta table's path

``python orders_job.py`` runs it; exit 0 when its final checkpoint committed.
"""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

from lifecycle import Job
from sinks import DeltaSink, KafkaSink, PostgresSink


def main() -> int:
    env = os.environ
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("orders")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    orders = (
        spark.readStream.schema("order_id long, customer string, amount double")
        .option("maxFilesPerTrigger", 1)
        .json(env["ORDERS_INPUT"])
    )
    job = Job(spark, "orders", env["ORDERS_STATE"], checkpoint_interval=1.0, progress="off")
    job.add_pipeline(
        "orders",
        orders,
        [
            PostgresSink(env["ORDERS_DSN"], "orders", key=["order_id"], create_table=True),
            KafkaSink(env["ORDERS_KAFKA"], env["ORDERS_TOPIC"], key="order_id"),
            DeltaSink(env["ORDERS_DELTA"]),
        ],
        bounded=True,
    )
    result = job.run()
    spark.stop()
    return 0 if result.committed else 1


if __name__ == "__main__":
    sys.exit(main())
