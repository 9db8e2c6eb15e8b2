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
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from deltalake import DeltaTable, write_deltalake  # noqa: E402
from pyspark.sql import DataFrame, SparkSession  # noqa: E402

from lifecycle import Job  # noqa: E402
from sinks import DeltaSink  # noqa: E402


def make_input(directory: Path, rows: int, files: int) -> None:
    directory.mkdir(parents=True)
    per = rows // files
    for f in range(files):
        start = f * per
        n = per if f < files - 1 else rows - start
        r = range(start, start + n)
        table = pa.table(
            {
                "id": pa.array(r, pa.int64()),
                "name": pa.array([f"customer-{i % 1000}" for i in r]),
                "amount": pa.array([i * 0.25 for i in r], pa.float64()),
                "qty": pa.array([i % 50 for i in r], pa.int32()),
            }
        )
        pq.write_table(table, directory / f"part-{f:04d}.parquet")


def run_baseline(src: DataFrame, uri: str, ckpt: Path, partition_by: list[str] | None) -> float:
    def each(df: DataFrame, _batch: int) -> None:
        data = df.toArrow()
        if data.num_rows:
            write_deltalake(uri, data, mode="append", partition_by=partition_by)

    t0 = time.perf_counter()
    q = (
        src.writeStream.foreachBatch(each)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    return time.perf_counter() - t0


def run_exactly_once(
    spark: SparkSession,
    src: DataFrame,
    uri: str,
    state: Path,
    interval: float,
    partition_by: list[str] | None,
) -> float:
    job = Job(spark, "bench", state, checkpoint_interval=interval)
    job.add_pipeline("load", src, [DeltaSink(uri, partition_by=partition_by)], bounded=True)
    t0 = time.perf_counter()
    result = job.run()
    secs = time.perf_counter() - t0
    assert result.committed, result
    return secs


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
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    partition_by = [args.partition_by] if args.partition_by else None
    work = Path(tempfile.mkdtemp(prefix="twophase-delta-bench-", dir=args.workdir))
    try:
        make_input(work / "in", args.rows, args.files)
        spark = (
            SparkSession.builder.master("local[2]")
            .appName("twophase-delta-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        schema = spark.read.parquet(str(work / "in")).schema

        def source() -> DataFrame:
            return (
                spark.readStream.schema(schema)
                .option("maxFilesPerTrigger", args.files_per_batch)
                .parquet(str(work / "in"))
            )

        times: dict[str, list[float]] = {"baseline": [], "exactly-once": []}
        versions: dict[str, int] = {}
        for r in range(-1, args.repeat):  # run -1 warms up the JVM, not counted
            for variant in times:
                where = work / f"{variant}-{r + 1}"
                uri = str(where / "table")
                if variant == "baseline":
                    secs = run_baseline(source(), uri, where / "spark", partition_by)
                else:
                    secs = run_exactly_once(
                        spark, source(), uri, where / "state", args.interval, partition_by
                    )
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
