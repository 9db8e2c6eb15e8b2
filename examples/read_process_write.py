"""Read-process-write: Kafka in; Kafka, PostgreSQL and Delta Lake out, exactly once.

One job, two pipelines, both reading Apache Kafka with Spark's own Kafka
source (``spark.readStream.format("kafka")``, the ``spark-sql-kafka-0-10``
jar; ``python -m lifecycle.testing.jars fetch spark-kafka`` caches it):

* ``history`` (bounded): topic ``orders-history`` holds every past order
  before the job starts. It is read available-now, ends, and its output waits
  for the job's one shared final checkpoint; a restart after that checkpoint
  does not read it again.
* ``live`` (unbounded): topic ``orders-live``, read as orders arrive, until
  the job is drained (``twophase stop --drain STATE_DIR``, or SIGTERM).

Both price each order (JSON ``{"id", "customer", "amount"}`` -> plus
``cents`` and the pipeline it came from) and write it to three places:

* the Kafka topic ``orders-priced`` (key ``id``), in Kafka transactions that
  commit with the job's checkpoints; read it downstream with
  ``isolation.level=read_committed`` (Spark: ``kafka.isolation.level``),
  or a reader sees the records of aborted attempts too;
* the PostgreSQL table ``orders_priced`` (created from the DataFrame);
* the Delta table ``DELTA_DIR``.

Spark's Kafka source is read with ``kafka.isolation.level=read_committed``
too: an upstream transactional producer's aborted records never enter the
job. ``failOnDataLoss`` stays on: an input offset that retention removed
before the job read it stops the job instead of skipping rows.

    python examples/read_process_write.py --bootstrap HOST:PORT \\
        --dsn postgresql://... --delta DELTA_DIR --state STATE_DIR

The job's lag is visible to Kafka's tools: after each checkpoint, each
pipeline's committed offsets go to the consumer group
``twophase.orders-rpw.history`` / ``twophase.orders-rpw.live``
(``kafka-consumer-groups.sh --describe --group ...``; monitoring only, the
job never reads them: ``add_pipeline(source_offsets_group=...)``).

Run it, stop it, SIGKILL it, run it again: each order of both topics is in
each of the three sinks once (``tests/test_kafka_source.py`` does exactly
that, at random instants and at the commit protocol's dangerous points).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lifecycle import Job, JobResult
from sinks import DeltaSink, KafkaSink, PostgresSink

HISTORY = "orders-history"
LIVE = "orders-live"
PRICED = "orders-priced"
ORDER = "id long, customer string, amount double"


def kafka_input(spark: SparkSession, bootstrap: str, topic: str, per_batch: int) -> DataFrame:
    """Spark's Kafka source over ``topic``, from its first offset, at most
    ``per_batch`` records a micro-batch, committed records only."""
    return (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", per_batch)
        .option("kafka.isolation.level", "read_committed")
        .option("failOnDataLoss", "true")
        .load()
    )


def priced(records: DataFrame, pipeline: str) -> DataFrame:
    """The processing: parse each record's JSON value and price the order."""
    order = F.from_json(F.col("value").cast("string"), ORDER)
    return records.select(order.alias("o")).select(
        "o.id",
        "o.customer",
        "o.amount",
        F.round(F.col("o.amount") * 100).cast("long").alias("cents"),
        F.lit(pipeline).alias("source"),
    )


def build(
    spark: SparkSession,
    *,
    bootstrap: str,
    dsn: str,
    delta: str,
    state: str,
    name: str = "orders-rpw",
    topics: tuple[str, str, str] = (HISTORY, LIVE, PRICED),
    table: str = "orders_priced",
    per_batch: int = 200,
) -> Job:
    """The job: two pipelines, each writing the same three sinks (``topics``:
    the history, live and priced topics)."""
    history, live, out = topics
    job = Job(spark, name, state, checkpoint_interval=1.0)
    for pipeline, topic, bounded in (("history", history, True), ("live", live, False)):
        job.add_pipeline(
            pipeline,
            priced(kafka_input(spark, bootstrap, topic, per_batch), pipeline),
            [
                KafkaSink(bootstrap, out, key="id", sink_id="kafka"),
                PostgresSink(dsn, table, create_table=True, sink_id="pg"),
                DeltaSink(delta, sink_id="delta"),
            ],
            bounded=bounded,
            trigger_interval=0.5,
        )
    return job


def session(name: str) -> SparkSession:
    """A local session with Spark's Kafka source (from the jars' cache, when
    ``spark.jars.packages`` cannot reach Maven Central)."""
    from lifecycle.testing import jars

    builder = SparkSession.builder.master("local[2]").appName(name)
    if jars.available("spark-kafka"):
        builder = builder.config("spark.jars", jars.classpath("spark-kafka"))
    return builder.config("spark.ui.enabled", "false").getOrCreate()


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--delta", required=True)
    ap.add_argument("--state", required=True)
    args = ap.parse_args()
    spark = session("orders-rpw")
    result: JobResult = build(
        spark, bootstrap=args.bootstrap, dsn=args.dsn, delta=args.delta, state=args.state
    ).run()
    print(result)
    spark.stop()
    return 0 if result.committed else 1


if __name__ == "__main__":
    sys.exit(main())
