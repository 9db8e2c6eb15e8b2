"""The Kafka sink against Apache Kafka, the broker users run (KRaft, from the
jars ``lifecycle/testing/jars.py`` fetches; ``lifecycle/testing/apache_kafka.py``).

Exactly-once is checked twice, from the raw log's control markers and the way
users read: a read_committed consumer (librdkafka's) and Spark's own Kafka
source with ``kafka.isolation.level=read_committed``, which only Apache Kafka
makes meaningful (it sends the aborted-transactions list that tansu does not).
"""

from __future__ import annotations

import re
import signal
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lifecycle.testing.plugin import wait_for_topic
from tests.conftest import write_input
from tests.kafkacheck import assert_exactly_once, assert_nothing_open, consume_ids
from tests.procs import run_job


def _topic(bootstrap: str, partitions: int = 3) -> str:
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    name = f"t-{uuid.uuid4().hex[:12]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
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
def test_a_killed_job_into_apache_kafka_reads_once_read_committed(  # type: ignore[no-untyped-def]
    spark, twophase_apache_kafka, tmp_path: Path
):
    """Every first task attempt fails after its transaction is flushed, and the
    driver is SIGKILLed after the ledger recorded batch 2: the log holds aborted
    transactions. A restart finishes; read_committed readers (librdkafka, Spark's
    Kafka source) see every row once, while read_uncommitted shows the aborted
    copies too (so the check can fail). The broker has transactions version 2,
    Kafka 4.x's default, which the sink's classic request versions keep out of."""
    assert _transaction_version(twophase_apache_kafka) == 2
    _killed_job_reads_once(spark, twophase_apache_kafka, tmp_path)


@pytest.mark.crash
def test_a_broker_with_transactions_version_1_commits_the_same_way(  # type: ignore[no-untyped-def]
    spark, tmp_path: Path
):
    """The same run against a broker formatted with ``transaction.version=1`` (a
    cluster upgraded from Kafka 3.x keeps it until an operator raises it)."""
    from lifecycle.testing import jars
    from lifecycle.testing.apache_kafka import ApacheKafka

    jars.require("kafka-broker")
    broker = ApacheKafka(features={"transaction.version": 1})
    broker.start()
    try:
        assert _transaction_version(broker) == 1
        _killed_job_reads_once(spark, broker, tmp_path)
    finally:
        broker.cleanup()


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
