"""Throughput of the exactly-once Delta sink against plain ``write_deltalake`` per batch.

Both variants run the same Spark job in the same SparkSession on the same
input (Parquet files read as a bounded stream, available-now trigger) and
append to a fresh local Delta table per run:

* baseline: ``foreachBatch`` collects each micro-batch to the driver as Arrow
  (``DataFrame.toArrow()``) and appends it with
  ``deltalake.write_deltalake(table, data, mode="append")``: one Delta version
  per micro-batch, at-least-once (a crash between the Delta commit and Spark's
  commit log writes the batch again on replay), no staging, no ledger;
* exactly-once: a :class:`lifecycle.Job` with a :class:`sinks.DeltaSink` (Parquet
  staged by the executor tasks through ``mapInArrow``, ledger, one Delta version
  per checkpoint with an app transaction).

Every run is checked afterwards (row count of the table). Runs alternate
(baseline, exactly-once, baseline, ...) after one warm-up pair; the median of
each is reported with the ratio exactly-once / baseline throughput.

    python benchmarks/delta_throughput.py [--rows N] [--files F] [--files-per-batch K]
                                          [--repeat R] [--interval S] [--partition-by COL]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deltalake import DeltaTable, write_deltalake  # noqa: E402
from pyspark.sql import DataFrame  # noqa: E402

from benchmarks._common import (  # noqa: E402
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--files-per-batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--interval", type=float, default=0.0, help="checkpoint_interval")
    ap.add_argument("--partition-by", default=None, help="partition both tables by this column")
    ap.add_argument(
        "--workdir", default=None, help="where input and tables go (default: a tmp dir)"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    partition_by = [args.partition_by] if args.partition_by else None
    work = Path(tempfile.mkdtemp(prefix="twophase-delta-bench-", dir=args.workdir))
    try:
        make_input(work / "in", args.rows, args.files)
        spark = bench_spark("twophase-delta-bench")

        def source() -> DataFrame:
            return parquet_stream(spark, work / "in", args.files_per_batch)

        times: dict[str, list[float]] = {"baseline": [], "exactly-once": []}
        versions: dict[str, int] = {}
        for r in range(-1, args.repeat):  # run -1 warms up the JVM, not counted
            for variant in times:
                where = work / f"{variant}-{r + 1}"
                uri = str(where / "table")
                if variant == "baseline":
                    secs = run_baseline(source(), uri, where / "spark", partition_by)
                else:
                    sink = DeltaSink(uri, partition_by=partition_by)
                    secs = time_job(spark, source(), sink, where / "state", args.interval)
                dt = DeltaTable(uri)
                count = dt.count()
                assert count == args.rows, f"{variant}: {count} rows, expected {args.rows}"
                versions[variant] = dt.version()
                if r >= 0:
                    times[variant].append(secs)
                label = "warm-up" if r < 0 else f"run {r}"
                rate = args.rows / secs
                print(
                    f"{label:<8} {variant:<13} {secs:6.2f} s {rate:>10,.0f} rows/s "
                    f"(table version {dt.version()})",
                    flush=True,
                )
                shutil.rmtree(where)
        spark.stop()
        base = statistics.median(times["baseline"])
        eo = statistics.median(times["exactly-once"])
        batches = -(-args.files // args.files_per_batch)
        print()
        print(
            f"{args.rows:,} rows, {batches} micro-batches, checkpoint_interval={args.interval}, "
            f"partition_by={partition_by}, median of {args.repeat} (after a warm-up run)"
        )
        print("| variant | seconds | rows/s | throughput vs baseline |")
        print("| --- | ---: | ---: | ---: |")
        print(
            f"| write_deltalake per batch (at-least-once) | {base:.2f} | "
            f"{args.rows / base:,.0f} | 1.00 |"
        )
        print(f"| DeltaSink (exactly-once) | {eo:.2f} | {args.rows / eo:,.0f} | {base / eo:.2f} |")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
