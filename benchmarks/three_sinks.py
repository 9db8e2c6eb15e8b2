"""All three sinks in one job against the three writers Spark users run instead,
in one ``foreachBatch``: throughput, latency and the end of input to exit.

The same streaming job (Parquet files of rows {id, name, amount, qty} read as a
bounded stream, ``--files-per-batch`` files a micro-batch, repartitioned into
``--tasks`` tasks) writes every row to a Kafka topic, a Delta table and a
PostgreSQL table, two ways:

* ``alternatives`` (at-least-once, what a Spark user runs today): one
  ``foreachBatch`` that persists the batch, then writes it with Spark's own
  Kafka writer (``to_json(struct(*))`` values, string keys, ``acks=all``),
  delta-spark's idempotent write (``txnAppId``/``txnVersion``) and Spark's JDBC
  writer (``batchsize`` 10,000, ``reWriteBatchedInserts``);
* ``sinks`` (exactly-once): a :class:`lifecycle.Job` whose one pipeline has a
  :class:`sinks.KafkaSink`, a :class:`sinks.DeltaSink` and a
  :class:`sinks.PostgresSink`, at the default ``checkpoint_interval``.

Latency is read from what each run leaves behind, the same way for both:
a batch starts when Spark writes its ``offsets/N`` and ends when Spark writes
``commits/N``. The alternatives' rows are readable when their batch ends (each
writer commits inside it); the sinks' rows when the checkpoint covering the
batch is recorded committed in the job's ledger (``history``: ``cut`` and
``committed_at``). Reported: p50 and p99 of batch end to readable and of batch
start to readable, over every batch of every counted run, and the end of input
to exit (the last batch's end to the query's or the job's return).

Runs alternate after a warm-up round; every run is checked (every id once in
each output, nothing open in Kafka). Services are started on loopback as the
tests start them: PostgreSQL, Apache Kafka (``--broker tansu`` for tansu).
The jars: ``python -m lifecycle.testing.jars fetch spark-kafka delta jdbc``.

    python benchmarks/three_sinks.py [--rows N] [--files F] [--files-per-batch K]
        [--tasks T] [--repeat R] [--interval S] [--conf KEY=VALUE]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from kafka import KafkaAdminClient  # noqa: E402
from kafka.admin import NewTopic  # noqa: E402
from pyspark.sql import DataFrame, SparkSession  # noqa: E402

from benchmarks._common import (  # noqa: E402
    add_conf_option,
    bench_spark,
    make_input,
    parquet_stream,
    pct,
    time_foreach_batch,
)
from benchmarks.delta_throughput import delta_idempotent_write  # noqa: E402
from benchmarks.kafka_throughput import count_records, spark_kafka_write  # noqa: E402
from benchmarks.pg_throughput import DDL, jdbc_target  # noqa: E402
from lifecycle import Job  # noqa: E402
from lifecycle.ledger import read_ledger  # noqa: E402
from sinks import DeltaSink, KafkaSink, PostgresSink  # noqa: E402

VARIANTS = ("alternatives", "sinks")
PIPELINE = "load"


@dataclass
class Run:
    """One run's wall time and, per batch, when it started, ended and became readable."""

    seconds: float
    started: dict[int, float] = field(default_factory=dict)
    ended: dict[int, float] = field(default_factory=dict)
    readable: dict[int, float] = field(default_factory=dict)
    exited: float = 0.0

    def end_to_readable(self) -> list[float]:
        return [self.readable[b] - self.ended[b] for b in self.ended]

    def start_to_readable(self) -> list[float]:
        return [self.readable[b] - self.started[b] for b in self.ended]

    def end_of_input_to_exit(self) -> float:
        return self.exited - max(self.ended.values())


def _spark_times(checkpoint: Path) -> tuple[dict[int, float], dict[int, float]]:
    """(batch -> start, batch -> end) from a Spark checkpoint's offsets/ and commits/."""

    def mtimes(d: Path) -> dict[int, float]:
        return {int(p.name): p.stat().st_mtime for p in d.iterdir() if p.name.isdigit()}

    return mtimes(checkpoint / "offsets"), mtimes(checkpoint / "commits")


@dataclass
class Outputs:
    """Where one run writes: a fresh topic, Delta table and PostgreSQL table."""

    bootstrap: str
    dsn: str
    topic: str
    table: str
    delta: str

    def check(self, spark: SparkSession, rows: int, variant: str) -> None:
        committed, _aborted, still_open = count_records(self.bootstrap, self.topic)
        assert (committed, still_open) == (rows, 0), (
            f"{variant}: Kafka has {committed} committed and {still_open} open records, "
            f"expected {rows} and 0"
        )
        d = spark.read.format("delta").load(self.delta)
        n, ids = d.selectExpr("count(*)", "count(DISTINCT id)").first()  # type: ignore[misc]
        assert (n, ids) == (rows, rows), f"{variant}: Delta has {n} rows, {ids} ids"
        with psycopg.connect(self.dsn) as c:
            n, ids = c.execute(f"SELECT count(*), count(DISTINCT id) FROM {self.table}").fetchone()  # type: ignore[misc]
        assert (n, ids) == (rows, rows), f"{variant}: PostgreSQL has {n} rows, {ids} ids"


def run_alternatives(src: DataFrame, out: Outputs, where: Path) -> Run:
    url, props = jdbc_target(out.dsn)
    app = f"bench-{where.name}"

    def each(df: DataFrame, batch: int) -> None:
        df = df.persist()  # three writers read the same rows, as a careful user writes it
        try:
            spark_kafka_write(df, out.bootstrap, out.topic)
            delta_idempotent_write(df, out.delta, app, batch)
            df.write.jdbc(url, out.table, mode="append", properties=props)
        finally:
            df.unpersist()

    checkpoint = where / "spark"
    secs = time_foreach_batch(src, each, checkpoint)
    run = Run(secs, exited=time.time())
    run.started, run.ended = _spark_times(checkpoint)
    run.readable = dict(run.ended)
    return run


def run_sinks(
    spark: SparkSession, src: DataFrame, out: Outputs, where: Path, interval: float, partitions: int
) -> Run:
    sinks = [
        KafkaSink(out.bootstrap, out.topic, key="id", partitions=partitions),
        DeltaSink(out.delta),
        PostgresSink(out.dsn, out.table),
    ]
    state = where / "state"
    job = Job(spark, "bench", state, checkpoint_interval=interval)
    job.add_pipeline(PIPELINE, src, sinks, bounded=True)
    t0 = time.perf_counter()
    result = job.run(handle_signals=False)
    run = Run(time.perf_counter() - t0, exited=time.time())
    assert result.committed, result
    (checkpoint,) = [p.parent for p in state.glob("**/spark/commits")]
    run.started, run.ended = _spark_times(checkpoint)
    doc = read_ledger(state)
    assert doc is not None
    # a trimmed history would match early batches to a later checkpoint (cuts are cumulative)
    assert len(doc["history"]) < doc["limits"]["history"], "the ledger's history was trimmed"
    for cp in sorted(doc["history"], key=lambda c: c["committed_at"]):
        last = cp["cut"].get(PIPELINE, -1)
        for b in run.ended:
            if b <= last and b not in run.readable:
                run.readable[b] = cp["committed_at"]
    missing = sorted(set(run.ended) - set(run.readable))
    assert not missing, f"batches {missing} have no committed checkpoint in the ledger's history"
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--files-per-batch", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=64, help="tasks of each micro-batch")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--partitions", type=int, default=4, help="partitions of each topic")
    ap.add_argument("--interval", type=float, default=5.0, help="checkpoint_interval (default)")
    ap.add_argument("--broker", choices=("apache", "tansu"), default="apache")
    add_conf_option(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from lifecycle.testing.apache_kafka import ApacheKafka
    from lifecycle.testing.kafka_broker import KafkaBroker
    from lifecycle.testing.postgres_server import PostgresServer

    work = Path(tempfile.mkdtemp(prefix="twophase-three-bench-"))
    pg = PostgresServer(settings={"max_prepared_transactions": "1000", "max_connections": "300"})
    broker = ApacheKafka() if args.broker == "apache" else KafkaBroker()
    try:
        pg.start()
        broker.start()
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        make_input(work / "in", args.rows, args.files)
        spark = bench_spark(
            "twophase-three-bench", jar_sets=["spark-kafka", "delta", "jdbc"], conf=args.conf
        )
        runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
        for r in range(-1, args.repeat):  # run -1 warms up the JVM, not counted
            for variant in VARIANTS:
                name = f"bench_{variant}_{r + 1}_{uuid.uuid4().hex[:6]}"
                where = work / name
                out = Outputs(broker.bootstrap, pg.dsn(), name, name, str(where / "delta"))
                admin.create_topics([NewTopic(name, args.partitions, 1)])
                with psycopg.connect(out.dsn, autocommit=True) as c:
                    c.execute(DDL.format(t=name))
                src = parquet_stream(spark, work / "in", args.files_per_batch).repartition(
                    args.tasks
                )
                if variant == "alternatives":
                    run = run_alternatives(src, out, where)
                else:
                    run = run_sinks(spark, src, out, where, args.interval, args.partitions)
                out.check(spark, args.rows, variant)
                if r >= 0:
                    runs[variant].append(run)
                label = "warm-up" if r < 0 else f"run {r}"
                print(
                    f"{label:<8} {variant:<13} {run.seconds:6.2f} s "
                    f"{args.rows / run.seconds:>10,.0f} rows/s, end to readable p50 "
                    f"{statistics.median(run.end_to_readable()):.2f} s, end of input to exit "
                    f"{run.end_of_input_to_exit():.2f} s",
                    flush=True,
                )
        spark.stop()
        admin.close()
        batches = -(-args.files // args.files_per_batch)
        print()
        print(
            f"{args.rows:,} rows, {batches} micro-batches of {args.tasks} tasks, three outputs, "
            f"checkpoint_interval={args.interval}, median of {args.repeat} after a warm-up "
            f"(latency over all {args.repeat * batches} batches); {os.cpu_count()} cores, "
            f"load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d')}, Kafka: {args.broker}"
        )
        print(
            "| variant | seconds | rows/s | vs the alternatives | batch end to readable "
            "p50 / p99 | batch start to readable p50 / p99 | end of input to exit |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        alt = statistics.median(r.seconds for r in runs["alternatives"])
        for variant in VARIANTS:
            med = statistics.median(r.seconds for r in runs[variant])
            end = [x for r in runs[variant] for x in r.end_to_readable()]
            start = [x for r in runs[variant] for x in r.start_to_readable()]
            exit_ = statistics.median(r.end_of_input_to_exit() for r in runs[variant])
            print(
                f"| {variant} | {med:.2f} | {args.rows / med:,.0f} | {alt / med:.2f} | "
                f"{statistics.median(end):.2f} / {pct(end, 0.99):.2f} s | "
                f"{statistics.median(start):.2f} / {pct(start, 0.99):.2f} s | {exit_:.2f} s |"
            )
        return 0
    finally:
        broker.cleanup()
        pg.cleanup()


if __name__ == "__main__":
    sys.exit(main())
