"""Throughput of the exactly-once Delta sink against the fastest plain writers.

Every variant runs the same Spark job in the same SparkSession on the same
input (Parquet files read as a bounded stream, available-now trigger) and
writes a fresh local directory per run:

* ``write_deltalake``: ``foreachBatch`` collects each micro-batch to the driver
  as Arrow (``DataFrame.toArrow()``) and appends it with
  ``deltalake.write_deltalake(table, data, mode="append")``: one Delta version
  per micro-batch, at-least-once, no staging, no ledger;
* ``spark parquet``: ``foreachBatch`` writes each micro-batch with Spark's own
  Parquet writer (``df.write.mode("append").parquet(dir)``): not a Delta table
  at all, the floor of any writer that runs in Spark's tasks;
* ``delta-spark txnVersion``: what a Spark user runs today for exactly-once
  into one Delta table: ``foreachBatch`` writing each micro-batch with
  delta-spark (``df.write.format("delta").option("txnAppId", query id)
  .option("txnVersion", batch id)``, Delta's idempotent writes), one version
  per micro-batch;
* ``DeltaSink`` with ``write_with="spark"`` (the default for local tables:
  Spark's Parquet writer stages, the driver moves and registers) and with
  ``write_with="arrow"`` (the sink's own pyarrow writer in ``mapInArrow``
  tasks); both through a :class:`lifecycle.Job`: ledger, one Delta version per
  checkpoint with an app transaction.

Every run is checked afterwards (row count of the table or directory). Runs
alternate after one warm-up round; the median of each is reported with its
ratio to the faster of the two plain baselines (the physical limit) and to
delta-spark's idempotent writes (the user's alternative).

    python benchmarks/delta_throughput.py [--rows N] [--files F] [--files-per-batch K]
                                          [--repeat R] [--interval S] [--partition-by COL]
                                          [--variants a,b]

``--variants`` runs some of them (the names below in ``VARIANTS``); a ratio
against a variant that did not run shows ``-``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow.parquet as pq  # noqa: E402
from deltalake import DeltaTable, write_deltalake  # noqa: E402
from pyspark.sql import DataFrame  # noqa: E402

from benchmarks._common import (  # noqa: E402
    add_conf_option,
    bench_spark,
    make_input,
    parquet_stream,
    time_foreach_batch,
    time_job,
)
from sinks import DeltaSink  # noqa: E402


def run_baseline(src: DataFrame, uri: str, ckpt: Path, partition_by: list[str] | None) -> float:
    def each(df: DataFrame, _batch: int) -> None:
        data = df.toArrow()
        if data.num_rows:
            write_deltalake(uri, data, mode="append", partition_by=partition_by)

    return time_foreach_batch(src, each, ckpt)


def run_spark_parquet(
    src: DataFrame, path: str, ckpt: Path, partition_by: list[str] | None
) -> float:
    def each(df: DataFrame, _batch: int) -> None:
        w = df.write.mode("append")
        if partition_by:
            w = w.partitionBy(*partition_by)
        w.parquet(path)

    return time_foreach_batch(src, each, ckpt)


def delta_idempotent_write(
    df: DataFrame, uri: str, app: str, batch: int, partition_by: list[str] | None = None
) -> None:
    """One micro-batch through delta-spark's idempotent write (Delta's own
    exactly-once for one table: ``txnAppId``/``txnVersion``)."""
    w = df.write.format("delta").mode("append")
    w = w.option("txnAppId", app).option("txnVersion", batch)
    if partition_by:
        w = w.partitionBy(*partition_by)
    w.save(uri)


def run_delta_spark(src: DataFrame, uri: str, ckpt: Path, partition_by: list[str] | None) -> float:
    app = f"bench-{ckpt.parent.name}"

    def each(df: DataFrame, batch: int) -> None:
        delta_idempotent_write(df, uri, app, batch, partition_by)

    return time_foreach_batch(src, each, ckpt)


VARIANTS = (
    "write_deltalake",
    "spark parquet",
    "delta-spark txnVersion",
    "DeltaSink spark",
    "DeltaSink arrow",
)
BASELINES = VARIANTS[:2]
ALTERNATIVE = "delta-spark txnVersion"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--files-per-batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--interval", type=float, default=5.0, help="checkpoint_interval (the default)")
    ap.add_argument("--partition-by", default=None, help="partition both tables by this column")
    ap.add_argument(
        "--workdir", default=None, help="where input and tables go (default: a tmp dir)"
    )
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset")
    add_conf_option(ap)
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS):
        ap.error(f"--variants: a subset of {VARIANTS}")
    logging.basicConfig(level=logging.WARNING)
    partition_by = [args.partition_by] if args.partition_by else None
    work = Path(tempfile.mkdtemp(prefix="twophase-delta-bench-", dir=args.workdir))
    try:
        make_input(work / "in", args.rows, args.files)
        spark = bench_spark("twophase-delta-bench", jar_sets=["delta"], conf=args.conf)

        def source() -> DataFrame:
            return parquet_stream(spark, work / "in", args.files_per_batch)

        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(-1, args.repeat):  # run -1 warms up the JVM, not counted
            for variant in times:
                where = work / f"{variant.replace(' ', '-')}-{r + 1}"
                uri = str(where / "table")
                if variant == "write_deltalake":
                    secs = run_baseline(source(), uri, where / "spark", partition_by)
                elif variant == "spark parquet":
                    secs = run_spark_parquet(source(), uri, where / "spark", partition_by)
                elif variant == ALTERNATIVE:
                    secs = run_delta_spark(source(), uri, where / "spark", partition_by)
                else:
                    route = variant.split()[-1]
                    sink = DeltaSink(uri, partition_by=partition_by, write_with=route)
                    secs = time_job(spark, source(), sink, where / "state", args.interval)
                if variant == "spark parquet":
                    count = pq.ParquetDataset(uri).read(columns=["id"]).num_rows
                    version = "-"
                else:
                    dt = DeltaTable(uri)
                    count = dt.count()
                    version = str(dt.version())
                assert count == args.rows, f"{variant}: {count} rows, expected {args.rows}"
                if r >= 0:
                    times[variant].append(secs)
                label = "warm-up" if r < 0 else f"run {r}"
                rate = args.rows / secs
                print(
                    f"{label:<8} {variant:<16} {secs:6.2f} s {rate:>10,.0f} rows/s "
                    f"(table version {version})",
                    flush=True,
                )
                shutil.rmtree(where)
        spark.stop()
        med = {v: statistics.median(t) for v, t in times.items()}
        best = min((med[b] for b in BASELINES if b in med), default=None)
        batches = -(-args.files // args.files_per_batch)
        print()
        print(
            f"{args.rows:,} rows, {batches} micro-batches, checkpoint_interval={args.interval}, "
            f"partition_by={partition_by}, median of {args.repeat} (after a warm-up run); "
            f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; settings {args.conf}"
        )
        print(
            "| variant | seconds | rows/s | vs the faster plain baseline | "
            "vs delta-spark's idempotent writes |"
        )
        print("| --- | ---: | ---: | ---: | ---: |")
        labels = {
            "write_deltalake": "`write_deltalake` per batch, collected to the driver "
            "(at-least-once)",
            "spark parquet": "Spark's `df.write.parquet` per batch (no Delta, at-least-once)",
            ALTERNATIVE: "delta-spark `txnAppId`/`txnVersion` per batch (Delta's exactly-once)",
            "DeltaSink spark": '`DeltaSink` exactly-once, `write_with="spark"` (default)',
            "DeltaSink arrow": '`DeltaSink` exactly-once, `write_with="arrow"`',
        }
        for v in variants:
            vs_best = f"{best / med[v]:.2f}" if best is not None else "-"
            vs_alt = f"{med[ALTERNATIVE] / med[v]:.2f}" if ALTERNATIVE in med else "-"
            print(
                f"| {labels[v]} | {med[v]:.2f} | {args.rows / med[v]:,.0f} | {vs_best} | {vs_alt} |"
            )
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
