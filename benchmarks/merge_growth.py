"""A keyed Delta merge's time and bytes rewritten against the table's size.

A fixed batch of ``--changes`` changes (20,000: 90% updates, 10% deletes, keys
drawn from the newest ``--window`` ids, 100,000: the shape of a change feed,
recent rows change) merges into base tables of ``--sizes`` rows (200,000,
2,000,000, 20,000,000), laid out as ``delta_merge.py`` lays its base table
out: ids 0..rows-1, each file one range of ids, here ``--rows-per-file``
(100,000) a file, so the tables have 2, 20 and 200 files. Each base table is
built once by Spark (``spark.range`` in as many partitions as files, written
by delta-spark in one version, with statistics) and copied afresh for every
run. Variants, the same streaming job (the changes as one Parquet file, one
micro-batch):

* ``DeltaSink(key=["id"], delete_when=("op", "D"))`` through a ``Job``
  (exactly-once): its plan keeps the files whose id range meets the changes';
* ``delta-spark MERGE`` (the user's alternative, at-least-once,
  ``delta_merge.run_delta_spark``): ``t.id = s.id``, delete, update, insert.

Reported per size, medians: seconds, files removed (rewritten), bytes
rewritten and added (read from the version each wrote, as ``delta_merge.py``
does), the sink against delta-spark, and each against its own time at the
smallest table. The sink's cost should follow the changes (the same files,
the same bytes at every size); delta-spark's MERGE reads the whole target.

Every run is checked through delta-spark: the table holds ``rows - deletes``
rows, each id once; every changed id holds its change and every deleted id is
gone; the two variants' tables have the same content (count and the sum of a
hash of every row).

Rounds alternate the variants; a warm-up round at the smallest size comes
first, not counted; sizes of more than ``--once-above`` rows (10,000,000) run
one round. ``--out``: ``merge-growth.md``, ``.json`` and ``.png``.

    python benchmarks/merge_growth.py [--sizes 200000,2000000,20000000]
        [--changes 20000] [--window 100000] [--rows-per-file 100000]
        [--repeat 3] [--once-above 10000000] [--workdir DIR] [--out benchmarks/results]
        [--conf spark.databricks.delta.snapshotPartitions=2]

(delta-spark's ``snapshotPartitions`` is 50 by default, a cost per version
on 2 cores; the comparison in docs/performance.md tunes it to 2.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import shlex
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
from pyspark.sql import SparkSession  # noqa: E402

from benchmarks._common import add_conf_option, bench_spark  # noqa: E402
from benchmarks.delta_merge import amplification, run_variant  # noqa: E402

VARIANTS = ("DeltaSink", "delta-spark MERGE")
ALTERNATIVE = "delta-spark MERGE"


def build_base(spark: SparkSession, uri: Path, rows: int, per_file: int) -> int:
    """The base table at ``uri``: ids 0..rows-1, a file per range of ``per_file``
    ids, one version; returns that version."""
    files = max(1, -(-rows // per_file))
    (
        spark.range(0, rows, 1, files)
        .selectExpr(
            "id", "concat('customer-', id % 1000) AS name", "CAST(id AS DOUBLE) * 0.25 AS amount"
        )
        .write.format("delta")
        .save(str(uri))
    )
    return 0


def make_changes(directory: Path, rows: int, n: int, window: int, seed: int) -> pa.Table:
    """One file of ``n`` changes to distinct ids among the newest ``window``."""
    rnd = random.Random(seed)
    ids = rnd.sample(range(rows - window, rows), n)
    t = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([f"changed-{i}" for i in ids]),
            "amount": pa.array([float(i) for i in ids], pa.float64()),
            "op": pa.array(["D" if rnd.random() < 0.1 else "U" for _ in ids]),
        }
    )
    directory.mkdir(parents=True)
    pq.write_table(t, directory / "part-0000.parquet")
    return t


def check(spark: SparkSession, uri: str, rows: int, changes: Path, what: str) -> tuple[int, int]:
    """All rows once, every change applied; returns (count, checksum)."""
    spark.read.format("delta").load(uri).createOrReplaceTempView("t")
    spark.read.parquet(str(changes)).createOrReplaceTempView("c")
    deletes = spark.sql("SELECT count(*) FROM c WHERE op = 'D'").first()[0]  # type: ignore[index]
    count, ids, checksum = spark.sql(
        "SELECT count(*), count(DISTINCT id), "
        "sum(CAST(xxhash64(id, name, amount) AS DECIMAL(38, 0))) FROM t"
    ).first()  # type: ignore[misc]
    want = rows - deletes
    assert (count, ids) == (want, want), f"{what}: {count} rows, {ids} ids; expected {want} once"
    wrong = spark.sql(
        "SELECT count(*) FROM c LEFT JOIN t ON c.id = t.id WHERE "
        "(c.op = 'D' AND t.id IS NOT NULL) OR "
        "(c.op <> 'D' AND (t.id IS NULL OR t.name <> c.name OR t.amount <> c.amount))"
    ).first()[0]  # type: ignore[index]
    assert wrong == 0, f"{what}: {wrong} changes not applied"
    return int(count), int(checksum)


def plot(summary: list[dict[str, object]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for variant in VARIANTS:
        mine = [s for s in summary if s["variant"] == variant]
        xs = [float(s["rows"]) for s in mine]  # type: ignore[arg-type]
        left.plot(xs, [s["seconds"] for s in mine], "o-", label=variant)
        right.plot(xs, [float(s["rewritten"]) / 1e6 for s in mine], "o-", label=variant)  # type: ignore[arg-type]
    base = [s for s in summary if s["variant"] == VARIANTS[0]]
    for ax, label in ((left, "seconds"), (right, "MB rewritten")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rows in the table (20,000 changes each)")
        ax.set_ylabel(label)
        ax.legend()
    xs = [float(s["rows"]) for s in base]  # type: ignore[arg-type]
    ys = [s["seconds"] for s in base]
    left.plot(xs, [float(ys[0]) * x / xs[0] for x in xs], "k:", label="proportional to the table")  # type: ignore[arg-type]
    left.legend()
    right.plot(
        xs,
        [float(s["table_bytes"]) / 1e6 for s in base],
        "k:",
        label="the whole table",  # type: ignore[arg-type]
    )
    right.legend()
    left.set_title("merge time")
    right.set_title("bytes rewritten")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--sizes", default="200000,2000000,20000000")
    ap.add_argument("--changes", type=int, default=20_000)
    ap.add_argument("--window", type=int, default=100_000)
    ap.add_argument("--rows-per-file", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--once-above", type=int, default=10_000_000)
    ap.add_argument("--interval", type=float, default=5.0, help="the sink's checkpoint_interval")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    add_conf_option(ap)
    args = ap.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if args.window > sizes[0] or args.changes > args.window:
        ap.error("--changes <= --window <= the smallest size")
    logging.basicConfig(level=logging.WARNING)
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="twophase-merge-growth-", dir=args.workdir))
    runs: list[dict[str, object]] = []
    try:
        spark = bench_spark("twophase-merge-growth", jar_sets=["delta"], conf=args.conf)
        built: dict[int, float] = {}
        for rows in sizes:
            t0 = time.perf_counter()
            build_base(spark, work / f"base-{rows}", rows, args.rows_per_file)
            built[rows] = time.perf_counter() - t0
            make_changes(work / f"changes-{rows}", rows, args.changes, args.window, seed=7)
            print(f"built {rows:,} rows in {built[rows]:.0f} s", file=sys.stderr, flush=True)
        plan = [(sizes[0], -1)] + [
            (rows, r) for rows in sizes for r in range(1 if rows > args.once_above else args.repeat)
        ]
        for rows, r in plan:
            base = work / f"base-{rows}"
            src_dir = work / f"changes-{rows}"
            sums: dict[str, tuple[int, int]] = {}
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                where = work / f"run-{rows}-{variant.replace(' ', '-')}-{r + 1}"
                uri, secs = run_variant(spark, variant, base, src_dir, where, args.interval)
                files, removed, added = amplification(uri, 0)
                sums[variant] = check(spark, uri, rows, src_dir, f"{rows:,} rows, {variant}")
                label = "warm-up" if r < 0 else f"run {r}"
                print(
                    f"{label:<8} {rows:>11,} {variant:<17} {secs:7.2f} s  {files} files, "
                    f"{removed / 1e6:.1f} MB rewritten",
                    file=sys.stderr,
                    flush=True,
                )
                if r >= 0:
                    runs.append(
                        {
                            "rows": rows,
                            "variant": variant,
                            "round": r,
                            "seconds": secs,
                            "files": files,
                            "rewritten": removed,
                            "added": added,
                        }
                    )
                shutil.rmtree(where)
            assert sums["DeltaSink"] == sums[ALTERNATIVE], f"{rows:,} rows: the tables differ"
        spark.stop()
        base_bytes = {
            rows: sum(f.stat().st_size for f in (work / f"base-{rows}").glob("*.parquet"))
            for rows in sizes
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()

    summary: list[dict[str, object]] = []
    for rows in sizes:
        for variant in VARIANTS:
            mine = [x for x in runs if x["rows"] == rows and x["variant"] == variant]
            summary.append(
                {
                    "rows": rows,
                    "variant": variant,
                    "rounds": len(mine),
                    "seconds": statistics.median(float(x["seconds"]) for x in mine),  # type: ignore[arg-type]
                    "files": statistics.median(int(x["files"]) for x in mine),  # type: ignore[call-overload]
                    "rewritten": statistics.median(int(x["rewritten"]) for x in mine),  # type: ignore[call-overload]
                    "added": statistics.median(int(x["added"]) for x in mine),  # type: ignore[call-overload]
                    "table_bytes": base_bytes[rows],
                }
            )

    def at(rows: int, variant: str) -> dict[str, object]:
        return next(s for s in summary if s["rows"] == rows and s["variant"] == variant)

    header = (
        f"{args.changes:,} changes (10% deletes) among the newest {args.window:,} ids, "
        f"{args.rows_per_file:,} rows a file, the sink's checkpoint_interval={args.interval}; "
        f"median of {args.repeat} alternating rounds after a warm-up (sizes above "
        f"{args.once_above:,} rows: one); every table checked through delta-spark; "
        f"{os.cpu_count()} cores, load {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"{datetime.date.today()}; settings {args.conf}; "
        f"`{shlex.join(['python', 'benchmarks/merge_growth.py', *sys.argv[1:]])}`"
    )
    lines = [
        header,
        "",
        "| rows | table MB | variant | rounds | seconds | vs delta-spark MERGE "
        "| time vs smallest table | files rewritten | MB rewritten | MB added |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summary:
        rows, variant = int(s["rows"]), str(s["variant"])  # type: ignore[call-overload]
        secs = float(s["seconds"])  # type: ignore[arg-type]
        alt = float(at(rows, ALTERNATIVE)["seconds"])  # type: ignore[arg-type]
        first = float(at(sizes[0], variant)["seconds"])  # type: ignore[arg-type]
        lines.append(
            f"| {rows:,} | {int(s['table_bytes']) / 1e6:,.0f} | {variant} | {s['rounds']} | "  # type: ignore[call-overload]
            f"{secs:.2f} | {alt / secs:.2f} | {secs / first:.2f} | {s['files']} | "
            f"{float(s['rewritten']) / 1e6:.1f} | {float(s['added']) / 1e6:.1f} |"  # type: ignore[arg-type]
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "merge-growth.md").write_text(table + "\n")
    (out / "merge-growth.json").write_text(
        json.dumps({"header": header, "summary": summary, "runs": runs}, indent=1) + "\n"
    )
    plot(summary, out / "merge-growth.png", header.split(";")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
