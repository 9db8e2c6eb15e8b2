"""The Kafka sink against Apache Kafka, the broker users run (KRaft, from the
jars ``lifecycle/testing/jars.py`` fetches; ``lifecycle/testing/apache_kafka.py``).

Exactly-once is checked twice, from the raw log's control markers and the way
users read: a read_committed consumer (librdkafka's) and Spark's own Kafka
source with ``kafka.isolation.level=read_committed``, which only Apache Kafka
makes meaningful (it sends the aborted-transactions list that tansu does not).
"""

from __future__ import annotations

import json
import re
import signal
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lifecycle.testing.plugin import wait_for_topic
from tests import tiers
from tests.conftest import write_input
from tests.kafkacheck import (
    assert_exactly_once,
    assert_nothing_open,
    consume_ids,
    consume_records,
)
from tests.procs import run_job


def _topic(bootstrap: str, partitions: int = 3, config: dict[str, str] | None = None) -> str:
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    name = f"t-{uuid.uuid4().hex[:12]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        topic = NewTopic(name, partitions, 1, topic_configs=config or {})
        admin.create_topics([topic])
    finally:
        admin.close()
    wait_for_topic(bootstrap, name, partitions)
    return name


def _spark_read(spark: Any, bootstrap: str, topic: str, isolation: str) -> list[int]:
    from pyspark.sql import functions as F

    from lifecycle.testing import jars

    jars.require("spark-kafka")
    df = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("kafka.isolation.level", isolation)
        .load()
    )
    rows = df.select(F.get_json_object(F.col("value").cast("string"), "$.id").alias("id"))
    return [int(r["id"]) for r in rows.collect()]


def _transaction_version(broker: Any) -> int:
    """The ``transaction.version`` level the broker's log directory was formatted with."""
    found = re.search(r"name='transaction\.version', featureLevel=(\d+)", broker.format_output)
    assert found, broker.format_output[-2000:]
    return int(found.group(1))


@pytest.mark.crash
@tiers.SLOW
def test_a_killed_job_into_apache_kafka_reads_once_read_committed(  # type: ignore[no-untyped-def]
    spark, twophase_apache_kafka, tmp_path: Path
):
    """Every first task attempt fails after its transaction is flushed, and the
    driver is SIGKILLed after the ledger recorded batch 2: the log holds aborted
    transactions. A restart finishes; read_committed readers (librdkafka, Spark's
    Kafka source) see every row once, while read_uncommitted shows the aborted
    copies too (so the check can fail). The broker has transactions version 2,
    Kafka 4.x's default, which the sink's classic request versions keep out of.
    (Slow tier: the default run does the same kill on a secured broker,
    ``tests/test_kafka_secured.py``, and reads with Spark's read_committed
    reader in ``tests/test_kafka_source.py``.)"""
    assert _transaction_version(twophase_apache_kafka) == 2
    _killed_job_reads_once(spark, twophase_apache_kafka, tmp_path)


@pytest.mark.crash
@tiers.SLOW
def test_a_broker_with_transactions_version_1_commits_the_same_way(  # type: ignore[no-untyped-def]
    spark, tmp_path: Path
):
    """The same run against a broker formatted with ``transaction.version=1`` (a
    cluster upgraded from Kafka 3.x keeps it until an operator raises it)."""
    from lifecycle.testing import jars
    from lifecycle.testing.apache_kafka import ApacheKafka

    jars.require("kafka-broker")
    with ApacheKafka(features={"transaction.version": 1}) as broker:
        assert _transaction_version(broker) == 1
        _killed_job_reads_once(spark, broker, tmp_path)


def _killed_job_reads_once(spark: Any, broker: Any, tmp_path: Path) -> None:
    bootstrap = broker.bootstrap
    topic = _topic(bootstrap)
    job = f"ak{uuid.uuid4().hex[:8]}"
    n = write_input(tmp_path / "in", files=4, rows_per_file=150)
    args = ["--bootstrap", bootstrap, "--topic", topic, "--state", str(tmp_path / "state")]
    args += ["--input", str(tmp_path / "in"), "--job", job]
    log = tmp_path / "job.log"
    first = run_job(
        "kafka_job.py", args, log, "executor.prepared#0=raise;driver.after_record@2=kill"
    )
    assert first.proc.returncode == -signal.SIGKILL, first.tail(3000)
    second = run_job("kafka_job.py", args, log, None)
    assert second.proc.returncode == 0, second.tail(5000)

    raw = assert_exactly_once(bootstrap, topic, n)
    assert raw.n_aborted > 0  # the failed attempts' and the interrupted batch's records
    assert_nothing_open(bootstrap, topic, job)
    everything = set(range(n))
    for name, ids in (
        ("librdkafka", consume_ids(bootstrap, topic, "read_committed")),
        ("spark", _spark_read(spark, bootstrap, topic, "read_committed")),
    ):
        twice = [i for i, c in Counter(ids).items() if c > 1]
        assert not twice and set(ids) == everything, f"{name}: {len(ids)} rows, twice: {twice[:5]}"
    uncommitted = _spark_read(spark, bootstrap, topic, "read_uncommitted")
    assert len(uncommitted) > n and set(uncommitted) == everything


def test_batches_fit_a_topic_whose_max_message_bytes_is_below_the_sinks_batch(
    twophase_apache_kafka: Any,
) -> None:
    """A topic taking record batches of at most 20,000 bytes, below the sink's
    1 MiB batches: the writers size their batches to it (read at preflight), and
    a record larger than it fails the task naming its key, size and both limits,
    before anything of it commits."""
    import pyarrow as pa

    from sinks import KafkaSink, RecordTooLargeError
    from tests.kafkacheck import read_settled
    from tests.test_kafka_unit import SCHEMA, committed_ids, ctx, job_name, rows, write_task

    bootstrap = twophase_apache_kafka.bootstrap
    topic = _topic(bootstrap, partitions=1, config={"max.message.bytes": "20000"})
    sink = KafkaSink(bootstrap, topic, key="id", sink_id="k")
    try:
        sink.preflight(SCHEMA)
        assert sink.topic_max_bytes == 20000
        c = write_task(sink, ctx(job_name(), 0), [rows(0, 3000)])  # about 150 kB
        assert c is not None
        sink.committer().commit([c])
        big = pa.record_batch([[10_000], ["x" * 30_000], [0.5]], schema=SCHEMA)
        w = sink.open_writer(ctx(job_name(), 0), SCHEMA)
        try:
            w.write(rows(20_000, 10))
            with pytest.raises(RecordTooLargeError) as e:
                w.write(big)
        finally:
            w.close(failed=True)
        msg = str(e.value)
        assert "key 10000" in msg and "max.message.bytes=20000" in msg, msg
        assert "max_request_size is 1048576" in msg, msg
    finally:
        sink.close()
    log = read_settled(bootstrap, topic)
    assert committed_ids(log) == list(range(3000)) and log.n_open == 0


def test_an_event_with_a_null_value_is_refused_on_a_compacted_topic_only(
    twophase_apache_kafka: Any,
) -> None:
    """Events (a key, no ``order_by`` or ``delete_when``) whose ``value`` column
    is null in a row: on a compacted topic the record would be a tombstone that
    deletes its key, so the task fails with ``NullValueError`` naming the key and
    the topic's policy (read at preflight), before anything of it commits; on a
    topic that is not compacted the row is a record with its key and a null
    value, as before."""
    import pyarrow as pa

    from sinks import KafkaSink
    from sinks.keys import NullValueError
    from tests.kafkacheck import read_settled
    from tests.test_kafka_unit import SCHEMA, ctx, job_name, rows, write_task

    bootstrap = twophase_apache_kafka.bootstrap
    null = pa.record_batch([[7], pa.array([None], pa.string()), [0.5]], schema=SCHEMA)
    for policy in ("compact", "compact,delete"):
        topic = _topic(bootstrap, partitions=1, config={"cleanup.policy": policy})
        sink = KafkaSink(bootstrap, topic, key="id", value="name", sink_id="k")
        try:
            sink.preflight(SCHEMA)
            assert sink.topic_cleanup_policy == policy
            w = sink.open_writer(ctx(job_name(), 0), SCHEMA)
            try:
                w.write(rows(0, 3))
                with pytest.raises(NullValueError) as e:
                    w.write(null)
            finally:
                w.close(failed=True)
        finally:
            sink.close()
        msg = str(e.value)
        assert "key {'id': 7}" in msg and f"cleanup.policy={policy}" in msg, msg
        assert f"topic {topic!r} is compacted" in msg and "tombstone" in msg, msg
        log = read_settled(bootstrap, topic)
        assert log.committed == [] and log.n_open == 0

    topic = _topic(bootstrap, partitions=1, config={"cleanup.policy": "delete"})
    sink = KafkaSink(bootstrap, topic, key="id", value="name", sink_id="k")
    try:
        sink.preflight(SCHEMA)
        assert sink.topic_cleanup_policy == "delete"
        c = write_task(sink, ctx(job_name(), 0), [rows(0, 3), null])
        assert c is not None
        sink.committer().commit([c])
    finally:
        sink.close()
    log = read_settled(bootstrap, topic)
    assert [(r.key, r.value) for r in log.committed] == [
        (b"0", b"name-0"),
        (b"1", b"name-1"),
        (b"2", b"name-2"),
        (b"7", None),
    ]


def test_a_compacted_changelog_reads_as_the_model_after_the_log_cleaner_ran(  # type: ignore[no-untyped-def]
    spark, twophase_apache_kafka, tmp_path: Path
):
    """A keyed KafkaSink writes a feed of inserts, updates and deletes into a
    topic with ``cleanup.policy=compact``. Once Apache Kafka's log cleaner has
    compacted it and, after ``delete.retention.ms``, dropped the tombstones and
    transaction markers, a read_committed consumer reading the whole topic sees
    the model: the last value of each key, and no deleted key."""
    from confluent_kafka import Producer

    from lifecycle import Job
    from sinks import KafkaSink
    from sinks.kafka.log import read_topic
    from tests.changefeed import SCHEMA as FEED
    from tests.changefeed import write_feed

    bootstrap = twophase_apache_kafka.bootstrap
    compacted = {
        "cleanup.policy": "compact",
        "segment.ms": "500",
        "min.cleanable.dirty.ratio": "0.01",
        "delete.retention.ms": "500",
        "min.compaction.lag.ms": "0",
    }
    topic = _topic(bootstrap, partitions=2, config=compacted)
    model = write_feed(tmp_path / "in", files=4, rows_per_file=100, keys=25, seed=5)
    assert len(model) < 25  # some keys end deleted
    sink = KafkaSink(bootstrap, topic, key="id", order_by="seq", delete_when=("op", "D"))
    df = spark.readStream.schema(FEED).option("maxFilesPerTrigger", 1).json(str(tmp_path / "in"))
    job = Job(spark, f"kc{uuid.uuid4().hex[:8]}", tmp_path / "state", checkpoint_interval=0)
    job.add_pipeline("feed", df, [sink], bounded=True)
    job.run()
    written = read_topic(bootstrap, topic)
    assert any(r.value is None for r in written.committed)  # tombstones were written

    # the cleaner compacts closed segments only: keep rolling them with a record
    # of a key outside the feed until the tombstones are gone
    nudge = Producer({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + 120
    while True:
        for p in (0, 1):
            nudge.produce(topic, key=b"-1", value=b"{}", partition=p)
        nudge.flush(10)
        log = read_topic(bootstrap, topic)
        tombstones = [r for r in log.committed if r.value is None]
        if not tombstones and len(log.committed) < len(written.committed):
            break  # compacted, and the tombstones dropped: a deleted key's older value
            # would now come back to a reader, were it left
        assert time.monotonic() < deadline, f"not compacted: {len(tombstones)} tombstone(s)"
        time.sleep(1.0)

    table: dict[int, Any] = {}
    for key, value in consume_records(bootstrap, topic, "read_committed"):
        if key == -1:
            continue
        if value is None:
            table.pop(key, None)
        else:
            table[key] = json.loads(value)
    assert table == model
