"""A checkpoint's duration against the number of pipelines in one job.

Three jobs side by side (``--pipelines 1,5,20``), each a real ledger and
:class:`~lifecycle.coordinator.Coordinator` whose every pipeline has its own
three sinks (PostgreSQL, Apache Kafka, Delta: its own table, topic and Delta
table), on one PostgreSQL server and one Apache Kafka broker started here as
the tests start them. This is the job's driver without Spark
(``benchmarks/_driver.py``): a round gives every pipeline of a job one
micro-batch of ``--tasks`` tasks per sink, ``--rows`` rows a task, prepared by
real writers in executor processes, registered and marked complete by Spark;
then the job takes one checkpoint, which commits all of it. So the work a
checkpoint commits grows with the pipelines: ``pipelines x 3 x tasks``
transactions and files.

Rounds alternate between the jobs (1, 5, 20, 1, 5, 20, ...); the first is a
warm-up, not counted. Reported per job, p50 and p99 over ``--rounds``:

* the whole checkpoint (``Coordinator.checkpoint``: barrier, decision,
  commits, forget, sweep), timed around the call;
* its commit (the ledger's ``committed_at - decided_at``: the decision to
  every sink's commit acknowledged);
* per transaction committed, and each against the 1-pipeline job: a checkpoint
  that grows no faster than its work has a ratio of time to work of 1 or less.

Afterwards every sink of every pipeline is checked: each row once, nothing
prepared, open or staged. ``--out``: ``checkpoint-growth.md``,
``checkpoint-growth.json`` and ``checkpoint-growth.png``.

    python benchmarks/checkpoint_growth.py [--pipelines 1,5,20] [--tasks 8]
                                           [--rows 100] [--rounds 10]
                                           [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import pct  # noqa: E402
from benchmarks._driver import PIPELINE, Driver, executors, make_sinks, services  # noqa: E402


def pipeline_names(n: int) -> list[str]:
    return [PIPELINE, *(f"{PIPELINE}{i}" for i in range(1, n))]


def plot(summary: list[dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["pipelines"] for s in summary]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("whole_p50", "whole checkpoint p50"), ("commit_p50", "commit p50")):
        left.plot(xs, [s[key] * 1000 for s in summary], "o-", label=label)
    left.plot(xs, [s["whole_p99"] * 1000 for s in summary], "o--", label="whole checkpoint p99")
    left.set_xlabel("pipelines in the job (3 sinks each)")
    left.set_ylabel("ms")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xticks(xs, [str(x) for x in xs])
    left.legend()
    left.set_title("checkpoint duration")
    base = summary[0]
    right.plot(xs, [s["transactions"] / base["transactions"] for s in summary], "k:", label="work")
    right.plot(xs, [s["whole_p50"] / base["whole_p50"] for s in summary], "o-", label="checkpoint")
    right.set_xlabel("pipelines in the job (3 sinks each)")
    right.set_ylabel(f"x the {int(base['pipelines'])}-pipeline job")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xticks(xs, [str(x) for x in xs])
    right.legend()
    right.set_title("growth: checkpoint p50 against work committed")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--pipelines", default="1,5,20")
    ap.add_argument("--tasks", type=int, default=8, help="tasks per batch and sink (8)")
    ap.add_argument("--rows", type=int, default=100, help="rows per task (100)")
    ap.add_argument("--rounds", type=int, default=10, help="counted rounds (10)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    sizes = sorted({int(n) for n in args.pipelines.split(",")})
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("sinks.kafka").setLevel(logging.ERROR)
    from tests import deltacheck, kafkacheck, pgcheck

    load_before = os.getloadavg()
    whole: dict[int, list[float]] = {n: [] for n in sizes}
    commit: dict[int, list[float]] = {n: [] for n in sizes}
    most = max(sizes) * 3 * args.tasks
    with services(max_prepared=2 * most + 100, kafka="apache") as s, executors() as pool:
        drivers: dict[int, Driver] = {}
        for n in sizes:
            names = pipeline_names(n)
            made = {p: make_sinks(s, f"cg{n}_{p}") for p in names}
            drivers[n] = Driver(s, f"cg{n}", made[PIPELINE], {p: made[p] for p in names[1:]})
        for r in range(-1, args.rounds):
            for n in sizes:
                d = drivers[n]
                batch = r + 1
                for p, cs in d.prepare_batches(batch, args.tasks, args.rows, pool).items():
                    d.coordinator.register(p, batch, cs)
                    d.spark_completed(batch, p)
                t0 = time.perf_counter()
                cp = d.coordinator.checkpoint()
                took = time.perf_counter() - t0
                assert cp is not None and cp.committed_at is not None, (n, r, cp)
                assert all(cp.cut.get(p) == batch for p in d.pipelines), (n, cp.cut)
                if r >= 0:
                    whole[n].append(took)
                    commit[n].append(cp.committed_at - cp.decided_at)
                label = "warm-up" if r < 0 else f"round {r}"
                print(f"{label:<8} {n:>3} pipelines {took * 1000:8.1f} ms", file=sys.stderr)
        per_sink = (args.rounds + 1) * args.tasks * args.rows
        for n, d in drivers.items():
            d.close()
            for p in d.pipelines:
                name = f"cg{n}_{p}"
                pgcheck.assert_exactly_once(s.dsn, name, per_sink)
                kafkacheck.assert_exactly_once(s.bootstrap, name, per_sink)
                deltacheck.assert_exactly_once(s.root / name, per_sink)
                deltacheck.assert_nothing_staged(s.root / name)
        assert pgcheck.job_prepared(s.dsn, "bench") == []
    load_after = os.getloadavg()

    summary = []
    for n in sizes:
        txns = n * 3 * args.tasks
        summary.append(
            {
                "pipelines": n,
                "transactions": txns,
                "rows": n * 3 * args.tasks * args.rows,
                "whole_p50": pct(whole[n], 0.5),
                "whole_p99": pct(whole[n], 0.99),
                "commit_p50": pct(commit[n], 0.5),
                "commit_p99": pct(commit[n], 0.99),
            }
        )
    base = summary[0]
    header = (
        f"one micro-batch per pipeline and checkpoint, {args.tasks} tasks per sink, "
        f"{args.rows} rows a task, 3 sinks a pipeline (PostgreSQL, Apache Kafka, Delta); "
        f"{args.rounds} alternating rounds after a warm-up; every row checked once in every "
        f"sink, nothing prepared, open or staged; {os.cpu_count()} cores, load "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after; {datetime.date.today()}; "
        f"`{shlex.join(['python', 'benchmarks/checkpoint_growth.py', *sys.argv[1:]])}`"
    )
    lines = [
        header,
        "",
        "| pipelines | transactions a checkpoint | checkpoint p50 ms | p99 ms | commit p50 ms "
        "| p99 ms | ms per transaction (p50) | work vs 1 | checkpoint p50 vs 1 "
        "| time growth / work growth |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for sm in summary:
        work = sm["transactions"] / base["transactions"]
        grew = sm["whole_p50"] / base["whole_p50"]
        lines.append(
            f"| {sm['pipelines']} | {sm['transactions']:,} | {sm['whole_p50'] * 1000:,.0f} | "
            f"{sm['whole_p99'] * 1000:,.0f} | {sm['commit_p50'] * 1000:,.0f} | "
            f"{sm['commit_p99'] * 1000:,.0f} | "
            f"{sm['whole_p50'] * 1000 / sm['transactions']:.2f} | {work:.1f} | {grew:.2f} | "
            f"{grew / work:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint-growth.md").write_text(table + "\n")
    (out / "checkpoint-growth.json").write_text(
        json.dumps(
            {"header": header, "summary": summary, "whole": whole, "commit": commit}, indent=1
        )
        + "\n"
    )
    plot(summary, out / "checkpoint-growth.png", header.split(";")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
