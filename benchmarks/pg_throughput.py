"""Throughput of the exactly-once PostgreSQL sink against plain autocommit COPY.

Both variants run the same Spark job in the same SparkSession on the same
input (Parquet files read as a bounded stream, available-now trigger):

* baseline: ``foreachBatch`` + ``mapInArrow``, each task streaming its
  partition through binary COPY (pgpq) in an autocommit transaction:
  at-least-once, no prepare, no ledger;
* JDBC: what a Spark user runs instead, ``foreachBatch`` writing each
  micro-batch with Spark's JDBC writer (``df.write.jdbc``, ``batchsize``
  10,000, the PostgreSQL driver's ``reWriteBatchedInserts=true``),
  at-least-once;
* exactly-once: a :class:`lifecycle.Job` with a :class:`sinks.PostgresSink`
  (COPY + PREPARE TRANSACTION on executors, ledger, COMMIT PREPARED).

Runs alternate (baseline, JDBC, exactly-once, baseline, ...) and the median of
each is reported, with its throughput against the baseline (the physical
limit) and against JDBC.

    python benchmarks/pg_throughput.py [--rows N] [--files F] [--repeat R] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pgpq  # noqa: E402
import psycopg  # noqa: E402
import pyarrow as pa  # noqa: E402
from pyspark.sql import DataFrame  # noqa: E402

from benchmarks._common import (  # noqa: E402
    bench_spark,
    make_input,
    parquet_stream,
    time_foreach_batch,
    time_job,
)
from sinks import PostgresSink  # noqa: E402

DDL = "CREATE TABLE {t} (id bigint, name text, amount float8, qty integer)"


def _copy_task(dsn: str, table: str):  # type: ignore[no-untyped-def]
    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        encoder = None
        n = 0
        with (
            psycopg.connect(dsn, autocommit=True) as conn,
            conn.cursor().copy(
                f"COPY {table} (id, name, amount, qty) FROM STDIN (FORMAT BINARY)"
            ) as copy,
        ):
            for b in batches:
                if encoder is None:
                    encoder = pgpq.ArrowToPostgresBinaryEncoder(b.schema)
                    copy.write(encoder.write_header())
                copy.write(encoder.write_batch(b))
                n += b.num_rows
            if encoder is not None:
                copy.write(encoder.finish())
        yield pa.RecordBatch.from_pydict({"n": [n]})

    return task


def run_baseline(src: DataFrame, dsn: str, table: str, ckpt: Path) -> float:
    task = _copy_task(dsn, table)

    def each(df: DataFrame, _batch: int) -> None:
        df.mapInArrow(task, "n long").collect()

    return time_foreach_batch(src, each, ckpt)


def run_jdbc(src: DataFrame, dsn: str, table: str, ckpt: Path) -> float:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    url = f"jdbc:postgresql://{info.get('host', 'localhost')}:{info.get('port', 5432)}/"
    url += str(info.get("dbname", "postgres"))
    props = {
        "user": str(info.get("user", "")),
        "password": str(info.get("password", "")),
        "driver": "org.postgresql.Driver",
        "batchsize": "10000",
        "reWriteBatchedInserts": "true",
    }

    def each(df: DataFrame, _batch: int) -> None:
        df.write.jdbc(url, table, mode="append", properties=props)

    return time_foreach_batch(src, each, ckpt)


VARIANTS = ("baseline", "jdbc", "exactly-once")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--files-per-batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--interval", type=float, default=0.0, help="checkpoint_interval")
    ap.add_argument("--dsn", help="PostgreSQL DSN (default: start a private server)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="twophase-bench-"))
    server = None
    dsn = args.dsn
    if dsn is None:
        from lifecycle.testing.postgres_server import PostgresServer

        server = PostgresServer()
        server.start()
        dsn = server.dsn()
    try:
        make_input(work / "in", args.rows, args.files)
        spark = bench_spark("twophase-bench", jar_sets=["jdbc"])

        def source() -> DataFrame:
            return parquet_stream(spark, work / "in", args.files_per_batch)

        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        with psycopg.connect(dsn, autocommit=True) as c:
            for r in range(-1, args.repeat):  # run -1 warms up the JVM, not counted
                for variant in times:
                    table = f"bench_{variant.replace('-', '_')}_{r + 1}"
                    c.execute(DDL.format(t=table))
                    where = work / f"{variant}-{r + 1}"
                    if variant == "baseline":
                        secs = run_baseline(source(), dsn, table, where)
                    elif variant == "jdbc":
                        secs = run_jdbc(source(), dsn, table, where)
                    else:
                        secs = time_job(
                            spark, source(), PostgresSink(dsn, table), where, args.interval
                        )
                    count = c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                    assert count == args.rows, f"{variant}: {count} rows, expected {args.rows}"
                    if r >= 0:
                        times[variant].append(secs)
                    label = "warm-up" if r < 0 else f"run {r}"
                    rate = args.rows / secs
                    print(
                        f"{label:<8} {variant:<13} {secs:6.2f} s {rate:>10,.0f} rows/s", flush=True
                    )
                    c.execute(f"DROP TABLE {table}")
        spark.stop()
        med = {v: statistics.median(t) for v, t in times.items()}
        batches = -(-args.files // args.files_per_batch)
        print()
        print(
            f"{args.rows:,} rows, {batches} micro-batches, checkpoint_interval={args.interval}, "
            f"median of {args.repeat}"
        )
        print("| variant | seconds | rows/s | vs autocommit COPY | vs JDBC |")
        print("| --- | ---: | ---: | ---: | ---: |")
        labels = {
            "baseline": "autocommit binary COPY (at-least-once)",
            "jdbc": "Spark's JDBC writer, `batchsize` 10,000, `reWriteBatchedInserts` "
            "(at-least-once)",
            "exactly-once": "PostgresSink (exactly-once)",
        }
        for v in VARIANTS:
            print(
                f"| {labels[v]} | {med[v]:.2f} | {args.rows / med[v]:,.0f} | "
                f"{med['baseline'] / med[v]:.2f} | {med['jdbc'] / med[v]:.2f} |"
            )
        return 0
    finally:
        if server is not None:
            server.cleanup()


if __name__ == "__main__":
    sys.exit(main())
