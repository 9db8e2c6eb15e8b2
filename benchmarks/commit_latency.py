"""Checkpoint commit latency and end-to-end visibility latency, three sinks.

One pipeline writes to PostgreSQL, Kafka (tansu) and Delta; every micro-batch
has ``--tasks`` tasks per sink (64: 192 transactions a batch), each writing
``--rows`` rows. A producer thread plays Spark: one batch every
``--batch-every`` seconds, prepared by real writers, registered with the
coordinator, then marked complete (``commits/N``). The main thread plays the
job's loop: a checkpoint every ``--interval`` seconds. Reported, p50 and p99:

* commit latency: a checkpoint's barrier (its decision) to the last commit
  acknowledged (the ledger records it committed);
* the whole checkpoint: the same plus the sinks' ``forget`` and the sweep;
* visibility latency: a batch's end (registered, Spark complete) to its rows
  being readable (the checkpoint that committed it recorded as committed).

Afterwards every row is checked: exactly once in each sink, nothing prepared,
open or staged. This is the driver without Spark (``benchmarks/_driver.py``);
the same script run on an older commit gives the "before" figures.

    python benchmarks/commit_latency.py [--tasks 64] [--rows 100] [--batches 10]
                                        [--batch-every 1.5] [--interval 3.0]
                                        [--commit-connections N] [--kafka-commit-connections N]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import pct  # noqa: E402
from benchmarks._driver import (  # noqa: E402
    PIPELINE,
    Driver,
    executors,
    make_sinks,
    services,
    timed,
    unique,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=64, help="tasks per batch and sink (64)")
    ap.add_argument("--rows", type=int, default=100, help="rows per task (100)")
    ap.add_argument("--batches", type=int, default=10, help="micro-batches (10)")
    ap.add_argument("--batch-every", type=float, default=1.5, help="seconds between batches")
    ap.add_argument("--interval", type=float, default=3.0, help="checkpoint interval, seconds")
    ap.add_argument(
        "--commit-connections",
        type=int,
        help="commit_connections of the PostgreSQL and Kafka sinks (default: theirs)",
    )
    ap.add_argument(
        "--kafka-commit-connections", type=int, help="the Kafka sink's alone (overrides)"
    )
    args = ap.parse_args()
    options: dict[str, dict[str, Any]] = {"pg": {}, "kafka": {}}
    if args.commit_connections is not None:
        for opts in options.values():
            opts["commit_connections"] = args.commit_connections
    if args.kafka_commit_connections is not None:
        options["kafka"]["commit_connections"] = args.kafka_commit_connections
    logging.basicConfig(level=logging.WARNING)
    from tests import deltacheck, kafkacheck, pgcheck

    with services() as s, executors() as pool:
        name = unique("lat")
        sinks = make_sinks(s, name, options=options)
        driver = Driver(s, name, sinks)
        per_sink = {sid: timed(sink, "commit") for sid, sink in sinks.items()}
        ended: dict[int, float] = {}
        failure: list[BaseException] = []

        def produce() -> None:
            try:
                start = time.monotonic()
                for b in range(args.batches):
                    cs = driver.prepare_batch(b, args.tasks, args.rows, pool)
                    driver.coordinator.register(PIPELINE, b, cs)
                    driver.spark_completed(b)
                    ended[b] = time.time()
                    time.sleep(max(0.0, start + (b + 1) * args.batch_every - time.monotonic()))
            except BaseException as e:
                failure.append(e)

        producer = threading.Thread(target=produce, name="spark")
        producer.start()
        commit: list[float] = []
        whole: list[float] = []
        visible: dict[int, float] = {}
        sizes: list[int] = []
        while producer.is_alive() or len(visible) < len(ended):
            time.sleep(args.interval if producer.is_alive() else 0.1)
            if failure:
                raise failure[0]
            t0 = time.time()
            cp = driver.coordinator.checkpoint()
            if cp is None:
                continue
            assert cp.committed_at is not None
            whole.append(time.time() - t0)
            commit.append(cp.committed_at - cp.decided_at)
            cut = cp.cut.get(PIPELINE, -1)
            newly = [b for b in ended if b <= cut and b not in visible]
            sizes.append(len(newly))
            for b in newly:
                visible[b] = cp.committed_at - ended[b]
        producer.join()
        driver.close()
        n = args.batches * args.tasks * args.rows
        pgcheck.assert_exactly_once(s.dsn, name, n)
        assert pgcheck.job_prepared(s.dsn, "bench") == []
        kafkacheck.assert_exactly_once(s.bootstrap, name, n)
        deltacheck.assert_exactly_once(s.root / name, n)
        deltacheck.assert_nothing_staged(s.root / name)

    ms = 1000.0
    vis = list(visible.values())
    print(
        f"{args.batches} batches of {args.tasks} tasks x 3 sinks ({3 * args.tasks} transactions "
        f"a batch, {args.rows} rows a task), one every {args.batch_every}s, checkpoints every "
        f"{args.interval}s, commit_connections {options} ({len(commit)} checkpoints, "
        f"{statistics.mean(sizes):.1f} batches each); {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}; every row checked "
        "exactly once in every sink"
    )
    print()
    print("| latency | p50 ms | p99 ms | max ms |")
    print("| --- | ---: | ---: | ---: |")
    for label, xs in (
        ("checkpoint commit (barrier to last commit acknowledged)", commit),
        ("whole checkpoint (with forget and sweep)", whole),
        ("visibility (batch end to rows readable)", vis),
        *((f"of which {sid}'s commit", xs) for sid, xs in per_sink.items()),
    ):
        print(
            f"| {label} | {pct(xs, 0.5) * ms:,.0f} | {pct(xs, 0.99) * ms:,.0f} "
            f"| {max(xs) * ms:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
