"""A bounded PySpark job writing JSON input files to Kafka (and, with --dsn, to
PostgreSQL from the same pipeline); run as a separate driver process by the
Kafka crash tests (which SIGKILL it). Modelled on ``pg_job.py``.

    --sinks kafka        KafkaSink only (default)
    --sinks kafka,pg     both, committed in this order (needs --dsn)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lifecycle import Job
from sinks import KafkaSink, PostgresSink, Sink
from tests.sparkutil import INPUT_SCHEMA, make_spark


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--job", default="kcrash")
    ap.add_argument("--interval", type=float, default=0.0)
    ap.add_argument("--files-per-batch", type=int, default=1)
    ap.add_argument("--sinks", default="kafka")
    ap.add_argument("--dsn", default=None)
    ap.add_argument("--table", default="orders")
    args = ap.parse_args()
    os.environ["TWOPHASE_DRIVER_PID"] = str(os.getpid())  # for executor-side faults
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    spark = make_spark(f"job-{args.job}")
    spark.sparkContext.setLogLevel("ERROR")
    df = (
        spark.readStream.schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", args.files_per_batch)
        .json(args.input)
    )
    sinks: list[Sink] = []
    for kind in args.sinks.split(","):
        if kind == "kafka":
            sinks.append(KafkaSink(args.bootstrap, args.topic, key="id", commit_timeout=120))
        elif kind == "pg":
            if not args.dsn:
                ap.error("--sinks pg needs --dsn")
            sinks.append(PostgresSink(args.dsn, args.table))
        else:
            ap.error(f"unknown sink {kind!r}")
    job = Job(spark, args.job, args.state, checkpoint_interval=args.interval)
    job.add_pipeline("load", df, sinks, bounded=True)
    result = job.run()
    print(
        "RESULT "
        + json.dumps(
            {
                "checkpoints": result.checkpoints,
                "rows": result.rows_committed,
                "final": result.final_checkpoint,
                "committed": result.committed,
            }
        ),
        flush=True,
    )
    spark.stop()
    return 0 if result.committed else 1


if __name__ == "__main__":
    sys.exit(main())
