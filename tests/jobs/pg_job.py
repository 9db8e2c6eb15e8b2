"""A bounded PySpark job writing JSON input files to PostgreSQL; run as a
separate driver process by the crash tests (which SIGKILL it)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lifecycle import Job
from sinks import PostgresSink
from tests.sparkutil import INPUT_SCHEMA, make_spark


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--table", default="orders")
    ap.add_argument("--job", default="crash")
    ap.add_argument("--interval", type=float, default=0.0)
    ap.add_argument("--files-per-batch", type=int, default=1)
    ap.add_argument("--key", default=None)
    args = ap.parse_args()
    os.environ["TWOPHASE_DRIVER_PID"] = str(os.getpid())  # for executor-side faults
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    spark = make_spark(f"job-{args.job}")
    spark.sparkContext.setLogLevel("ERROR")
    df = (
        spark.readStream.schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", args.files_per_batch)
        .json(args.input)
    )
    job = Job(spark, args.job, args.state, checkpoint_interval=args.interval)
    key = [args.key] if args.key else None
    job.add_pipeline("load", df, [PostgresSink(args.dsn, args.table, key=key)], bounded=True)
    result = job.run()
    print(
        "RESULT "
        + json.dumps(
            {
                "checkpoints": result.checkpoints,
                "rows": result.rows_committed,
                "final": result.final_checkpoint,
            }
        ),
        flush=True,
    )
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
