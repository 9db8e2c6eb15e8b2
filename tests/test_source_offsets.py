"""Consumer-group offsets of Kafka sources (:mod:`lifecycle.source_offsets`,
:mod:`lifecycle.kafka_source`), in process: which sources of a query read
Kafka and their line in Spark's offset log, the end offsets read from it, the
kafka-python settings derived from the source's options, the commits on a real
Apache Kafka broker (read back with the Admin API and with
``kafka-consumer-groups.sh --describe``), and a cluster that cannot
be reached, which is counted and logged once and never stalls.

The job-level checks (lag 0 once a job has caught up, never beyond a completed
checkpoint across kills, recovery never reading the group) are in
``tests/test_kafka_source.py``.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from lifecycle.kafka_source import (
    KafkaSource,
    SourceOffsetsError,
    client_config,
    end_offsets,
    kafka_sources,
    parse_offsets,
)
from lifecycle.ledger import Checkpoint
from lifecycle.pipeline_checks import check_pipeline
from lifecycle.source_offsets import SourceOffsets, group_name
from lifecycle.state.store import LocalStore
from lifecycle.testing import jars
from lifecycle.testing.kafka_security import SecureListener
from lifecycle.testing.services import java
from sinks.errors import ConfigError


def test_end_offsets_are_the_kafka_sources_lines_of_the_offset_log() -> None:
    lines = ['{"orders":{"0":120,"1":45}}', '{"marker":0}', '{"t2":{"0":7}}']
    a, b = KafkaSource(0, {}), KafkaSource(2, {})
    got = end_offsets(lines, [a, b])
    assert got == [(a, {("orders", 0): 120, ("orders", 1): 45}), (b, {("t2", 0): 7})]
    with pytest.raises(SourceOffsetsError, match="source line"):
        end_offsets(lines[:1], [b])
    for wrong in ('{"marker":0}', "-", '{"t":{"0":-1}}', "[1]"):
        with pytest.raises(SourceOffsetsError):
            parse_offsets(wrong)


def test_the_group_is_named_by_the_job_and_pipeline_or_given() -> None:
    assert group_name("j", "live", True) == "twophase.j.live"
    assert group_name("j", "live", "orders-lag") == "orders-lag"
    assert group_name("j", "live", False) is None


def test_the_option_is_checked_when_the_pipeline_is_added(spark: Any) -> None:
    df = spark.readStream.format("rate").load()

    def check(group: Any, config: Any = None) -> None:
        check_pipeline(
            "p",
            df,
            [SimpleNamespace(sink_id="s", commits_at_finish=False)],  # type: ignore[list-item]
            bounded=False,
            trigger_interval=1.0,
            transform=None,
            event_time=None,
            source_offsets=(group, config),
        )

    check(True)
    check("g", {"ssl_cafile": "/ca.pem"})
    for group, config in (("", None), (3, None), (True, {"no_such": 1}), (True, {"group_id": "x"})):
        with pytest.raises(ConfigError, match="source_offsets"):
            check(group, config)


def test_the_sources_settings_become_kafka_python_settings(tmp_path: Path) -> None:
    """What Spark's Kafka source is given for a SASL_SSL (SCRAM) cluster is what
    kafka-python needs to reach it."""
    listener = SecureListener(users={"reader": "pw-1 2"}, _dir=tmp_path)
    options = {"kafka.bootstrap.servers": "h1:9093, h2:9093", "subscribe": "t"}
    options |= listener.spark("reader")
    config = client_config({k.lower(): v for k, v in options.items()})
    assert config == {"bootstrap_servers": ["h1:9093", "h2:9093"], **listener.client("reader")}
    plain = client_config(
        {
            "kafka.bootstrap.servers": "h:9092",
            "kafka.ssl.endpoint.identification.algorithm": "",
            "kafka.request.timeout.ms": "5000",
        }
    )
    assert plain == {
        "bootstrap_servers": ["h:9092"],
        "ssl_check_hostname": False,
        "request_timeout_ms": 5000,
    }
    escaped = 'PlainLoginModule required username="u" password="a\\"b";'
    assert client_config({"kafka.sasl.jaas.config": escaped})["sasl_plain_password"] == 'a"b'
    source = KafkaSource(0, {"kafka.bootstrap.servers": "h:9092"})
    assert source.client_config({"ssl_cafile": "/ca"})["ssl_cafile"] == "/ca"


def test_kafka_sources_are_found_in_the_query_plan_in_the_offset_logs_order(spark: Any) -> None:
    """Spark numbers a query's sources in its plan's order, each relation once:
    the Kafka ones are found at their index, a rate source between them counts."""
    jars.require("spark-kafka")

    def kafka(port: int, **options: str) -> Any:
        reader = spark.readStream.format("kafka")
        reader = reader.option("kafka.bootstrap.servers", f"127.0.0.1:{port}")
        for k, v in options.items():
            reader = reader.option(k, v)
        return reader.load().select("value")

    a = kafka(1, subscribe="t1")
    rate = spark.readStream.format("rate").load()
    between = rate.selectExpr("cast(cast(value as string) as binary) as value")
    df = a.unionByName(between).unionByName(kafka(2, assign='{"t2":[0]}')).unionByName(a)
    found = kafka_sources(df)
    assert [s.index for s in found] == [0, 2]
    assert found[0].options["kafka.bootstrap.servers"] == "127.0.0.1:1"
    assert found[1].options["assign"] == '{"t2":[0]}'
    assert kafka_sources(rate) == []


class _Ledger:
    """What the committing thread asks of the ledger."""

    def __init__(self, cut: dict[str, int]) -> None:
        self.cut = cut

    def committed_cut(self, pipeline: str) -> int:
        return self.cut.get(pipeline, -1)

    def committed_digest(self, pipeline: str, batch_id: int) -> str | None:
        return None


def _pipeline(spark: Any, tmp_path: Path, bootstrap: str, topic: str, **opts: Any) -> Any:
    """A pipeline as :meth:`SourceOffsets.begin` reads it, over ``topic``."""
    df = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .load()
    )
    return SimpleNamespace(
        name="p",
        source_offsets_group=opts.get("group", True),
        source_offsets_config=opts.get("config"),
        store=LocalStore(tmp_path),
        spark_location="pipelines/p/spark",
        query_dataframe=lambda: df,
    )


def _offsets_file(tmp_path: Path, batch: int, offsets: dict[str, dict[str, int]]) -> None:
    """Spark's ``offsets/<batch>`` for a query whose one source is Kafka."""
    path = tmp_path / "pipelines" / "p" / "spark" / "offsets" / str(batch)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'v1\n{{"batchWatermarkMs":0}}\n{json.dumps(offsets)}')


def _group_offsets(bootstrap: str, group: str, admin: Any = None) -> dict[tuple[str, int], int]:
    """What ``group`` holds, read with the Admin API (kafka-python 3 names
    ``list_consumer_group_offsets`` ``list_group_offsets``); ``admin``: a
    client to use, else one of its own."""
    from kafka import KafkaAdminClient

    client = admin or KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        got = client.list_group_offsets(group).get(group, {})
    finally:
        if admin is None:
            client.close()
    return {(tp.topic, tp.partition): om.offset for tp, om in got.items() if om.offset >= 0}


def _set_group(bootstrap: str, group: str, offsets: dict[tuple[str, int], int]) -> None:
    """Commit ``offsets`` to ``group``, as an operator or another tool might."""
    from kafka import KafkaConsumer, OffsetAndMetadata, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        consumer.commit(
            {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}
        )
    finally:
        consumer.close(autocommit=False)


def _end_offsets(bootstrap: str, topic: str) -> dict[tuple[str, int], int]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        return {(tp.topic, tp.partition): o for tp, o in consumer.end_offsets(tps).items()}
    finally:
        consumer.close(autocommit=False)


def _produce(bootstrap: str, topic: str, counts: dict[int, int]) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        for partition, n in counts.items():
            for i in range(n):
                producer.send(topic, value=str(i).encode(), partition=partition)
        producer.flush(30)
    finally:
        producer.close()


def _lag_described(bootstrap: str, group: str) -> dict[tuple[str, int], tuple[int, int, int]]:
    """(current offset, log-end offset, lag) per partition, as ``kafka-consumer-groups.sh
    --describe`` prints them (Apache Kafka's ``ConsumerGroupCommand``, run by Java)."""
    classpath = ":".join(str(p) for p in jars.require("kafka-tools"))
    out = subprocess.run(
        [
            java("kafka-consumer-groups"),
            "-cp",
            classpath,
            "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
            "--bootstrap-server",
            bootstrap,
            "--describe",
            "--group",
            group,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith(group + " ")]
    return {(r[1], int(r[2])): (int(r[3]), int(r[4]), int(r[5])) for r in rows}


def _sample(offsets: SourceOffsets, registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name, {"job": offsets.job, "pipeline": "p"})


def test_each_completed_checkpoint_commits_its_end_offsets_to_the_group(
    spark: Any, twophase_apache_kafka: Any, tmp_path: Path
) -> None:
    """On Apache Kafka: the start commits the last completed checkpoint's
    offsets, each completed checkpoint its own, read back with the Admin API."""
    jars.require("spark-kafka")
    from tests.test_apache_kafka import _topic

    bootstrap = twophase_apache_kafka.bootstrap
    topic = _topic(bootstrap, partitions=2)
    _produce(bootstrap, topic, {0: 12, 1: 6})
    job = f"so{uuid.uuid4().hex[:8]}"
    registry = CollectorRegistry()
    offsets = SourceOffsets(job, registry)
    _offsets_file(tmp_path, 3, {topic: {"0": 5, "1": 2}})
    _offsets_file(tmp_path, 4, {topic: {"0": 9, "1": 4}})
    offsets.begin([_pipeline(spark, tmp_path, bootstrap, topic)], _Ledger({"p": 3}))  # type: ignore[list-item]
    try:
        group = f"twophase.{job}.p"
        _wait_for(lambda: _group_offsets(bootstrap, group) == {(topic, 0): 5, (topic, 1): 2})
        offsets.checkpoint_completed(Checkpoint(id=7, kind="periodic", cut={"p": 4, "other": 9}))
    finally:
        offsets.end()
    assert _group_offsets(bootstrap, group) == {(topic, 0): 9, (topic, 1): 4}
    # and the lag Apache Kafka's own tool shows (the topic holds 12 and 6 records)
    assert _lag_described(bootstrap, group) == {(topic, 0): (9, 12, 3), (topic, 1): (4, 6, 2)}
    assert _sample(offsets, registry, "twophase_source_offsets_commit_failures_total") == 0
    assert (
        time.time() - (_sample(offsets, registry, "twophase_source_offsets_timestamp_seconds") or 0)
        < 60
    )


def test_a_cluster_out_of_reach_is_counted_and_warned_once_and_stalls_nothing(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    jars.require("spark-kafka")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    registry = CollectorRegistry()
    offsets = SourceOffsets("j", registry)
    _offsets_file(tmp_path, 3, {"t": {"0": 5}})
    _offsets_file(tmp_path, 4, {"t": {"0": 8}})
    pipeline = _pipeline(spark, tmp_path, closed, "t", config={"api_version_auto_timeout_ms": 500})
    failures = "twophase_source_offsets_commit_failures_total"
    with caplog.at_level(logging.WARNING, logger="lifecycle.source_offsets"):
        offsets.begin([pipeline], _Ledger({"p": 3}))
        _wait_for(lambda: (_sample(offsets, registry, failures) or 0) >= 1)
        started = time.monotonic()
        offsets.checkpoint_completed(Checkpoint(id=1, kind="periodic", cut={"p": 4}))
        handed_over = time.monotonic() - started
        _wait_for(lambda: (_sample(offsets, registry, failures) or 0) >= 2)
        offsets.end()
    assert handed_over < 0.1, "a checkpoint waited for the group's commit"
    warned = [r for r in caplog.records if "could not commit" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert _sample(offsets, registry, "twophase_source_offsets_timestamp_seconds") is None


def _wait_for(condition: Any, timeout: float = 60.0) -> None:
    """Until ``condition()`` is true (an error counts as not yet: a new
    broker's group coordinator may not be there at once)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
