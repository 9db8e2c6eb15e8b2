"""A job that writes JSON-lines files to a PostgreSQL table through the example
DB-API sink (``examples/dbapi_sink.py``), exactly once; ``tests/test_example_sink.py``
SIGKILLs it again and again with the kit's ``crash_test``.

    python examples/dbapi_job.py --dsn DSN --state DIR --input DIR [--table T]

The table must exist with the input's columns (``id bigint, name text, amount
double precision``); exit 0 when the run's final checkpoint committed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pyspark.sql import SparkSession

from lifecycle import Job, configure_logging

SINK_MODULE = Path(__file__).with_name("dbapi_sink.py")
sys.path.insert(0, str(SINK_MODULE.parent))  # the sink: a module beside this script

from dbapi_sink import Connect, DbApiSink  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", required=True, help="PostgreSQL DSN (psycopg)")
    ap.add_argument("--state", required=True, help="the job's state_dir")
    ap.add_argument("--input", required=True, help="directory of JSON-lines files")
    ap.add_argument("--table", default="orders")
    ap.add_argument("--job", default="dbapi")
    ap.add_argument("--files-per-batch", type=int, default=2)
    args = ap.parse_args()
    configure_logging()
    spark = (
        SparkSession.builder.master("local[2]")
        .appName(args.job)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    # executors unpickle the sink: ship its module to them (Spark's way, also on a cluster)
    spark.sparkContext.addPyFile(str(SINK_MODULE))
    rows = (
        spark.readStream.schema("id long, name string, amount double")
        .option("maxFilesPerTrigger", args.files_per_batch)
        .json(args.input)
    )
    job = Job(spark, args.job, args.state, checkpoint_interval=1.0, progress="off")
    sink = DbApiSink(Connect("psycopg", args.dsn), args.table)
    job.add_pipeline("load", rows, [sink], bounded=True)
    result = job.run()
    spark.stop()
    return 0 if result.committed else 1


if __name__ == "__main__":
    sys.exit(main())
