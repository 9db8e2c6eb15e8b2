"""A bounded backfill that replaces one day (``replace_where``) in a PostgreSQL
table and a Delta table partitioned by day; run as a separate driver process
by the replace crash test, which SIGKILLs it. Exit 0 only when it committed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lifecycle import Job
from sinks import DeltaSink, PostgresSink
from tests.jobs._driver import finish, start_driver

DAY = "day = '2026-11-01'"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--delta", required=True)
    args = ap.parse_args()
    spark = start_driver("replace")
    df = (
        spark.readStream.schema("day string, id long, v string")
        .option("maxFilesPerTrigger", 1)
        .json(args.input)
    )
    sinks = [
        DeltaSink(args.delta, replace_where=DAY, sink_id="delta"),
        PostgresSink(args.dsn, "events", replace_where=DAY, sink_id="pg"),
    ]
    job = Job(spark, "replace", args.state, checkpoint_interval=0)
    job.add_pipeline("day", df, sinks, bounded=True)
    return finish(spark, job.run())


if __name__ == "__main__":
    sys.exit(main())
