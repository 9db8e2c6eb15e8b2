"""A bounded PySpark job writing JSON input files to Kafka (and, with --dsn, to
PostgreSQL from the same pipeline); run as a separate driver process by the
Kafka crash tests (which SIGKILL it). Modelled on ``pg_job.py``.

    --sinks kafka        KafkaSink only (default)
    --sinks kafka,pg     both, committed in this order (needs --dsn)

``--sasl-user USER --cafile PEM`` reaches a SASL_SSL (SCRAM-SHA-512) listener
as USER, whose password is in ``$TWOPHASE_TEST_KAFKA_PASSWORD`` (never on the
command line, which the tests' logs repeat); ``--id-prefix`` and ``--registry``
set ``transactional_id_prefix`` and ``registry_topic``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lifecycle import Job
from sinks import KafkaSink, PostgresSink, Sink
from tests.jobs._driver import finish, start_driver
from tests.sparkutil import INPUT_SCHEMA


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--job", default="kcrash")
    ap.add_argument("--interval", type=float, default=0.0)
    ap.add_argument("--files-per-batch", type=int, default=1)
    ap.add_argument("--sinks", default="kafka")
    ap.add_argument("--dsn", default=None)
    ap.add_argument("--table", default="orders")
    ap.add_argument("--sasl-user", default=None)
    ap.add_argument("--cafile", default=None)
    ap.add_argument("--id-prefix", default=None)
    ap.add_argument("--registry", default=None)
    args = ap.parse_args()
    secured: dict[str, Any] = {}
    if args.sasl_user:
        secured["producer_config"] = {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": args.sasl_user,
            "sasl_plain_password": os.environ["TWOPHASE_TEST_KAFKA_PASSWORD"],
            "ssl_cafile": args.cafile,
        }
    if args.id_prefix:
        secured["transactional_id_prefix"] = args.id_prefix
    if args.registry:
        secured["registry_topic"] = args.registry
    spark = start_driver(args.job)
    df = (
        spark.readStream.schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", args.files_per_batch)
        .json(args.input)
    )
    sinks: list[Sink] = []
    for kind in args.sinks.split(","):
        if kind == "kafka":
            sinks.append(
                KafkaSink(args.bootstrap, args.topic, key="id", commit_timeout=120, **secured)
            )
        elif kind == "pg":
            if not args.dsn:
                ap.error("--sinks pg needs --dsn")
            sinks.append(PostgresSink(args.dsn, args.table))
        else:
            ap.error(f"unknown sink {kind!r}")
    job = Job(spark, args.job, args.state, checkpoint_interval=args.interval)
    job.add_pipeline("load", df, sinks, bounded=True)
    return finish(spark, job.run())


if __name__ == "__main__":
    sys.exit(main())
