"""The three-sink demo: one job, PostgreSQL, Kafka and Delta Lake together, killed
and restarted, then checked from the sinks themselves.

What it does (``bash scripts/example.sh`` runs it):

1. starts a private PostgreSQL server and Apache Kafka (tansu when the broker's
   jars are not fetched) on loopback, and writes the input: a bounded backfill of order files, and a
   live directory that a feeder fills with event files while the job runs;
2. runs the job in a process of its own (``three_sinks.py job ...``): pipeline
   ``backfill`` (bounded) upserts the orders into PostgreSQL and appends them to
   a Delta table; pipeline ``live`` (unbounded) writes each event to a Kafka
   topic and to a PostgreSQL table;
3. SIGKILLs that process mid-way, shows ``twophase status`` of the dead job,
   and starts it again: it recovers and goes on;
4. when the backfill is done and every event file is written, drains the job
   (``twophase stop --drain``): one shared final checkpoint commits the rest;
5. reads every sink back (Kafka from its control markers) and prints a table:
   rows, duplicates, lost, and dangling work (prepared PostgreSQL transactions,
   open Kafka transactions, staged Delta files); then ``twophase audit`` checks
   each sink's own commit records against the ledger.

    python examples/three_sinks.py [--orders N] [--events N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EVENT_FILES = 40
ORDER_FILES = 40


# -- the job -------------------------------------------------------------------------


def run_job(args: argparse.Namespace) -> int:
    """The job the demo runs (twice): two pipelines, three kinds of sink."""
    from pyspark.sql import SparkSession

    from lifecycle import Job, configure_logging
    from sinks import DeltaSink, KafkaSink, PostgresSink

    configure_logging()
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("twophase-three-sinks")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    work = Path(args.work)
    orders = (
        spark.readStream.schema("order_id long, customer string, amount double")
        .option("maxFilesPerTrigger", 2)
        .json(str(work / "backfill"))
    )
    events = (
        spark.readStream.schema("event_id long, order_id long, kind string")
        .option("maxFilesPerTrigger", 4)
        .json(str(work / "live"))
    )
    job = Job(spark, "three-sinks", work / "state", checkpoint_interval=1.0, progress="off")
    job.add_pipeline(
        "backfill",
        orders,
        [
            PostgresSink(args.dsn, "orders", key=["order_id"], sink_id="pg"),
            DeltaSink(str(work / "delta-orders"), sink_id="delta"),
        ],
        bounded=True,
    )
    job.add_pipeline(
        "live",
        events,
        [
            KafkaSink(args.bootstrap, "events", key="event_id", sink_id="kafka"),
            PostgresSink(args.dsn, "events", create_table=True, sink_id="pg"),
        ],
        trigger_interval=0.5,
    )
    result = job.run()
    spark.stop()
    return 0 if result.committed else 1


# -- the demo ------------------------------------------------------------------------


class Feeder(threading.Thread):
    """Writes the live event files, one every ``every`` seconds."""

    def __init__(self, directory: Path, events: int, every: float) -> None:
        super().__init__(name="feeder", daemon=True)
        self.directory, self.events, self.every = directory, events, every
        self.done = threading.Event()

    def run(self) -> None:
        per = self.events // EVENT_FILES
        for f in range(EVENT_FILES):
            ids = range(f * per, self.events if f == EVENT_FILES - 1 else (f + 1) * per)
            _write_json(
                self.directory / f"events-{f:03d}.json",
                ({"event_id": i, "order_id": i % 997, "kind": "paid"} for i in ids),
            )
            time.sleep(self.every)
        self.done.set()


def _write_json(path: Path, rows: Any) -> None:
    tmp = path.with_name("." + path.name + ".tmp")  # Spark skips dot files
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.rename(path)


def _ledger(state: Path) -> dict[str, Any]:
    from lifecycle.ledger import read_ledger

    try:
        return read_ledger(state) or {}
    except Exception:  # being written: look again
        return {}


def _rows(doc: dict[str, Any], pipeline: str) -> int:
    return max(
        (n for k, n in (doc.get("totals") or {}).items() if k.startswith(pipeline + "/")),
        default=0,
    )


def _wait(
    what: str, predicate: Any, job: subprocess.Popen[bytes], log: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if job.poll() is not None:
            raise SystemExit(f"the job exited ({job.returncode}) before {what}; its log: {log}")
        if time.monotonic() > deadline:
            job.kill()
            raise SystemExit(f"timed out waiting for {what}; the job's log: {log}")
        time.sleep(0.2)


def _start_job(work: Path, dsn: str, bootstrap: str, log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "ab")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "job",
            "--work",
            str(work),
            "--dsn",
            dsn,
            "--bootstrap",
            bootstrap,
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _twophase(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lifecycle.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


def demo(args: argparse.Namespace) -> int:
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    from lifecycle.status import summary
    from lifecycle.testing import jars
    from lifecycle.testing.apache_kafka import ApacheKafka
    from lifecycle.testing.kafka_broker import KafkaBroker
    from lifecycle.testing.postgres_server import PostgresServer

    began = time.monotonic()
    ok = False
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="twophase-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "job.log"
    # Apache Kafka, the broker users run, when its jars are fetched (scripts/_venv.sh
    # does); else the embedded tansu, so that the demo runs without Maven too
    apache = jars.available("kafka-broker")
    pg = PostgresServer()
    broker = ApacheKafka() if apache else KafkaBroker()
    try:
        pg.start()
        broker.start()
        dsn, bootstrap = pg.dsn(), broker.bootstrap
        kind = f"Apache Kafka {jars.KAFKA_VERSION}" if apache else "Kafka (tansu)"
        print(f"services: PostgreSQL {dsn}, {kind} {bootstrap}")
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(
                "CREATE TABLE orders (order_id bigint PRIMARY KEY, customer text, amount float8)"
            )
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics([NewTopic("events", num_partitions=3, replication_factor=1)])
        admin.close()
        per = args.orders // ORDER_FILES
        (work / "backfill").mkdir()
        for f in range(ORDER_FILES):
            ids = range(f * per, args.orders if f == ORDER_FILES - 1 else (f + 1) * per)
            _write_json(
                work / "backfill" / f"orders-{f:03d}.json",
                ({"order_id": i, "customer": f"c{i % 97}", "amount": i * 1.25} for i in ids),
            )
        (work / "live").mkdir()
        feeder = Feeder(work / "live", args.events, every=0.6)
        feeder.start()
        print(
            f"input: backfill {args.orders:,} orders in {ORDER_FILES} files; live "
            f"{args.events:,} events in {EVENT_FILES} files, one every 0.6 s"
        )
        state = work / "state"

        job = _start_job(work, dsn, bootstrap, log)
        print(f"run 1: job started (pid {job.pid})")
        _wait(
            "three checkpoints",
            lambda: (
                len(_ledger(state).get("history") or []) >= 3
                and _rows(_ledger(state), "backfill") > 0
            ),
            job,
            log,
            120,
        )
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        doc = _ledger(state)
        print(
            f"run 1: SIGKILL after {len(doc.get('history') or [])} checkpoints; committed so far: "
            f"backfill {_rows(doc, 'backfill'):,}, live {_rows(doc, 'live'):,}"
        )
        status = _twophase("status", "--json", str(state))
        seen = json.loads(status.stdout)
        print(f"twophase status: {summary(seen)}")  # e.g. DIED, failed (exit 4: ...)

        job = _start_job(work, dsn, bootstrap, log)
        print(f"run 2: restarted (pid {job.pid}); it recovers, then goes on")
        _wait(
            "the backfill and every event file",
            lambda: "backfill" in (_ledger(state).get("finished") or []) and feeder.done.is_set(),
            job,
            log,
            240,
        )
        stop = _twophase("stop", "--drain", "--timeout", "120", str(state))
        print(f"run 2: twophase stop --drain: exit {stop.returncode}")
        code = job.wait(60)
        doc = _ledger(state)
        kinds = Counter(cp["kind"] for cp in doc.get("history") or [])
        print(f"run 2: exit {code}; checkpoints kept in the ledger: {dict(kinds)}")
        ok = _verify(work, dsn, bootstrap, args) and code == 0 and stop.returncode == 0
        audit = _twophase("audit", "--all", str(state))
        summary = next(
            (ln for ln in audit.stdout.splitlines() if ln.startswith("transactions:")),
            audit.stderr.strip()[-300:],
        )
        print(f"twophase audit (sink records vs the ledger): exit {audit.returncode}; {summary}")
        ok = ok and audit.returncode == 0
        print(f"\n{'OK' if ok else 'FAILED'}: demo took {time.monotonic() - began:.0f} s")
        return 0 if ok else 1
    except BaseException:
        ok = False
        raise
    finally:
        broker.cleanup()
        pg.cleanup()
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"the demo's files and the job's log ({log.name}) are kept in {work}")


def _verify(work: Path, dsn: str, bootstrap: str, args: argparse.Namespace) -> bool:
    """Read every sink back; print the table; True when it is exactly once."""
    import psycopg
    from deltalake import DeltaTable

    from lifecycle.testing.verify import (
        json_field,
        open_transactions_kafka,
        prepared_postgres,
        read_settled,
        staged_delta,
    )

    with psycopg.connect(dsn) as c:
        orders = [r[0] for r in c.execute("SELECT order_id FROM orders")]
        events = [r[0] for r in c.execute("SELECT event_id FROM events")]
    prepared = len(prepared_postgres(dsn))
    delta = work / "delta-orders"
    ids = DeltaTable(str(delta)).to_pyarrow_table(columns=["order_id"])["order_id"].to_pylist()
    topic = read_settled(bootstrap, "events")
    kafka_ids = [json_field("event_id")(r) for r in topic.committed]
    kafka_open = topic.n_open + len(open_transactions_kafka(bootstrap, "three-sinks"))
    table = [
        ("postgres orders (backfill, upsert)", orders, args.orders, prepared),
        ("delta orders (backfill, append)", ids, args.orders, len(staged_delta(delta))),
        ("kafka events (live)", kafka_ids, args.events, kafka_open),
        ("postgres events (live)", events, args.events, prepared),
    ]
    print(f"\n{'sink':<36}{'rows':>9}{'expected':>10}{'duplicates':>12}{'lost':>7}{'dangling':>10}")
    ok = True
    for name, got, expected, dangling in table:
        dups = sum(n - 1 for n in Counter(got).values() if n > 1)
        lost = len(set(range(expected)) - set(got))
        extra = len(set(got) - set(range(expected)))
        ok &= dups == 0 and lost == 0 and extra == 0 and dangling == 0
        print(f"{name:<36}{len(got):>9,}{expected:>10,}{dups:>12}{lost:>7}{dangling:>10}")
    print(
        "dangling: prepared PostgreSQL transactions, open Kafka records and transactions, "
        "staged Delta files"
    )
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role")
    j = sub.add_parser("job", help="the job itself (the demo starts it)")
    j.add_argument("--work", required=True)
    j.add_argument("--dsn", required=True)
    j.add_argument("--bootstrap", required=True)
    ap.add_argument("--orders", type=int, default=100_000)
    ap.add_argument("--events", type=int, default=12_000)
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temp dir)")
    args = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return run_job(args) if args.role == "job" else demo(args)


if __name__ == "__main__":
    sys.exit(main())
