"""A bounded PySpark job whose one pipeline writes the same batches to
PostgreSQL, Kafka and Delta; run as a separate driver process by the Delta
crash tests (which SIGKILL it). Modelled on ``pg_job.py``.

Rows are the input's {id, name, amount} plus ``part`` (id % 3), the Delta
table's partition column. Sinks (``--sinks``, a comma-separated subset, in
commit order): ``pg`` (table ``--table`` of ``--dsn``, which must exist),
``kafka`` (topic ``--topic`` at ``--bootstrap``, key ``id``), ``delta`` (table
``--delta``, created on first use, partitioned by ``part``).
``--kafka-timeout-ms`` gives the Kafka sink a transaction timeout below what
its preflight accepts: a broker then aborts a transaction while the driver is
down for seconds, standing for a driver down longer than the preflight's
allowance for a restart (the expiry tests of ``tests/test_lost_work.py``).
``--input``, ``--state`` and ``--delta`` may be URIs (``hdfs://``, ``s3://``
for the table, with deltalake's ``--delta-options`` as JSON; ``--ledger`` then
names the ledger). ``--read-back URI``: once the run committed, delta-spark
reads the table at ``URI`` (``s3a://...`` for an ``s3://`` table; the session
needs delta-spark's jars and, for ``s3a://``, S3A's) and the job prints
``READ {"ids": [...]}``, the ids it read, sorted.
Exit status 0 only when the run committed (``JobResult.committed``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from lifecycle import Job
from sinks import DeltaSink, KafkaSink, PostgresSink, Sink
from tests.jobs._driver import finish, probe_executors, start_driver
from tests.sparkutil import INPUT_SCHEMA

SINK_IDS = {"pg": "pg", "kafka": "kafka", "delta": "delta"}


class _ShortTimeoutKafkaSink(KafkaSink):
    """A KafkaSink whose timeout is not checked against the checkpoint interval."""

    def check_checkpoint_interval(self, checkpoint_interval_s: float, **_: float) -> None:
        pass


def read_back(spark: SparkSession, uri: str) -> None:
    """Print ``READ {"ids": [...]}``: the ids delta-spark reads of the table at ``uri``."""
    rows = spark.read.format("delta").load(uri).select("id").collect()
    print("READ " + json.dumps({"ids": sorted(int(r["id"]) for r in rows)}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", default=None)
    ap.add_argument("--bootstrap", default=None)
    ap.add_argument("--topic", default=None)
    ap.add_argument("--delta", default=None)
    ap.add_argument("--state", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--table", default="orders")
    ap.add_argument("--job", default="multi")
    ap.add_argument("--interval", type=float, default=0.0)
    ap.add_argument("--files-per-batch", type=int, default=1)
    ap.add_argument("--sinks", default="pg,kafka,delta")
    ap.add_argument("--commit-timeout", type=float, default=120.0, help="the Kafka sink's")
    ap.add_argument("--start-over-from", default=None)
    ap.add_argument("--kafka-timeout-ms", type=int, default=None)
    ap.add_argument(
        "--ledger",
        default=None,
        help="Job(ledger=...): a PostgreSQL URI or a local directory (state on a URI)",
    )
    ap.add_argument("--delta-write-with", default="auto", help="DeltaSink(write_with=...)")
    ap.add_argument("--delta-options", default=None, help="DeltaSink(storage_options=...), JSON")
    ap.add_argument("--read-back", default=None, help="a URI delta-spark reads the table at")
    ap.add_argument("--probe", default=None, help="a driver-side path executors must not see")
    ap.add_argument("--partitions", type=int, default=None, help="repartition each batch")
    args = ap.parse_args()
    spark = start_driver(args.job)
    if args.probe:
        probe_executors(spark, args.probe)
    df = (
        spark.readStream.schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", args.files_per_batch)
        .json(args.input)
        .withColumn("part", F.col("id") % 3)
    )
    if args.partitions:
        df = df.repartition(args.partitions)
    sinks: list[Sink] = []
    for kind in args.sinks.split(","):
        needs = {"pg": ["dsn"], "kafka": ["bootstrap", "topic"], "delta": ["delta"]}.get(kind, [])
        for what in needs:
            if not getattr(args, what):
                ap.error(f"--sinks {kind} needs --{what}")
        if kind == "pg":
            sinks.append(PostgresSink(args.dsn, args.table, sink_id=SINK_IDS["pg"]))
        elif kind == "kafka":
            timeout = (
                {"transaction_timeout_ms": args.kafka_timeout_ms} if args.kafka_timeout_ms else {}
            )
            kind_of = _ShortTimeoutKafkaSink if timeout else KafkaSink
            sinks.append(
                kind_of(
                    args.bootstrap,
                    args.topic,
                    key="id",
                    sink_id=SINK_IDS["kafka"],
                    commit_timeout=args.commit_timeout,
                    **timeout,
                )
            )
        elif kind == "delta":
            sinks.append(
                DeltaSink(
                    args.delta,
                    partition_by=["part"],
                    sink_id=SINK_IDS["delta"],
                    write_with=args.delta_write_with,
                    storage_options=json.loads(args.delta_options or "{}"),
                )
            )
        else:
            ap.error(f"unknown sink {kind!r}")
    job = Job(
        spark,
        args.job,
        args.state,
        checkpoint_interval=args.interval,
        start_over_from=args.start_over_from,
        ledger=args.ledger,
    )
    job.add_pipeline("load", df, sinks, bounded=True)
    result = job.run()
    if args.read_back and result.committed:
        read_back(spark, args.read_back)
    return finish(spark, result)


if __name__ == "__main__":
    sys.exit(main())
