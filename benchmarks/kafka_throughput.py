"""Throughput of the exactly-once Kafka sink against what a user could run instead.

Four variants, the same input (Parquet files of rows {id, name, amount, qty},
read as a bounded stream, available-now trigger, the same micro-batches) and
the same records (key: ``id`` as text; value: the row as JSON, both from
:mod:`sinks.kafka.encode`), each run into a fresh topic:

* ``librdkafka``: confluent-kafka ``Producer`` processes (as many as Spark's
  cores), non-transactional, ``acks=all``, the records encoded beforehand (only
  produce and flush are timed): the fastest client there is, with no Spark;
* ``floor``: the same streaming job, ``foreachBatch`` -> ``mapInArrow`` whose
  tasks discard their batches: what Spark's JVM -> Python -> JVM round trip
  costs before any sink does anything;
* ``twin``: the same job, each task sending its partition with the sink's own
  encoder and pipelined producer (:mod:`sinks.kafka.records`,
  :mod:`sinks.kafka.produce`), idempotent, outside any transaction:
  at-least-once, no ledger;
* ``spark-kafka``: what a Spark user runs instead, the same job with
  ``foreachBatch`` writing each micro-batch with Spark's own Kafka writer
  (``df.write.format("kafka")``: key ``CAST(id AS STRING)``, value
  ``to_json(struct(*))``, ``acks=all``), at-least-once, all in the JVM;
* ``jvm-floor``: the same ``to_json(struct(*))`` records written to Spark's
  ``noop`` writer: what the JVM route costs before any record is sent;
* ``exactly-once``: a :class:`lifecycle.Job` with a :class:`sinks.KafkaSink`.

Every producing run is checked afterwards from the raw log (control markers
applied): all rows there once, none open. Runs alternate after one warm-up
round; medians are reported with ratios against librdkafka and the floor.

    python benchmarks/kafka_throughput.py [--rows N] [--files F] [--files-per-batch K]
        [--repeat R] [--partitions P] [--bootstrap HOST:PORT] [--variants a,b,...]

Without ``--bootstrap`` a private broker is started on loopback, as the tests
do: Apache Kafka (``--broker apache``, the default) or tansu (``--broker tansu``).
Spark's Kafka writer needs the cached ``spark-kafka`` jars
(``python -m lifecycle.testing.jars fetch spark-kafka``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from kafka import KafkaAdminClient  # noqa: E402
from kafka.admin import NewTopic  # noqa: E402
from pyspark.sql import DataFrame  # noqa: E402

from benchmarks._common import (  # noqa: E402
    bench_spark,
    make_input,
    parquet_stream,
    time_foreach_batch,
    time_job,
)
from sinks import KafkaSink  # noqa: E402
from sinks.kafka import encode, partitioner, records  # noqa: E402
from sinks.kafka.produce import TxnProducer  # noqa: E402
from sinks.kafka.wire import KafkaWire  # noqa: E402

VARIANTS = ("librdkafka", "floor", "jvm-floor", "twin", "spark-kafka", "exactly-once")
_NO_TOPIC = ("floor", "jvm-floor")


# -- librdkafka -------------------------------------------------------------------------


def _rdkafka_worker(bootstrap: str, topic: str, files: list[str], start, out) -> None:  # type: ignore[no-untyped-def]
    import confluent_kafka

    pairs: list[tuple[bytes | None, bytes]] = []
    for f in files:
        for b in pq.read_table(f).to_batches():
            pairs.extend(zip(encode.to_bytes(b.column("id")), encode.json_rows(b), strict=True))
    producer = confluent_kafka.Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "linger.ms": 5,
            "batch.size": 1 << 20,
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    start.wait()
    t0 = time.perf_counter()
    produce, poll = producer.produce, producer.poll
    for key, value in pairs:
        while True:
            try:
                produce(topic, value, key)
                break
            except BufferError:
                poll(0.01)
    left = producer.flush(120)
    out.put((time.perf_counter() - t0, left))


def run_librdkafka(bootstrap: str, topic: str, files: list[str], processes: int) -> float:
    """``processes`` producer processes (``_rdkafka_worker``), timed from the moment
    every one of them has read and encoded its records (a barrier of all of them
    and this process) to the last one flushed: produce and flush only, not the
    workers' start (imports, reading, encoding: about 2 s here)."""
    ctx = mp.get_context("spawn")
    shares = [share for share in (files[i::processes] for i in range(processes)) if share]
    start = ctx.Barrier(len(shares) + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rdkafka_worker, args=(bootstrap, topic, share, start, out))
        for share in shares
    ]
    for p in procs:
        p.start()
    try:
        start.wait(timeout=600)  # every worker has its records encoded
        t0 = time.perf_counter()
        results = [out.get(timeout=600) for _ in procs]
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(left == 0 for _, left in results), results
    return wall


# -- Spark variants ---------------------------------------------------------------------


def _discard(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    n = 0
    for b in batches:
        n += b.num_rows
    yield pa.RecordBatch.from_pydict({"n": [n]})


def _twin_task(bootstrap: str, topic: str):  # type: ignore[no-untyped-def]
    """The twin's executor side: the sink's encoder and producer, no transaction."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        n = 0
        with KafkaWire(bootstrap) as wire:
            producer = TxnProducer(wire, None, transaction_timeout_ms=60_000)
            producer.begin()
            parts = sorted(producer.leaders(topic))
            rr = 0
            for b in batches:
                if b.num_rows == 0:
                    continue
                keys = encode.to_binary(b.column("id"))
                values = encode.json_values(b)
                idx = partitioner.partition_indexes(keys, len(parts), rr)
                rr = (rr + 1) % len(parts)
                sends = records.batches_by_partition(
                    idx,
                    parts,
                    keys,
                    values,
                    [],
                    sequence=lambda p: producer.next_sequence(topic, p),
                    producer_id=producer.producer_id,
                    producer_epoch=producer.epoch,
                    transactional=False,
                    timestamp_ms=int(time.time() * 1000),
                )
                producer.send(topic, sends)
                n += b.num_rows
            producer.flush()
        yield pa.RecordBatch.from_pydict({"n": [n]})

    return task


def run_floor(src: DataFrame, ckpt: Path) -> float:
    def each(df: DataFrame, _batch: int) -> None:
        df.mapInArrow(_discard, "n long").collect()

    return time_foreach_batch(src, each, ckpt)


def _as_records(df: DataFrame) -> DataFrame:
    """Spark's own route to Kafka records: the key as text, the row as JSON."""
    return df.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(*)) AS value")


def run_jvm_floor(src: DataFrame, ckpt: Path) -> float:
    def each(df: DataFrame, _batch: int) -> None:
        _as_records(df).write.format("noop").mode("append").save()

    return time_foreach_batch(src, each, ckpt)


def spark_kafka_write(df: DataFrame, bootstrap: str, topic: str) -> None:
    """One micro-batch through Spark's own Kafka writer, as its users write it."""
    (
        _as_records(df)
        .write.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("kafka.acks", "all")
        .option("topic", topic)
        .save()
    )


def run_spark_kafka(src: DataFrame, bootstrap: str, topic: str, ckpt: Path) -> float:
    def each(df: DataFrame, _batch: int) -> None:
        spark_kafka_write(df, bootstrap, topic)

    return time_foreach_batch(src, each, ckpt)


def run_twin(src: DataFrame, bootstrap: str, topic: str, ckpt: Path) -> float:
    task = _twin_task(bootstrap, topic)

    def each(df: DataFrame, _batch: int) -> None:
        df.mapInArrow(task, "n long").collect()

    return time_foreach_batch(src, each, ckpt)


# -- checking ---------------------------------------------------------------------------


def count_records(bootstrap: str, topic: str) -> tuple[int, int, int]:
    """(committed, aborted, open) data records of ``topic``, resolved from the
    control markers in the raw log like ``sinks/kafka/log.py``, but counting
    record batches instead of decoding every record."""
    committed = aborted = 0
    still_open = 0
    with KafkaWire(bootstrap) as wire:
        for partition, leader in sorted((wire.partition_leaders(topic) or {}).items()):
            pending: dict[int, int] = {}
            for batch in wire.batches(leader, topic, partition):
                if batch.is_control_batch:
                    n = pending.pop(batch.producer_id, 0)
                    if next(iter(batch)).commit:
                        committed += n
                    else:
                        aborted += n
                    continue
                n = batch.next_offset - batch.base_offset
                if batch.is_transactional:
                    pending[batch.producer_id] = pending.get(batch.producer_id, 0) + n
                else:
                    committed += n
            still_open += sum(pending.values())
    return committed, aborted, still_open


# -- main -------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--files-per-batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--partitions", type=int, default=4, help="partitions of each topic")
    ap.add_argument("--interval", type=float, default=5.0, help="checkpoint_interval (the default)")
    ap.add_argument("--bootstrap", help="Kafka bootstrap servers (default: start --broker)")
    ap.add_argument("--broker", choices=("apache", "tansu"), default="apache")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("sinks.kafka").setLevel(logging.ERROR)  # tansu's missing config
    work = Path(tempfile.mkdtemp(prefix="twophase-kbench-"))
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        if args.broker == "apache":
            from lifecycle.testing.apache_kafka import ApacheKafka

            broker = ApacheKafka()
        else:
            from lifecycle.testing.kafka_broker import KafkaBroker

            broker = KafkaBroker()
        broker.start()
        bootstrap = broker.bootstrap
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        make_input(work / "in", args.rows, args.files)
        files = sorted(str(p) for p in (work / "in").glob("*.parquet"))
        spark = bench_spark(
            "twophase-kafka-bench", jar_sets=["spark-kafka"] if "spark-kafka" in variants else []
        )
        cores = spark.sparkContext.defaultParallelism

        def source() -> DataFrame:
            return parquet_stream(spark, work / "in", args.files_per_batch)

        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(-1, args.repeat):  # round -1 warms up the JVM and workers
            for variant in variants:
                topic = f"bench-{variant}-{r + 1}-{uuid.uuid4().hex[:6]}"
                where = work / f"{variant}-{r + 1}"
                if variant not in _NO_TOPIC:
                    admin.create_topics([NewTopic(topic, args.partitions, 1)])
                if variant == "librdkafka":
                    secs = run_librdkafka(bootstrap, topic, files, cores)
                elif variant == "floor":
                    secs = run_floor(source(), where)
                elif variant == "jvm-floor":
                    secs = run_jvm_floor(source(), where)
                elif variant == "spark-kafka":
                    secs = run_spark_kafka(source(), bootstrap, topic, where)
                elif variant == "twin":
                    secs = run_twin(source(), bootstrap, topic, where)
                else:
                    sink = KafkaSink(bootstrap, topic, key="id")
                    secs = time_job(spark, source(), sink, where, args.interval)
                    sink.close()
                if variant not in _NO_TOPIC:
                    committed, aborted, still_open = count_records(bootstrap, topic)
                    assert (committed, still_open) == (args.rows, 0), (
                        f"{variant}: {committed} committed, {aborted} aborted, {still_open} "
                        f"open records; expected {args.rows} committed"
                    )
                    with contextlib.suppress(Exception):  # free the broker's memory
                        admin.delete_topics([topic])
                if r >= 0:
                    times[variant].append(secs)
                label = "warm-up" if r < 0 else f"run {r}"
                rate = args.rows / secs
                print(f"{label:<8} {variant:<13} {secs:6.2f} s {rate:>10,.0f} rows/s", flush=True)
        spark.stop()
        med = {v: statistics.median(t) for v, t in times.items()}
        batches = -(-args.files // args.files_per_batch)
        print()
        print(
            f"{args.rows:,} rows in {args.files} Parquet files, {batches} micro-batches, "
            f"{args.partitions} topic partitions, {cores} cores (load average "
            f"{os.getloadavg()[0]:.2f}), checkpoint_interval={args.interval}, median of "
            f"{args.repeat} after a warm-up round"
        )
        print(
            "| variant | seconds | rows/s | vs librdkafka | vs Spark's floor | "
            "vs Spark's Kafka writer |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: |")

        def ratio(base: str, v: str) -> str:
            return f"{med[base] / med[v]:.2f}" if base in med else "-"

        for v in variants:
            print(
                f"| {v} | {med[v]:.2f} | {args.rows / med[v]:,.0f} | {ratio('librdkafka', v)} | "
                f"{ratio('floor', v)} | {ratio('spark-kafka', v)} |"
            )
        if "twin" in med and "exactly-once" in med:
            print(f"\nexactly-once / twin: {med['twin'] / med['exactly-once']:.2f}")
        return 0
    finally:
        admin.close()
        if broker is not None:
            broker.cleanup()


if __name__ == "__main__":
    sys.exit(main())
