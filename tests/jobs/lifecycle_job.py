"""A job of several pipelines writing to PostgreSQL, run as its own driver
process by the lifecycle tests (which SIGKILL it, SIGTERM it, or stop it with
``twophase stop``).

    --pipeline name=load,input=DIR,table=T,kind=bounded|unbounded|windowed[,files=K]
    --pipeline name=big,input=DIR,sink=delta,path=TABLE_DIR,kind=bounded
    --pipeline name=mid,input=DIR,sink=kafka,topic=T,kind=bounded   (with --bootstrap)

``windowed`` is a bounded event-time aggregation: 10-minute windows of rows
{id, ts, amount} with a 5-minute watermark, flushed at end of input.
Exit status 0 only when the run committed (``JobResult.committed``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from lifecycle import Job
from sinks import DeltaSink, KafkaSink, PostgresSink, Sink
from tests.jobs._driver import finish, probe_executors, start_driver
from tests.sparkutil import EVENT_SCHEMA, INPUT_SCHEMA


def windowed(df: DataFrame) -> DataFrame:
    """Event-time windows, as the lifecycle tests expect them."""
    return (
        df.withWatermark("ts", "5 minutes")
        .groupBy(F.window("ts", "10 minutes"))
        .agg(F.count("*").alias("n"), F.sum("amount").alias("total"))
        .select(
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            "n",
            "total",
        )
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", default=None)
    ap.add_argument("--bootstrap", default=None)
    ap.add_argument("--state", required=True)
    ap.add_argument("--job", default="life")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--final", default="shared")
    ap.add_argument("--stop-grace", type=float, default=10.0)
    ap.add_argument("--pipeline", action="append", default=[])
    ap.add_argument("--probe", default=None, help="a driver-side path executors must not see")
    ap.add_argument("--ledger", default=None, help="the ledger's directory (state on a URI)")
    args = ap.parse_args()
    spark = start_driver(args.job)
    if args.probe:
        probe_executors(spark, args.probe)
    job = Job(
        spark,
        args.job,
        args.state,
        checkpoint_interval=args.interval,
        final_checkpoint=args.final,
        stop_grace=args.stop_grace,
        ledger=args.ledger,
    )
    for spec in args.pipeline:
        opts = dict(kv.split("=", 1) for kv in spec.split(","))
        kind = opts["kind"]
        files = int(opts.get("files", 1))
        sink: Sink
        target = opts.get("sink", "pg")
        if target == "delta":
            sink = DeltaSink(opts["path"])
        elif target == "kafka":
            sink = KafkaSink(args.bootstrap, opts["topic"], key="id")
        else:
            sink = PostgresSink(args.dsn, opts["table"])
        if kind == "windowed":
            src = (
                spark.readStream.schema(EVENT_SCHEMA)
                .option("maxFilesPerTrigger", files)
                .json(opts["input"])
            )
            job.add_pipeline(
                opts["name"], src, [sink], bounded=True, transform=windowed, event_time="ts"
            )
        else:
            src = (
                spark.readStream.schema(INPUT_SCHEMA)
                .option("maxFilesPerTrigger", files)
                .json(opts["input"])
            )
            job.add_pipeline(
                opts["name"], src, [sink], bounded=kind == "bounded", trigger_interval=0.5
            )
    return finish(spark, job.run())


if __name__ == "__main__":
    sys.exit(main())
