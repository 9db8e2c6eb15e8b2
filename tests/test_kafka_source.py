"""Read-process-write with Spark's own Kafka source, under driver SIGKILLs.

The job is ``examples/read_process_write.py`` (run by ``tests/jobs/kafka_source_job.py``):
two pipelines read Apache Kafka with ``spark.readStream.format("kafka")``:

* ``history``, bounded (available-now), over a topic that holds all its input
  before the job starts;
* ``live``, unbounded, over a topic a producer fills while the job runs (and
  while it is killed); the job drains once the producer is done;

and both write every order, priced, to a Kafka topic, a PostgreSQL table and a
Delta table. ``crash_test`` SIGKILLs the driver at random instants and at the
commit protocol's dangerous points, then runs the job to its end. Afterwards
each input record's output is in each sink exactly once, read the way users
read: the Kafka topic by a read_committed consumer (librdkafka's, and Spark's
Kafka source with ``kafka.isolation.level=read_committed``) and from the raw
log, PostgreSQL by SQL, Delta by delta-spark. A start after the final
checkpoint reads nothing again.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lifecycle.testing import crash_test, jars
from tests import deltacheck
from tests.kafkacheck import assert_nothing_open, consume_ids
from tests.procs import run_job
from tests.test_apache_kafka import _spark_read, _topic

JOB = str(Path(__file__).parent / "jobs" / "kafka_source_job.py")
HISTORY = range(0, 600)
LIVE = range(100_000, 100_600)

pytestmark = pytest.mark.crash


def _produce(bootstrap: str, topic: str, ids: range) -> None:
    """Orders ``ids`` into ``topic`` (plain, acknowledged by all replicas)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    try:
        for i in ids:
            order = {"id": i, "customer": f"c{i % 17}", "amount": i / 4}
            producer.send(topic, key=str(i).encode(), value=json.dumps(order).encode())
        producer.flush(30)
    finally:
        producer.close(5)


class _LiveFeed(threading.Thread):
    """Fills the live topic in small chunks while the job runs and is killed,
    then writes the file that tells the job to drain."""

    def __init__(self, bootstrap: str, topic: str, drain_file: Path) -> None:
        super().__init__(name="live-feed", daemon=True)
        self.bootstrap, self.topic, self.drain_file = bootstrap, topic, drain_file
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            time.sleep(5)  # the first run starts reading an empty live topic
            for start in range(LIVE.start, LIVE.stop, 100):
                _produce(self.bootstrap, self.topic, range(start, min(start + 100, LIVE.stop)))
                time.sleep(1.0)
            self.drain_file.write_text("drain")
        except BaseException as e:  # the test reports it
            self.error = e


def test_kafka_in_kafka_postgres_delta_out_is_exact_after_kills(  # type: ignore[no-untyped-def]
    spark, twophase_apache_kafka, pg_dsn, tmp_path: Path
):
    jars.require("spark-kafka")
    bootstrap = twophase_apache_kafka.bootstrap
    history, live, priced = (_topic(bootstrap, partitions=2) for _ in range(3))
    table = f"priced_{uuid.uuid4().hex[:8]}"
    job = f"rpw{uuid.uuid4().hex[:8]}"
    delta = tmp_path / "delta"
    _produce(bootstrap, history, HISTORY)
    drain_file = tmp_path / "drain"
    args = ["--bootstrap", bootstrap, "--dsn", pg_dsn, "--delta", str(delta)]
    args += ["--state", str(tmp_path / "state"), "--job", job, "--table", table]
    args += ["--topics", f"{history},{live},{priced}", "--per-batch", "150"]
    args += ["--drain-when", str(drain_file)]
    feed = _LiveFeed(bootstrap, live, drain_file)
    feed.start()
    report = crash_test(
        JOB,
        kills=3,
        seed=29,
        args=args,
        min_delay=10.0,
        max_delay=20.0,
        timeout=300.0,
        log=tmp_path / "crash.log",
    )
    feed.join(120)
    print(report)
    assert feed.error is None, feed.error
    assert report.kills >= 2, f"the job was killed too rarely:\n{report}"

    want = {i: "history" for i in HISTORY} | {i: "live" for i in LIVE}
    _assert_each_once(bootstrap, priced, job, pg_dsn, table, delta, spark, want)

    # a start after the shared final checkpoint reads nothing again
    again = run_job("kafka_source_job.py", args, tmp_path / "again.log", timeout=180)
    assert again.proc.returncode == 0, again.tail()
    assert again.result()["checkpoints"] == 0 and not any(again.result()["rows"].values())
    _assert_each_once(bootstrap, priced, job, pg_dsn, table, delta, spark, want)


def _assert_each_once(
    bootstrap: str,
    topic: str,
    job: str,
    dsn: str,
    table: str,
    delta: Path,
    spark: Any,
    want: dict[int, str],
) -> None:
    """Each order of ``want`` (id -> pipeline) once in each sink, priced."""

    def once(name: str, ids: list[int]) -> None:
        twice = sorted(i for i, c in Counter(ids).items() if c > 1)
        missing = sorted(set(want) - set(ids))
        extra = sorted(set(ids) - set(want))
        assert not (twice or missing or extra), (
            f"{name}: {len(ids)} rows; twice {twice[:5]}, missing {missing[:5]}, extra {extra[:5]}"
        )

    assert_nothing_open(bootstrap, topic, job)
    once("kafka (librdkafka, read_committed)", consume_ids(bootstrap, topic, "read_committed"))
    once("kafka (Spark, read_committed)", _spark_read(spark, bootstrap, topic, "read_committed"))
    with psycopg.connect(dsn) as c:
        rows = c.execute(f"SELECT id, cents, source FROM {table}").fetchall()
    once("postgres", [r[0] for r in rows])
    assert all(cents == round(i / 4 * 100) and src == want[i] for i, cents, src in rows)
    delta_rows = deltacheck.delta_spark_rows(spark, delta)  # (id, customer, amount, cents, source)
    once("delta (delta-spark)", [r[0] for r in delta_rows])
    assert all(r[4] == want[r[0]] for r in delta_rows)
    deltacheck.assert_nothing_staged(delta)
