"""Spark's Kafka source as the driver sees it, for the consumer-group offsets a
job commits for lag tools: which sources of a query read Kafka and with
what options, what a batch's end offsets are, and how to reach the cluster with
kafka-python.

Which sources: a streaming query numbers its sources in the order its analyzed
plan holds them (the plan's leaves, left to right, each relation once), and
Spark's offset log (``offsets/<batch>`` in the query's checkpoint) holds one
line per source in that order, after a version line and a metadata line. A
Kafka source's line is its END offsets for the batch, the next offset to read of
each partition: ``{"topic":{"0":123,"1":45}}``, exactly what a consumer group
holds as its committed offset.

How to reach the cluster: from the source's own options (``kafka.``-prefixed,
Java client settings), translated to kafka-python's: the bootstrap servers,
``security.protocol``, ``sasl.mechanism`` with the user name and password of a
PLAIN or SCRAM ``sasl.jaas.config``, a PEM trust store as ``ssl_cafile``, a PEM
key store as ``ssl_certfile`` (its ``ssl.key.password`` as ``ssl_password``),
``ssl.endpoint.identification.algorithm`` empty as no host name check, and
``request.timeout.ms``. What has no kafka-python equivalent (JKS or PKCS12
stores, Kerberos, OAuth) is left out; the job's ``source_offsets_config`` gives
kafka-python settings that override or complete these.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame

FORMAT = "kafka"
_RELATIONS = ("StreamingRelationV2", "StreamingRelation")
_JAAS_VALUE = re.compile(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"')


class SourceOffsetsError(RuntimeError):
    """A batch's Kafka source offsets could not be read as Spark wrote them."""


@dataclass(frozen=True)
class KafkaSource:
    """A Kafka source of a streaming query: ``index``, its line in the offset
    log; ``options``, its options (keys in lower case)."""

    index: int
    options: Mapping[str, str]

    def client_config(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """kafka-python settings that reach this source's cluster (module
        docstring), with ``overrides`` over them."""
        return {**client_config(self.options), **(overrides or {})}


def kafka_sources(df: DataFrame) -> list[KafkaSource]:
    """The Kafka sources of the streaming query that runs ``df``, with their
    line in its offset log (module docstring)."""
    leaves = df._jdf.queryExecution().analyzed().collectLeaves().iterator()
    relations: list[Any] = []
    while leaves.hasNext():
        leaf = leaves.next()
        if leaf.nodeName() in _RELATIONS and not any(leaf.equals(r) for r in relations):
            relations.append(leaf)
    found = []
    for index, relation in enumerate(relations):
        if str(relation.sourceName()).lower() == FORMAT:
            found.append(KafkaSource(index, _options(relation)))
    return found


def _options(relation: Any) -> dict[str, str]:
    """The options of a streaming relation of the plan, keys in lower case."""
    if relation.nodeName() == "StreamingRelationV2":
        options = relation.extraOptions().asCaseSensitiveMap()
    else:  # a V1 relation (Spark's V2 micro-batch reader disabled): a Scala map
        options = _scala_map(relation.dataSource().options())
    return {str(k).lower(): str(options[k]) for k in options}


def _scala_map(scala_map: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    it = scala_map.iterator()
    while it.hasNext():
        pair = it.next()
        out[str(pair._1())] = str(pair._2())
    return out


def end_offsets(
    lines: Sequence[str], sources: Iterable[KafkaSource]
) -> list[tuple[KafkaSource, dict[tuple[str, int], int]]]:
    """Per Kafka source, its end offsets in a batch's offset log ``lines`` (one
    per source, as :meth:`lifecycle.spark_log.SparkCommitLog.planned_offsets`
    gives them): ``{(topic, partition): offset}``. Raises
    :class:`SourceOffsetsError` when a source's line is missing or is not a
    Kafka source's offset."""
    out = []
    for source in sources:
        if source.index >= len(lines):
            raise SourceOffsetsError(
                f"the offset log has {len(lines)} source line(s), not the Kafka source's "
                f"line {source.index}: the query's sources changed since the batch ran"
            )
        out.append((source, parse_offsets(lines[source.index])))
    return out


def parse_offsets(line: str) -> dict[tuple[str, int], int]:
    """A Kafka source's offset as Spark writes it, ``{"topic":{"0":123}}``, as
    ``{(topic, partition): offset}``."""
    try:
        raw = json.loads(line)
        offsets = {
            (str(topic), int(partition)): int(offset)
            for topic, partitions in raw.items()
            for partition, offset in partitions.items()
        }
    except (ValueError, TypeError, AttributeError) as e:
        raise SourceOffsetsError(f"not a Kafka source's offset: {line[:200]!r}") from e
    bad = {tp: o for tp, o in offsets.items() if o < 0}
    if bad:  # -1/-2 (latest/earliest) are never in the log, only in startingOffsets
        raise SourceOffsetsError(f"not resolved offsets: {bad}")
    return offsets


def client_config(options: Mapping[str, str]) -> dict[str, Any]:
    """kafka-python settings from a Kafka source's options (module docstring)."""
    java = {k.removeprefix("kafka."): v for k, v in options.items() if k.startswith("kafka.")}
    servers = java.get("bootstrap.servers", "")
    config: dict[str, Any] = {"bootstrap_servers": [s.strip() for s in servers.split(",") if s]}
    if "security.protocol" in java:
        config["security_protocol"] = java["security.protocol"].upper()
    mechanism = java.get("sasl.mechanism")
    if mechanism:
        config["sasl_mechanism"] = mechanism.upper()
    jaas = dict(_JAAS_VALUE.findall(java.get("sasl.jaas.config", "")))
    if "username" in jaas:
        config["sasl_plain_username"] = _unescape(jaas["username"])
    if "password" in jaas:
        config["sasl_plain_password"] = _unescape(jaas["password"])
    if java.get("ssl.truststore.type", "").upper() == "PEM" and "ssl.truststore.location" in java:
        config["ssl_cafile"] = java["ssl.truststore.location"]
    if java.get("ssl.keystore.type", "").upper() == "PEM" and "ssl.keystore.location" in java:
        config["ssl_certfile"] = java["ssl.keystore.location"]
        if "ssl.key.password" in java:
            config["ssl_password"] = java["ssl.key.password"]
    if java.get("ssl.endpoint.identification.algorithm", "https").strip() == "":
        config["ssl_check_hostname"] = False
    if "request.timeout.ms" in java:
        config["request_timeout_ms"] = int(java["request.timeout.ms"])
    return config


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)
