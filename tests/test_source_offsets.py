"""Spark's Kafka source as the driver reads it (:mod:`lifecycle.kafka_source`),
in process: which sources of a query read Kafka and their line in Spark's
offset log, the end offsets read from it, and the kafka-python settings
derived from the source's options.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lifecycle.kafka_source import (
    KafkaSource,
    SourceOffsetsError,
    client_config,
    end_offsets,
    kafka_sources,
    parse_offsets,
)
from lifecycle.testing import jars
from lifecycle.testing.kafka_security import SecureListener


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
