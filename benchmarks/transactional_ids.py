"""The transaction coordinator's count of a job's transactional ids, batch after batch.

Apache Kafka keeps every transactional id's state for
``transactional.id.expiration.ms`` (7 days). The Kafka sink reuses a bounded
pool of ids (``sinks/kafka/pool.py``); before it, every batch, partition and
attempt had an id of its own. This runs ``--batches`` batches of ``--tasks``
tasks through the driver without Spark (``benchmarks/_driver.py``: real
writers in executor processes, the coordinator's checkpoints with their
commits, sweeps and lane releases), once with the pool and once with one id
per transaction (the sink's lease switched off), and prints the count of the
job's ids that ListTransactions reports every ``--every`` batches.

    python benchmarks/transactional_ids.py [--batches 1000] [--tasks 4] [--every 100]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402

from benchmarks._driver import (  # noqa: E402
    PIPELINE,
    SCHEMA,
    Driver,
    executors,
    services,
    unique,
)
from sinks import KafkaSink  # noqa: E402
from sinks.kafka.wire import KafkaWire  # noqa: E402


class _OneIdPerTransaction(KafkaSink):
    """The sink as it was before the pool: no lease, an id per transaction."""

    def preflight(self, schema: pa.Schema) -> None:
        super().preflight(schema)
        self.pooled_ids = False  # as on a broker that cannot describe transactions: no lease


def _count(bootstrap: str, incarnation: str) -> int:
    """The ids of one incarnation of the job that the coordinators hold."""
    with KafkaWire(bootstrap) as wire:
        return sum(1 for t in wire.list_transactions() if f".i{incarnation}." in t)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--tasks", type=int, default=4, help="tasks (Kafka partitions) per batch")
    ap.add_argument("--rows", type=int, default=10, help="rows per task")
    ap.add_argument("--every", type=int, default=100, help="count every N batches")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    counts: dict[str, list[int]] = {}
    with services(kafka="apache") as s, executors() as pool:
        for label, kind in (
            ("pooled", KafkaSink),
            ("one id per transaction", _OneIdPerTransaction),
        ):
            name = unique("ids")
            sink = kind(
                s.bootstrap,
                name,
                key="id",
                create_topic=True,
                partitions=args.tasks,
                sink_id="kafka",
            )
            sink.preflight(SCHEMA)
            driver = Driver(s, name, {"kafka": sink})
            incarnation = driver.ledger.incarnation
            began = time.monotonic()
            counts[label] = []
            for b in range(args.batches):
                cs = driver.prepare_batch(b, args.tasks, args.rows, pool)
                driver.coordinator.register(PIPELINE, b, cs)
                driver.spark_completed(b)
                driver.coordinator.checkpoint()
                if (b + 1) % args.every == 0:
                    counts[label].append(_count(s.bootstrap, incarnation))
                    print(f"{label}: {b + 1} batches, {counts[label][-1]} ids", flush=True)
            print(f"{label}: {time.monotonic() - began:.0f} s", flush=True)
            driver.close()
    width = max(len(k) for k in counts)
    print(
        f"\n{'batches':>{width}}  "
        + "  ".join(f"{(i + 1) * args.every:>6}" for i in range(len(next(iter(counts.values())))))
    )
    for label, row in counts.items():
        print(f"{label:>{width}}  " + "  ".join(f"{c:>6}" for c in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
