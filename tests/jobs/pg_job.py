"""A bounded PySpark job writing JSON input files to PostgreSQL; run as a
separate driver process by the crash tests (which SIGKILL it)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from psycopg.conninfo import make_conninfo

from lifecycle import Job
from sinks import PostgresSink
from tests.jobs._driver import finish, start_driver
from tests.sparkutil import INPUT_SCHEMA


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
    ap.add_argument("--ledger", default=None, help="Job(ledger=...): a PostgreSQL URI")
    ap.add_argument(
        "--password-env", default=None, help="the password of --dsn and --ledger, from here"
    )
    args = ap.parse_args()
    if args.password_env:  # in the DSN and the URI, as a job given a secret passes it on
        password = os.environ[args.password_env]
        args.dsn = make_conninfo(args.dsn, password=password)
        if args.ledger:
            sep = "&" if "?" in args.ledger else "?"
            args.ledger += f"{sep}password={quote(password, safe='')}"
    spark = start_driver(args.job)
    df = (
        spark.readStream.schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", args.files_per_batch)
        .json(args.input)
    )
    job = Job(spark, args.job, args.state, checkpoint_interval=args.interval, ledger=args.ledger)
    key = [args.key] if args.key else None
    job.add_pipeline("load", df, [PostgresSink(args.dsn, args.table, key=key)], bounded=True)
    return finish(spark, job.run())


if __name__ == "__main__":
    sys.exit(main())
