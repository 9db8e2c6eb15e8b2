"""Orders from JSON files into PostgreSQL, Kafka and Delta Lake, exactly once.

    ORDERS_DSN=postgresql://app@127.0.0.1/shop ORDERS_KAFKA=127.0.0.1:9092 \
    ORDERS_DELTA=/data/delta/orders python examples/quickstart.py INPUT_DIR STATE_DIR

Kill it at any moment and run it again with the same STATE_DIR: it recovers,
then goes on, and every order is in every sink once.
"""

import os
import sys

from pyspark.sql import SparkSession

from lifecycle import Job, configure_logging
from sinks import DeltaSink, KafkaSink, PostgresSink


def main(input_dir: str, state_dir: str) -> int:
    configure_logging()
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    orders = spark.readStream.schema("order_id long, customer string, amount double").json(
        input_dir
    )
    job = Job(spark, name="orders", state_dir=state_dir, checkpoint_interval=5.0)
    job.add_pipeline(
        "orders",
        orders,
        sinks=[
            PostgresSink(os.environ["ORDERS_DSN"], "orders", key=["order_id"], create_table=True),
            KafkaSink(os.environ["ORDERS_KAFKA"], "orders", key="order_id", create_topic=True),
            DeltaSink(os.environ["ORDERS_DELTA"]),
        ],
        bounded=True,  # all input is there: run to its end, then one final checkpoint
    )
    result = job.run()  # recovers first, then runs; raises if a pipeline fails
    print(f"committed: {result.committed}, rows: {result.rows_committed}")
    return 0 if result.committed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
