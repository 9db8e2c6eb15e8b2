"""The read-process-write job of ``examples/read_process_write.py`` (Spark's
Kafka source in, Kafka, PostgreSQL and Delta out), run as its own driver
process by ``tests/test_kafka_source.py``, which SIGKILLs it.

The job drains (``Job.stop(drain=True)``) once the file ``--drain-when``
exists: the test writes it when the live topic holds all its input, so every
start after that reads what is left and ends. Exit status 0 only when the run
committed.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.read_process_write import build
from tests.jobs._driver import finish, start_driver


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--delta", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--topics", required=True, help="HISTORY,LIVE,PRICED")
    ap.add_argument("--table", required=True)
    ap.add_argument("--per-batch", type=int, default=200)
    ap.add_argument("--drain-when", required=True)
    args = ap.parse_args()
    spark = start_driver(args.job, jvm_packages=True)
    history, live, priced = args.topics.split(",")
    job = build(
        spark,
        bootstrap=args.bootstrap,
        dsn=args.dsn,
        delta=args.delta,
        state=args.state,
        name=args.job,
        topics=(history, live, priced),
        table=args.table,
        per_batch=args.per_batch,
    )

    def drain_when_told() -> None:
        while not Path(args.drain_when).exists():
            time.sleep(0.2)
        job.stop(drain=True)

    threading.Thread(target=drain_when_told, daemon=True).start()
    return finish(spark, job.run())


if __name__ == "__main__":
    sys.exit(main())
