"""Peak memory of each sink's job against its alternative's, process by process.

Every variant runs in a process of its own: the sink's throughput script
(``kafka_throughput.py``, ``pg_throughput.py``, ``delta_throughput.py``) with
``--variants <one> --repeat 1`` (a warm-up run and a counted run of that one
variant, each checked by the script: all rows once, nothing open), so that
its driver, its JVM and its Python workers hold nothing of another variant's
(a JVM keeps the heap it grew, and Spark reuses its Python workers). This
process watches the child's process tree (:class:`benchmarks._memory.TreeSampler`)
and reports, per variant, the peak of

* the driver's Python (the script: its high-water mark, ``VmHWM``);
* the JVM (Spark's driver; in ``local[2]`` its executors too: ``VmHWM``);
* the Python workers (the executors' Python side: the greatest sum of their
  proportional set sizes, so pages the forked workers share count once);

and the ratio of each to the alternative's. PostgreSQL and Apache Kafka are
started here, outside the watched trees (``--dsn``, ``--bootstrap`` of the
scripts). The variants of a sink alternate, ``--rounds`` rounds; figures are
medians. Pairs (the sink, then its alternative):

* Kafka: ``exactly-once`` (:class:`sinks.KafkaSink` in a Job) against
  ``spark-kafka`` (Spark's own Kafka writer in ``foreachBatch``);
* PostgreSQL: ``exactly-once`` against ``jdbc`` (Spark's JDBC writer);
* Delta: ``DeltaSink spark`` against ``delta-spark txnVersion`` (delta-spark's
  idempotent writes).

    python benchmarks/memory.py [--sinks kafka,pg,delta] [--rows N] [--rounds R]
                                [--out benchmarks/results]

Writes ``memory.md`` (the table, also printed) and ``memory.json`` (every run)
into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._memory import TreeSampler  # noqa: E402

PAIRS = {
    "kafka": ("kafka_throughput.py", "exactly-once", "spark-kafka"),
    "pg": ("pg_throughput.py", "exactly-once", "jdbc"),
    "delta": ("delta_throughput.py", "DeltaSink spark", "delta-spark txnVersion"),
}
SHOWN = ("driver", "jvm", "workers")
_RUN = re.compile(r"^run 0\s+(.+?)\s+([\d.]+) s\b", re.M)


@contextlib.contextmanager
def services(sinks: list[str]) -> Iterator[dict[str, list[str]]]:
    """PostgreSQL and Apache Kafka as the sinks need them, outside the watched
    trees; yields each script's extra arguments."""
    extra: dict[str, list[str]] = {s: [] for s in sinks}
    with contextlib.ExitStack() as stack:
        if "pg" in sinks:
            from lifecycle.testing.postgres_server import PostgresServer

            pg = PostgresServer()
            pg.start()
            stack.callback(pg.cleanup)
            extra["pg"] = ["--dsn", pg.dsn()]
        if "kafka" in sinks:
            from lifecycle.testing.apache_kafka import ApacheKafka

            broker = ApacheKafka()
            broker.start()
            stack.callback(broker.cleanup)
            extra["kafka"] = ["--bootstrap", broker.bootstrap]
        yield extra


def run_one(script: str, variant: str, rows: int, extra: list[str]) -> dict[str, object]:
    """One variant in its own process, watched; its peaks and its counted run's seconds."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / script),
        "--rows",
        str(rows),
        "--repeat",
        "1",
        "--variants",
        variant,
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    with TreeSampler(child.pid) as sampler:
        out, err = child.communicate()
        # the last sample sees the driver exited; its mark was kept from before
    peaks = sampler.peaks
    wall = time.perf_counter() - t0
    text = out.decode()
    if child.returncode != 0:
        raise RuntimeError(
            f"{script} {variant} failed ({child.returncode}):\n{err.decode()[-3000:]}"
        )
    found = _RUN.search(text)
    assert found and found.group(1) == variant, f"no counted run of {variant} in:\n{text}"
    return {
        "variant": variant,
        "seconds": float(found.group(2)),
        "wall": wall,
        "bytes": dict(peaks.bytes),
        "processes": dict(peaks.processes),
        "samples": peaks.samples,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--sinks", default="kafka,pg,delta")
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    sinks = [s for s in args.sinks.split(",") if s]
    if set(sinks) - set(PAIRS):
        ap.error(f"--sinks: a subset of {sorted(PAIRS)}")
    load_before = os.getloadavg()
    runs: list[dict[str, object]] = []
    with services(sinks) as extra:
        for r in range(args.rounds):
            for sink in sinks:
                script, ours, theirs = PAIRS[sink]
                order = (ours, theirs) if r % 2 == 0 else (theirs, ours)
                for variant in order:
                    run = run_one(script, variant, args.rows, extra[sink])
                    run.update(sink=sink, round=r)
                    runs.append(run)
                    b = run["bytes"]
                    assert isinstance(b, dict)
                    print(
                        f"round {r} {sink:<5} {variant:<22} {run['seconds']:6.2f} s  "
                        + "  ".join(f"{k} {b[k] / 2**20:,.0f} MiB" for k in SHOWN),
                        file=sys.stderr,
                        flush=True,
                    )
    load_after = os.getloadavg()

    def med(sink: str, variant: str, key: str) -> float:
        vals = [
            (r["bytes"][key] if key in SHOWN else r[key])  # type: ignore[index]
            for r in runs
            if r["sink"] == sink and r["variant"] == variant
        ]
        return float(statistics.median(vals))  # type: ignore[arg-type]

    header = (
        f"{args.rows:,} rows (the scripts' 20 files, 2 a micro-batch), each variant in its "
        f"own process, a warm-up and a counted run each; median of {args.rounds} alternating "
        f"rounds; {os.cpu_count()} cores, load {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after; {datetime.date.today()}; "
        f"`{shlex.join(['python', 'benchmarks/memory.py', *sys.argv[1:]])}`"
    )
    lines = [
        header,
        "",
        "| sink | variant | seconds | driver MiB | JVM MiB | Python workers MiB "
        "| driver vs alt. | JVM vs alt. | workers vs alt. |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for sink in sinks:
        _, ours, theirs = PAIRS[sink]
        for variant in (ours, theirs):
            cells = [f"{med(sink, variant, k) / 2**20:,.0f}" for k in SHOWN]
            ratios = [
                f"{med(sink, variant, k) / med(sink, theirs, k):.2f}"
                if med(sink, theirs, k)
                else "-"
                for k in SHOWN
            ]
            lines.append(
                f"| {sink} | {variant} | {med(sink, variant, 'seconds'):.2f} | "
                + " | ".join(cells)
                + " | "
                + " | ".join(ratios)
                + " |"
            )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.md").write_text(table + "\n")
    (out / "memory.json").write_text(
        json.dumps({"header": header, "runs": runs}, indent=1, default=str) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
