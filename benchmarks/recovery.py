"""Recovery speed: a restarted driver settles ~1,000 pending committables.

A driver prepares ``--pending`` transactions over PostgreSQL, Kafka (Apache
Kafka when its jars are fetched, ``--kafka tansu`` for the embedded broker)
and Delta (``--tasks`` per batch and sink) and registers every batch; Spark
completed all of them but the last. Then the driver dies before any
checkpoint (its objects are dropped, nothing is committed or aborted) and a
new driver (new sink objects, the same ledger) starts: ``Coordinator.recover()``
commits every batch Spark completed in one recovery checkpoint, aborts the
last batch (Spark replays it) and sweeps. Timed: ``recover()`` from its start
to its end (no JVM here at all; preflight and the sinks' claims come before).
Afterwards every row is checked: the completed batches exactly once in each
sink, nothing prepared, open or staged.

    python benchmarks/recovery.py [--pending 1000] [--tasks 67] [--repeat 3]
                                  [--kafka-commit-connections N] [--kafka apache|tansu]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._driver import (  # noqa: E402
    JOB,
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
    ap.add_argument("--pending", type=int, default=1000, help="pending committables (1000)")
    ap.add_argument("--tasks", type=int, default=67, help="tasks per batch and sink (67)")
    ap.add_argument("--rows", type=int, default=20, help="rows per task (20)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--kafka-commit-connections", type=int, help="the Kafka sink's commit_connections"
    )
    ap.add_argument("--kafka", choices=["apache", "tansu"], help="the broker (apache if fetched)")
    args = ap.parse_args()
    options: dict[str, dict[str, Any]] = {}
    if args.kafka_commit_connections is not None:
        options["kafka"] = {"commit_connections": args.kafka_commit_connections}
    logging.basicConfig(level=logging.WARNING)
    from tests import deltacheck, kafkacheck, pgcheck

    batches = math.ceil(args.pending / (3 * args.tasks))
    pending = batches * 3 * args.tasks
    took: list[float] = []
    for _ in range(args.repeat):  # fresh services each time: tansu slows as it sees more
        with services(kafka=args.kafka) as s, executors() as pool:
            name = unique("rec")
            first = Driver(s, name, make_sinks(s, name, options=options))
            for b in range(batches):
                first.coordinator.register(
                    PIPELINE, b, first.prepare_batch(b, args.tasks, args.rows, pool)
                )
                if b < batches - 1:
                    first.spark_completed(b)
            first.close()  # the driver dies: nothing committed or aborted
            second = Driver(s, name, make_sinks(s, name, options=options))
            calls = {
                f"{sid}.{m}": timed(sink, m)
                for sid, sink in second.sinks.items()
                for m in ("commit", "abort")
            }
            t0 = time.perf_counter()
            second.coordinator.recover()
            took.append(time.perf_counter() - t0)
            assert second.ledger.pending() == {}, second.ledger.pending()
            second.close()
            n = (batches - 1) * args.tasks * args.rows
            pgcheck.assert_exactly_once(s.dsn, name, n)
            assert pgcheck.job_prepared(s.dsn, JOB) == []
            kafkacheck.assert_exactly_once(s.bootstrap, name, n)
            deltacheck.assert_exactly_once(s.root / name, n)
            deltacheck.assert_nothing_staged(s.root / name)
            split = ", ".join(f"{k} {sum(v):.2f}" for k, v in calls.items())
            print(f"recover(): {took[-1]:.2f} s ({split})", flush=True)
    print(
        f"{pending} pending committables ({batches} batches x {args.tasks} tasks x 3 sinks, "
        f"the last batch not completed by Spark): recover() median {statistics.median(took):.2f}"
        f" s, min {min(took):.2f}, max {max(took):.2f} ({len(took)} runs; {os.cpu_count()} "
        f"cores, load {os.getloadavg()[0]:.2f}); every row checked exactly once in every sink"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
