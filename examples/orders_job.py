"""A small exactly-once job, end to end on local defaults.

It writes sample order files, then runs a Job with two pipelines into
PostgreSQL: ``orders`` (bounded, upsert by order id) and ``audit`` (bounded,
append). With no ``--dsn`` it starts a throwaway PostgreSQL server on loopback
(``lifecycle/testing/postgres_server.py``). Run it twice with the same ``--state-dir`` to see
recovery: the second run finds every pipeline finished and writes nothing.

    python examples/orders_job.py [--dsn DSN] [--state-dir DIR] [--orders N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from lifecycle import Job, configure_logging  # noqa: E402
from lifecycle.cli import format_status  # noqa: E402
from lifecycle.ledger import read_ledger  # noqa: E402
from sinks import PostgresSink  # noqa: E402

SCHEMA = StructType(
    [
        StructField("order_id", LongType()),
        StructField("customer", StringType()),
        StructField("amount", DoubleType()),
    ]
)


def write_orders(directory: Path, orders: int, files: int = 8) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    per = max(1, orders // files)
    for f in range(files):
        rows = range(f * per, orders if f == files - 1 else (f + 1) * per)
        text = "".join(
            json.dumps({"order_id": i, "customer": f"c{i % 97}", "amount": round(i * 1.25, 2)})
            + "\n"
            for i in rows
        )
        (directory / f"orders-{f:03d}.json").write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", help="PostgreSQL DSN (default: start a private server)")
    ap.add_argument("--state-dir", default=None, help="job state (default: a temp dir)")
    ap.add_argument("--orders", type=int, default=20_000)
    args = ap.parse_args()
    configure_logging()  # TWOPHASE_LOG_LEVEL / TWOPHASE_VERBOSE=1 for more
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

    work = Path(tempfile.mkdtemp(prefix="twophase-example-"))
    server = None
    dsn = args.dsn
    if dsn is None:
        from lifecycle.testing.postgres_server import PostgresServer

        server = PostgresServer()
        server.start()
        dsn = server.dsn()
        print(f"started a private PostgreSQL server: {dsn}")
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(
                "CREATE TABLE IF NOT EXISTS public.orders "
                "(order_id bigint PRIMARY KEY, customer text, amount double precision)"
            )
        write_orders(work / "incoming", args.orders)
        state_dir = Path(args.state_dir) if args.state_dir else work / "state"

        spark = (
            SparkSession.builder.master("local[2]")
            .appName("twophase-example")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        source = (
            spark.readStream.schema(SCHEMA)
            .option("maxFilesPerTrigger", 2)
            .json(str(work / "incoming"))
        )
        job = Job(spark, name="orders", state_dir=state_dir, checkpoint_interval=1.0)
        job.add_pipeline(
            "orders",
            source,
            sinks=[PostgresSink(dsn, table="public.orders", key=["order_id"])],
            bounded=True,
        )
        job.add_pipeline(
            "audit",
            source.selectExpr("order_id", "customer"),
            sinks=[PostgresSink(dsn, table="public.order_audit", create_table=True)],
            bounded=True,
        )
        result = job.run()
        spark.stop()

        with psycopg.connect(dsn) as c:
            n_orders = c.execute("SELECT count(*) FROM orders").fetchone()[0]
            n_audit = c.execute("SELECT count(*) FROM order_audit").fetchone()[0]
            dangling = c.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()[0]
        print()
        print(
            f"result: {result.checkpoints} checkpoint(s), final #{result.final_checkpoint}, "
            f"rows committed {result.rows_committed}"
        )
        print(
            f"orders table: {n_orders} rows; order_audit table: {n_audit} rows; "
            f"prepared transactions left: {dangling}"
        )
        print()
        doc = read_ledger(state_dir)
        assert doc is not None
        print(format_status(doc))
        ok = n_orders == args.orders and dangling == 0
        print("\nOK: every order exactly once" if ok else "\nMISMATCH")
        return 0 if ok else 1
    finally:
        if server is not None:
            server.cleanup()


if __name__ == "__main__":
    sys.exit(main())
