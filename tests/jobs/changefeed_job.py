"""A bounded PySpark job whose one pipeline applies a change feed (rows ``{id,
seq, op, name}``, ``op`` I/U/D, see ``tests/changefeed.py``) to keyed sinks:
``key=id``, ``order_by=seq``, ``delete_when=("op", "D")`` in each. Run as a
separate driver process by the model tests, which SIGKILL it at random.

Sinks (``--sinks``, a comma-separated subset): ``pg`` (table ``--table`` of
``--dsn``, which must exist with a primary key on ``id``), ``kafka`` (a
changelog topic ``--topic`` at ``--bootstrap``), ``delta`` (table ``--delta``,
created on first use; ``--delta-spark``: the session has delta-spark, for a
table with features only it writes). ``--hostile``: the feed of ``write_hostile_feed``, keyed
by ``(region, id)`` (Kafka: by ``k``), Delta partitioned by ``region``. Exit
status 0 only when the run committed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lifecycle import Job
from sinks import DeltaSink, KafkaSink, PostgresSink, Sink
from tests.changefeed import HOSTILE_SCHEMA, SCHEMA
from tests.jobs._driver import finish, start_driver

RULES = {"order_by": "seq", "delete_when": ("op", "D")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--sinks", default="pg,kafka,delta")
    ap.add_argument("--dsn", default=None)
    ap.add_argument("--table", default="model")
    ap.add_argument("--bootstrap", default=None)
    ap.add_argument("--topic", default=None)
    ap.add_argument("--delta", default=None)
    ap.add_argument("--job", default="model")
    ap.add_argument("--interval", type=float, default=0.0)
    ap.add_argument("--hostile", action="store_true", help="the (region, id) feed")
    ap.add_argument(
        "--delta-spark", action="store_true", help="a session with delta-spark (feature tables)"
    )
    args = ap.parse_args()
    spark = start_driver(args.job, jvm_packages=args.delta_spark)
    schema = HOSTILE_SCHEMA if args.hostile else SCHEMA
    df = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).json(args.input)
    key = ["region", "id"] if args.hostile else ["id"]
    sinks: list[Sink] = []
    for kind in args.sinks.split(","):
        if kind == "pg":
            sinks.append(PostgresSink(args.dsn, args.table, key=key, sink_id="pg", **RULES))
        elif kind == "kafka":
            k = "k" if args.hostile else "id"
            sinks.append(KafkaSink(args.bootstrap, args.topic, key=k, sink_id="kafka", **RULES))
        elif kind == "delta":
            parts = ["region"] if args.hostile else None
            sinks.append(
                DeltaSink(args.delta, key=key, partition_by=parts, sink_id="delta", **RULES)
            )
        else:
            ap.error(f"unknown sink {kind!r}")
    job = Job(spark, args.job, args.state, checkpoint_interval=args.interval)
    job.add_pipeline("feed", df, sinks, bounded=True)
    return finish(spark, job.run())


if __name__ == "__main__":
    sys.exit(main())
