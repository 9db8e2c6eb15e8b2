"""Throughput of the exactly-once Kafka sink against a plain kafka-python producer.

Both variants run the same Spark job in the same SparkSession on the same
input (Parquet files read as a bounded stream, available-now trigger) and
encode records the same way (key: the ``id`` column as text; value: the row as
JSON, both from :mod:`sinks.kafka.encode`, column-wise from Arrow):

* baseline: ``foreachBatch`` + ``mapInArrow``, each task sending its partition
  through a plain, non-transactional ``KafkaProducer`` (same batching settings
  as the sink's producers, ``acks='all'``) and flushing it: at-least-once, no
  transaction, no ledger;
* exactly-once: a :class:`lifecycle.Job` with a :class:`sinks.KafkaSink` (one
  transaction per task, flushed on the executors, ledger, EndTxn by the driver).

Every run writes to a fresh topic and is checked afterwards from the raw log
(control markers applied): all rows committed, none open. Runs alternate
(baseline, exactly-once, baseline, ...) after one warm-up pair; the median of
each is reported with the ratio exactly-once / baseline throughput.

    python benchmarks/kafka_throughput.py [--rows N] [--files F] [--repeat R]
                                          [--partitions P] [--bootstrap HOST:PORT]

Without ``--bootstrap`` a private tansu broker (memory storage) is started on
loopback, as the tests do.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
from kafka import KafkaAdminClient, KafkaProducer  # noqa: E402
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
from sinks.kafka import encode  # noqa: E402
from sinks.kafka.sink import _PRODUCER_DEFAULTS  # noqa: E402
from sinks.kafka.wire import KafkaWire  # noqa: E402


def _plain_task(bootstrap: str, topic: str):  # type: ignore[no-untyped-def]
    """The baseline's executor side: a plain producer, same encoding as the sink."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", **_PRODUCER_DEFAULTS)
        errors: list[BaseException] = []
        n = 0
        try:
            for b in batches:
                if b.num_rows == 0:
                    continue
                keys = encode.to_bytes(b.column("id"))
                values = encode.json_rows(b)
                for key, value in zip(keys, values, strict=True):
                    producer.send(topic, value=value, key=key).add_errback(errors.append)
                n += b.num_rows
            producer.flush(timeout=120)
            if errors:
                raise RuntimeError(f"{len(errors)} record(s) not written: {errors[0]!r}")
        finally:
            producer.close(timeout=5)
        yield pa.RecordBatch.from_pydict({"n": [n]})

    return task


def run_baseline(src: DataFrame, bootstrap: str, topic: str, ckpt: Path) -> float:
    task = _plain_task(bootstrap, topic)

    def each(df: DataFrame, _batch: int) -> None:
        df.mapInArrow(task, "n long").collect()

    return time_foreach_batch(src, each, ckpt)


def count_records(bootstrap: str, topic: str) -> tuple[int, int, int]:
    """(committed, aborted, open) data records of ``topic``, resolved from the
    control markers in the raw log like ``tests/kafkalog.py``, but counting
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


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--files-per-batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--partitions", type=int, default=3, help="partitions of each topic")
    ap.add_argument("--interval", type=float, default=0.0, help="checkpoint_interval")
    ap.add_argument("--bootstrap", help="Kafka bootstrap servers (default: start tansu)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("sinks.kafka").setLevel(logging.ERROR)  # tansu's missing config
    work = Path(tempfile.mkdtemp(prefix="twophase-kbench-"))
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        from tests.kafkabroker import KafkaBroker

        broker = KafkaBroker()
        broker.start()
        bootstrap = broker.bootstrap
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        make_input(work / "in", args.rows, args.files)
        spark = bench_spark("twophase-kafka-bench")

        def source() -> DataFrame:
            return parquet_stream(spark, work / "in", args.files_per_batch)

        times: dict[str, list[float]] = {"baseline": [], "exactly-once": []}
        for r in range(-1, args.repeat):  # run -1 warms up the JVM and workers, not counted
            for variant in times:
                topic = f"bench-{variant}-{r + 1}-{uuid.uuid4().hex[:6]}"
                admin.create_topics([NewTopic(topic, args.partitions, 1)])
                where = work / f"{variant}-{r + 1}"
                if variant == "baseline":
                    secs = run_baseline(source(), bootstrap, topic, where)
                else:
                    sink = KafkaSink(bootstrap, topic, key="id")
                    secs = time_job(spark, source(), sink, where, args.interval)
                committed, aborted, still_open = count_records(bootstrap, topic)
                assert (committed, still_open) == (args.rows, 0), (
                    f"{variant}: {committed} committed, {aborted} aborted, {still_open} open "
                    f"records; expected {args.rows} committed"
                )
                with contextlib.suppress(Exception):  # free the broker's memory
                    admin.delete_topics([topic])
                if r >= 0:
                    times[variant].append(secs)
                label = "warm-up" if r < 0 else f"run {r}"
                rate = args.rows / secs
                print(f"{label:<8} {variant:<13} {secs:6.2f} s {rate:>10,.0f} rows/s", flush=True)
        spark.stop()
        base = statistics.median(times["baseline"])
        eo = statistics.median(times["exactly-once"])
        batches = -(-args.files // args.files_per_batch)
        print()
        print(
            f"{args.rows:,} rows, {batches} micro-batches, {args.partitions} topic partitions, "
            f"checkpoint_interval={args.interval}, median of {args.repeat} "
            "(after a warm-up run)"
        )
        print("| variant | seconds | rows/s | throughput vs baseline |")
        print("| --- | ---: | ---: | ---: |")
        print(
            f"| plain KafkaProducer (at-least-once) | {base:.2f} | {args.rows / base:,.0f} | 1.00 |"
        )
        print(f"| KafkaSink (exactly-once) | {eo:.2f} | {args.rows / eo:,.0f} | {base / eo:.2f} |")
        return 0
    finally:
        admin.close()
        if broker is not None:
            broker.cleanup()


if __name__ == "__main__":
    sys.exit(main())
