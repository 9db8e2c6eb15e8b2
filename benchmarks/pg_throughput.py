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

``--upsert`` writes by key instead, into a table with a primary key that
already holds ``--existing`` of the input's ids (other values): half the rows
update, half insert by default. The limit then stages each task's rows by
autocommit COPY into a temporary table and runs ``INSERT ... ON CONFLICT (id)
DO UPDATE``; JDBC writes each micro-batch into a staging table and the driver
runs the same ``INSERT ... ON CONFLICT`` from it (the usual recipe); the sink
is ``PostgresSink(key=["id"])``; a fourth variant runs the limit on the input
repartitioned by the key, the shuffle every keyed sink does so that one key
is written by one task of a batch (two prepared transactions holding one key
would wait for each other until the checkpoint). Two more run the sink
without that shuffle: ``declared``, ``PostgresSink(key=["id"],
partitioned_by_key=True)`` (true here: each id is in one input file), against
the limit; and ``exactly-once by key``, the sink on the input repartitioned by
``id`` in the streaming query, against ``baseline by key``: a stateless query
runs its batches under adaptive execution, whose plan hides that partitioning
(:mod:`lifecycle.partitioning`), so the sink shuffles the batch again (it
would not after a streaming aggregation by ``id``, or told so). Every
variant's table is checked: all ids once, the input's values.

Runs alternate, each round starting with the next variant (baseline, JDBC,
exactly-once; then JDBC, exactly-once, baseline; ...), and the median of each
is reported, with its throughput against the baseline (the physical
limit) and against JDBC.

    python benchmarks/pg_throughput.py [--rows N] [--files F] [--repeat R] [--dsn DSN]
                                       [--upsert [--existing FRACTION]] [--variants a,b]

``--variants`` runs some of them (``baseline``, ``jdbc``, ``exactly-once``,
``baseline by key``); a ratio against a variant that did not run shows ``-``.
"""

from __future__ import annotations

import argparse
import logging
import os
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

COLUMNS = "id, name, amount, qty"
DDL = "CREATE TABLE {t} (id bigint, name text, amount float8, qty integer)"
KEYED_DDL = "CREATE TABLE {t} (id bigint PRIMARY KEY, name text, amount float8, qty integer)"
UPSERT = (
    f"INSERT INTO {{t}} ({COLUMNS}) SELECT {COLUMNS} FROM {{stage}} ON CONFLICT (id) DO UPDATE "
    "SET name = EXCLUDED.name, amount = EXCLUDED.amount, qty = EXCLUDED.qty"
)


def _copy_task(dsn: str, table: str, upsert: bool = False):  # type: ignore[no-untyped-def]
    """Each task COPYs its rows into ``table`` in autocommit; with ``upsert``
    into a temporary table first, then ``INSERT ... ON CONFLICT`` from it."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        encoder = None
        n = 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            target = table
            if upsert:
                target = "stage"
                conn.execute(f"CREATE TEMP TABLE stage (LIKE {table})")
            with conn.cursor().copy(
                f"COPY {target} ({COLUMNS}) FROM STDIN (FORMAT BINARY)"
            ) as copy:
                for b in batches:
                    if encoder is None:
                        encoder = pgpq.ArrowToPostgresBinaryEncoder(b.schema)
                        copy.write(encoder.write_header())
                    copy.write(encoder.write_batch(b))
                    n += b.num_rows
                if encoder is not None:
                    copy.write(encoder.finish())
            if upsert:
                conn.execute(UPSERT.format(t=table, stage="stage"))
        yield pa.RecordBatch.from_pydict({"n": [n]})

    return task


def run_baseline(src: DataFrame, dsn: str, table: str, ckpt: Path, upsert: bool = False) -> float:
    task = _copy_task(dsn, table, upsert)

    def each(df: DataFrame, _batch: int) -> None:
        df.mapInArrow(task, "n long").collect()

    return time_foreach_batch(src, each, ckpt)


def jdbc_target(dsn: str) -> tuple[str, dict[str, str]]:
    """The JDBC URL and properties of ``dsn`` for ``df.write.jdbc``: ``batchsize``
    10,000 and the driver's ``reWriteBatchedInserts``, as a tuned user sets them."""
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
    if "sslmode" in info:  # the same transport as the sink's (the kit's DSN: no TLS)
        props["sslmode"] = str(info["sslmode"])
    return url, props


def run_jdbc(src: DataFrame, dsn: str, table: str, ckpt: Path, upsert: bool = False) -> float:
    """Spark's JDBC writer per micro-batch; with ``upsert`` into a staging
    table (``mode="overwrite"`` with ``truncate``, so it keeps its definition),
    then ``INSERT ... ON CONFLICT`` from it in the driver."""
    url, props = jdbc_target(dsn)
    stage = f"{table}_stage"

    def each(df: DataFrame, _batch: int) -> None:
        if not upsert:
            df.write.jdbc(url, table, mode="append", properties=props)
            return
        df.write.option("truncate", "true").jdbc(url, stage, mode="overwrite", properties=props)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(UPSERT.format(t=table, stage=stage))

    if upsert:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(DDL.format(t=stage))
    try:
        return time_foreach_batch(src, each, ckpt)
    finally:
        if upsert:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f"DROP TABLE {stage}")


def prefill(conn: psycopg.Connection, table: str, rows: int, existing: float) -> None:
    """The first ``existing`` of the input's ids, with values the input changes."""
    n = int(rows * existing)
    conn.execute(
        f"INSERT INTO {table} ({COLUMNS}) SELECT i, 'old', -1.0, -1 "
        f"FROM generate_series(0, {n - 1}) AS i"
    )
    conn.execute(f"VACUUM ANALYZE {table}")


def check(conn: psycopg.Connection, table: str, rows: int, variant: str) -> None:
    """Every id once, each with the input's values (make_input's)."""
    count, ids, wrong = conn.execute(
        f"SELECT count(*), count(DISTINCT id), "
        f"count(*) FILTER (WHERE name <> 'customer-' || (id % 1000) OR amount <> id * 0.25 "
        f"OR qty <> id % 50) FROM {table}"
    ).fetchone()
    assert (count, ids, wrong) == (rows, rows, 0), (
        f"{variant}: {count} rows, {ids} ids, {wrong} with other values; expected {rows} ids once"
    )


VARIANTS = ("baseline", "jdbc", "exactly-once")
BY_KEY = ("declared", "baseline by key", "exactly-once by key")
"""the variants of ``--upsert`` alone"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--files-per-batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--interval", type=float, default=5.0, help="checkpoint_interval (the default)")
    ap.add_argument("--dsn", help="PostgreSQL DSN (default: start a private server)")
    ap.add_argument("--upsert", action="store_true", help="write by key (see above)")
    ap.add_argument(
        "--existing", type=float, default=0.5, help="with --upsert: the ids already there"
    )
    ap.add_argument(
        "--variants",
        default=None,
        help="a comma-separated subset (default: all; a ratio needs its baseline run too)",
    )
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

        variants = (*VARIANTS, *BY_KEY) if args.upsert else VARIANTS
        if args.variants:
            chosen = [v for v in args.variants.split(",") if v]
            if set(chosen) - set(variants):
                ap.error(f"--variants: a subset of {variants}")
            variants = tuple(chosen)
        times: dict[str, list[float]] = {v: [] for v in variants}
        with psycopg.connect(dsn, autocommit=True) as c:
            for r in range(-1, args.repeat):  # run -1 warms up the JVM, not counted
                # each round starts with the next variant: none always runs first or last
                # (the server's state after the variants before it, its tables dropped)
                order = list(times)
                start = (r + 1) % len(order)
                for variant in order[start:] + order[:start]:
                    table = f"bench_{variant.replace('-', '_').replace(' ', '_')}_{r + 1}"
                    c.execute((KEYED_DDL if args.upsert else DDL).format(t=table))
                    if args.upsert:
                        prefill(c, table, args.rows, args.existing)
                    where = work / f"{variant}-{r + 1}"
                    if variant == "baseline":
                        secs = run_baseline(source(), dsn, table, where, args.upsert)
                    elif variant == "baseline by key":  # the shuffle every keyed sink does
                        src = source().repartition("id")
                        secs = run_baseline(src, dsn, table, where, args.upsert)
                    elif variant == "jdbc":
                        secs = run_jdbc(source(), dsn, table, where, args.upsert)
                    else:
                        sink = PostgresSink(
                            dsn,
                            table,
                            key=["id"] if args.upsert else None,
                            partitioned_by_key=variant == "declared",
                        )
                        src = source()
                        if variant == "exactly-once by key":
                            src = src.repartition("id")
                        secs = time_job(spark, src, sink, where, args.interval)
                    check(c, table, args.rows, variant)
                    if r >= 0:
                        times[variant].append(secs)
                    label = "warm-up" if r < 0 else f"run {r}"
                    rate = args.rows / secs
                    print(
                        f"{label:<8} {variant:<19} {secs:6.2f} s {rate:>10,.0f} rows/s "
                        f"(load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
                    c.execute(f"DROP TABLE {table}")
        spark.stop()
        med = {v: statistics.median(t) for v, t in times.items()}
        batches = -(-args.files // args.files_per_batch)
        print()
        how = (
            f"upserts by id ({args.existing:.0%} of the ids already there)"
            if args.upsert
            else "appends"
        )
        print(
            f"{args.rows:,} rows, {batches} micro-batches, {how}, "
            f"checkpoint_interval={args.interval}, median of {args.repeat}, "
            f"load {os.getloadavg()[0]:.2f}"
        )
        print("| variant | seconds | rows/s | vs autocommit COPY | vs JDBC |")
        print("| --- | ---: | ---: | ---: | ---: |")
        labels = {
            "baseline": "autocommit binary COPY (at-least-once)",
            "jdbc": "Spark's JDBC writer, `batchsize` 10,000, `reWriteBatchedInserts` "
            "(at-least-once)",
            "exactly-once": "PostgresSink (exactly-once)",
        }
        if args.upsert:
            labels["baseline"] = (
                "autocommit binary COPY into a temporary table, then `INSERT ... ON CONFLICT`"
            )
            labels["jdbc"] += ", into a (logged) staging table, then `INSERT ... ON CONFLICT`"
            labels["exactly-once"] = 'PostgresSink(key=["id"]) (exactly-once)'
            labels["baseline by key"] = (
                "the same limit with the input repartitioned by the key first (as every "
                "keyed sink repartitions it)"
            )
            labels["declared"] = (
                'PostgresSink(key=["id"], partitioned_by_key=True): no shuffle (exactly-once)'
            )
            labels["exactly-once by key"] = (
                'PostgresSink(key=["id"]) on the input repartitioned by the key '
                "(a second shuffle: the plan hides the first, exactly-once)"
            )

        def ratio(base: str, v: str) -> str:
            return f"{med[base] / med[v]:.2f}" if base in med else "-"

        for v in variants:
            print(
                f"| {labels[v]} | {med[v]:.2f} | {args.rows / med[v]:,.0f} | "
                f"{ratio('baseline', v)} | {ratio('jdbc', v)} |"
            )
        if "exactly-once by key" in med and "baseline by key" in med:
            by_key = med["baseline by key"] / med["exactly-once by key"]
            print(f"\n(exactly-once by key vs baseline by key: {by_key:.2f})")
        return 0
    finally:
        if server is not None:
            server.cleanup()


if __name__ == "__main__":
    sys.exit(main())
