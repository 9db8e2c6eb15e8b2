"""Merge throughput and write amplification of the keyed Delta sink.

A base table of ``--rows`` rows (ids 0..rows-1, ``--files`` files written in id
order, so each file holds one range of ids) takes one batch of ``--changes``
changes (90% upserts, 10% deletes) in each of these key distributions
(``--batches N``: N micro-batches of them, the sink at ``--interval``, its
default ``checkpoint_interval`` of 5 s, so one checkpoint may merge several):

* ``recent``: ids from the last 5% of the table (the usual shape of a change
  feed: recent orders change); they fall in few files;
* ``uniform``: ids drawn over the whole table: every file holds some;
* ``new``: ids beyond the table (inserts by key): no file can hold them.

Both variants run the same streaming job (the changes as Parquet, one
micro-batch) on a fresh copy of the base table:

* ``DeltaTable.merge`` (the yardstick, at-least-once, what users write today):
  ``foreachBatch`` collects the batch to the driver as Arrow and runs
  deltalake's merge (``t.id = s.id``; matched and deleted, matched and updated,
  not matched and inserted), which reads the target in the driver;
* ``delta-spark MERGE`` (the user's alternative in Spark, at-least-once): the
  standard upsert recipe, ``foreachBatch`` running delta-spark's
  ``DeltaTable.forPath(...).merge(batch, "t.id = s.id")`` with the same three
  clauses, on the executors;
* ``DeltaSink(key=["id"], delete_when=("op", "D"))`` through a ``Job``
  (exactly-once): change files at the barrier, one Spark job rewriting the
  candidate files at the checkpoint, one version.

``--deletion-vectors`` turns deletion vectors on for the base table
(delta-spark's MERGE then writes them instead of rewriting files; the sink
merges such a table through delta-spark's transaction, copy-on-write), and
the tables are compared through delta-spark (deltalake cannot read them).

Write amplification is read from the version each wrote: bytes of the files
it removed (rewritten) and added, per changed row. Every result is checked
against the other variant's table (same rows).

    python benchmarks/delta_merge.py [--rows N] [--files F] [--changes M] [--repeat R]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
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

from benchmarks._common import (  # noqa: E402
    add_conf_option,
    bench_spark,
    parquet_stream,
    time_foreach_batch,
    time_job,
)
from sinks import DeltaSink  # noqa: E402

DISTRIBUTIONS = ("recent", "uniform", "new")
VARIANTS = ("DeltaTable.merge", "delta-spark MERGE", "DeltaSink")
ALTERNATIVE = "delta-spark MERGE"


def base_table(
    uri: Path | str, rows: int, files: int, storage_options: dict[str, str] | None = None
) -> pa.Table:
    """The merges' base table at ``uri``: one append a file, each file one
    range of ids; returns its rows."""
    per = rows // files
    parts = []
    for f in range(files):
        ids = range(f * per, rows if f == files - 1 else (f + 1) * per)
        t = pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "name": pa.array([f"customer-{i % 1000}" for i in ids]),
                "amount": pa.array([i * 0.25 for i in ids], pa.float64()),
            }
        )
        write_deltalake(str(uri), t, mode="append", storage_options=storage_options)
        parts.append(t)
    return pa.concat_tables(parts)


def changes(directory: Path, rows: int, n: int, how: str, seed: int, batches: int = 1) -> None:
    """``batches`` files of ``n`` changes each (one a micro-batch), keys unique
    within a file; a key may change again in a later one."""
    rnd = random.Random(seed)
    directory.mkdir(parents=True)
    for b in range(batches):
        if how == "recent":
            ids = rnd.sample(range(rows - rows // 20, rows), min(n, rows // 20))
        elif how == "uniform":
            ids = rnd.sample(range(rows), n)
        else:
            ids = list(range(rows + b * n, rows + (b + 1) * n))
        ops = ["D" if rnd.random() < 0.1 else "U" for _ in ids]
        t = pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "name": pa.array([f"changed-{b}-{i}" for i in ids]),
                "amount": pa.array([float(i + b) for i in ids], pa.float64()),
                "op": pa.array(ops),
            }
        )
        pq.write_table(t, directory / f"part-{b:04d}.parquet")


def run_yardstick(src: DataFrame, uri: str, ckpt: Path) -> float:
    def each(df: DataFrame, _batch: int) -> None:
        data = df.toArrow()
        if not data.num_rows:
            return
        (
            DeltaTable(uri)
            .merge(data, predicate="t.id = s.id", source_alias="s", target_alias="t")
            .when_matched_delete(predicate="s.op = 'D'")
            .when_matched_update(
                updates={"name": "s.name", "amount": "s.amount"}, predicate="s.op != 'D'"
            )
            .when_not_matched_insert(
                updates={"id": "s.id", "name": "s.name", "amount": "s.amount"},
                predicate="s.op != 'D'",
            )
            .execute()
        )

    return time_foreach_batch(src, each, ckpt)


def run_delta_spark(src: DataFrame, uri: str, ckpt: Path) -> float:
    from delta.tables import DeltaTable as SparkDeltaTable

    def each(df: DataFrame, _batch: int) -> None:
        (
            SparkDeltaTable.forPath(df.sparkSession, uri)
            .alias("t")
            .merge(df.alias("s"), "t.id = s.id")
            .whenMatchedDelete(condition="s.op = 'D'")
            .whenMatchedUpdate(
                condition="s.op != 'D'", set={"name": "s.name", "amount": "s.amount"}
            )
            .whenNotMatchedInsert(
                condition="s.op != 'D'",
                values={"id": "s.id", "name": "s.name", "amount": "s.amount"},
            )
            .execute()
        )

    return time_foreach_batch(src, each, ckpt)


def run_variant(
    spark: SparkSession,
    variant: str,
    base: Path | str,
    changes_dir: Path,
    where: Path,
    interval: float,
) -> tuple[str, float]:
    """Merge the change files of ``changes_dir`` into a copy of the table at
    ``base`` (``where/table``) with ``variant``; the copy's URI and the seconds."""
    uri = str(where / "table")
    shutil.copytree(base, uri)
    src = parquet_stream(spark, changes_dir, 1)
    if variant == "DeltaSink":
        sink = DeltaSink(uri, key=["id"], delete_when=("op", "D"))
        return uri, time_job(spark, src, sink, where / "state", interval)
    if variant == ALTERNATIVE:
        return uri, run_delta_spark(src, uri, where / "spark")
    return uri, run_yardstick(src, uri, where / "spark")


def amplification(uri: str, since: int) -> tuple[int, int, int]:
    """(files removed, bytes removed, bytes added) by the table's versions after ``since``."""
    removed = files = added = 0
    for log in sorted((Path(uri) / "_delta_log").glob("*.json")):
        if int(log.stem) <= since:
            continue
        for line in log.read_text().splitlines():
            action = json.loads(line)
            if "remove" in action:
                files += 1
                removed += int(action["remove"].get("size") or 0)
            if "add" in action:
                added += int(action["add"]["size"])
    return files, removed, added


def rows_of(spark: object, uri: str) -> list[tuple[object, ...]]:
    """The table's rows, read by delta-spark (which reads deletion vectors)."""
    df = spark.read.format("delta").load(uri).select("id", "name", "amount")  # type: ignore[attr-defined]
    return sorted(tuple(r) for r in df.collect())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--changes", type=int, default=20_000)
    ap.add_argument("--batches", type=int, default=1, help="micro-batches of --changes each")
    ap.add_argument("--interval", type=float, default=5.0, help="the sink's checkpoint_interval")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--deletion-vectors", action="store_true", help="the base table has them on")
    ap.add_argument(
        "--distributions", default=",".join(DISTRIBUTIONS), help="a comma-separated subset"
    )
    add_conf_option(ap)
    args = ap.parse_args()
    distributions = [d for d in args.distributions.split(",") if d]
    variants = [v for v in args.variants.split(",") if v]
    if ALTERNATIVE not in variants or set(variants) - set(VARIANTS):
        ap.error(f"--variants: a subset of {VARIANTS} with {ALTERNATIVE!r}")
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="twophase-merge-bench-", dir=args.workdir))
    try:
        base = work / "base"
        base_table(base, args.rows, args.files)
        base_bytes = sum(f.stat().st_size for f in base.glob("*.parquet"))
        spark = bench_spark("twophase-merge-bench", jar_sets=["delta"], conf=args.conf)
        if args.deletion_vectors:
            spark.sql(
                f"ALTER TABLE delta.`{base}` SET TBLPROPERTIES (delta.enableDeletionVectors = true)"
            )
        base_version = int(
            spark.sql(f"DESCRIBE HISTORY delta.`{base}`").selectExpr("max(version)").first()[0]  # type: ignore[index]
        )
        total = args.changes * args.batches
        results: dict[tuple[str, str], list[float]] = {}
        amp: dict[tuple[str, str], tuple[int, int, int]] = {}
        for how in distributions:
            src_dir = work / f"changes-{how}"
            changes(src_dir, args.rows, args.changes, how, seed=7, batches=args.batches)
            for r in range(-1, args.repeat):
                tables: dict[str, str] = {}
                for variant in variants:
                    where = work / f"{how}-{variant}-{r + 1}"
                    uri, secs = run_variant(spark, variant, base, src_dir, where, args.interval)
                    tables[variant] = uri
                    amp[(how, variant)] = amplification(uri, base_version)
                    if r >= 0:
                        results.setdefault((how, variant), []).append(secs)
                    label = "warm-up" if r < 0 else f"run {r}"
                    print(f"{label:<8} {how:<8} {variant:<17} {secs:6.2f} s", flush=True)
                want = rows_of(spark, tables[ALTERNATIVE])
                for v in variants:
                    assert rows_of(spark, tables[v]) == want, f"{how}: {v}'s table differs"
                for uri in tables.values():
                    shutil.rmtree(Path(uri).parent)
        spark.stop()
        print()
        print(
            f"base table {args.rows:,} rows in {args.files} files ({base_bytes / 1e6:.1f} MB), "
            f"{args.changes:,} changes (10% deletes) in each of {args.batches} micro-batches, "
            f"the sink's checkpoint_interval={args.interval}, median of {args.repeat} after "
            f"a warm-up; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, "
            f"{time.strftime('%Y-%m-%d')}; deletion vectors "
            f"{'on' if args.deletion_vectors else 'off'}"
        )
        print(
            "| keys | variant | seconds | changes/s | vs `DeltaTable.merge` | vs delta-spark MERGE "
            "| files removed | bytes rewritten per changed row |"
        )
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for how in distributions:
            yard = results.get((how, VARIANTS[0]))
            alt = statistics.median(results[(how, ALTERNATIVE)])
            for variant in variants:
                med = statistics.median(results[(how, variant)])
                files, removed, _added = amp[(how, variant)]
                vs_yard = f"{statistics.median(yard) / med:.2f}" if yard else "-"
                print(
                    f"| {how} | {variant} | {med:.2f} | {total / med:,.0f} | "
                    f"{vs_yard} | {alt / med:.2f} | {files} | {removed / total:,.0f} |"
                )
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
