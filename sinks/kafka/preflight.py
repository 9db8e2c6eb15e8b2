"""The Kafka sink's preflight: the DataFrame's columns, then the cluster.

Run on the driver before any data moves
(:meth:`~sinks.kafka.sink.KafkaSink.preflight`), in this order:

* :func:`check_schema`: the key, value and header columns can be written
  (:mod:`sinks.kafka.encode`), and so can the keyed-write columns
  (:mod:`sinks.keys`);
* :func:`check_cluster`: the cluster answers, the principal may do what the
  sink does (:mod:`sinks.kafka.access`), the topic and the registry topic exist
  or are created, and the brokers accept the transaction timeout and the
  sink's transactional ids (:mod:`sinks.kafka.checks`). What the writers need to
  know of the cluster comes back as :class:`ClusterFacts`. The topics' checks
  and the transactions' (which need no topic) run at once, the latter on a
  connection of its own; both end before any error is raised, and a failure
  of the topics' checks is raised first, as when they ran one after the other.
  The ACL check is asked again only when a topic was just created.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from kafka.protocol.admin import DescribeTransactionsRequest

from sinks._parallel import raise_first, run_all
from sinks.errors import PreflightError
from sinks.kafka import access, checks, encode
from sinks.kafka.registry import TOPIC_CONFIG
from sinks.kafka.wire import KafkaWire
from sinks.keys import KeyedWrite


@dataclass(frozen=True)
class ClusterFacts:
    """What preflight learnt of the cluster for the writers."""

    topic_max_bytes: int | None
    """the topic's ``max.message.bytes``, None when the broker does not say"""
    topic_cleanup_policy: str | None
    """the topic's ``cleanup.policy`` (``delete``, ``compact`` or both), None
    when the broker does not say"""
    pooled_ids: bool
    """the broker describes transactions (DescribeTransactions): pool the ids"""


def check_schema(
    schema: pa.Schema,
    rules: KeyedWrite,
    *,
    changelog: bool,
    key: str | None,
    value: str | None,
    headers: Sequence[str],
) -> None:
    """Raise :class:`PreflightError` unless the sink can write rows of ``schema``:
    the keyed-write columns of a ``changelog``, the ``key``, ``value`` and
    ``headers`` columns, and without a ``value`` column every written column as
    JSON."""
    if changelog:
        rules.preflight(schema)
    if key:
        encode.check_bytes_column(schema, key, "key", numbers=True)
    if value:
        encode.check_bytes_column(schema, value, "value", numbers=False)
    else:
        encode.check_json_schema(rules.written(schema))
    for h in headers:
        encode.check_bytes_column(schema, h, "header", numbers=True)


def check_cluster(
    where: str,
    bootstrap_servers: str | list[str],
    *,
    servers: Sequence[str],
    producer_config: dict[str, Any],
    connect_timeout: float,
    topic: str,
    registry_topic: str | None,
    id_prefix: str,
    sink_id: str,
    create_topic: bool,
    partitions: int,
    replication_factor: int,
    transaction_timeout_ms: int,
) -> ClusterFacts:
    """Raise :class:`PreflightError` unless the sink ``where`` can write
    ``topic`` at ``bootstrap_servers`` (``servers``: the same, one per entry,
    for messages) in transactions; create the registry topic (and ``topic``
    with ``create_topic``) when missing."""
    try:
        wire = KafkaWire(bootstrap_servers, config=producer_config, timeout_s=connect_timeout)
    except Exception as e:
        raise PreflightError(f"cannot reach Kafka at {','.join(servers)}: {e}".strip()) from e
    needs = access.required(topic, registry_topic, id_prefix)

    def topics() -> ClusterFacts:
        access.check_topics(wire, where, needs, producer_config)
        created = checks.ensure_topic(
            wire,
            where,
            topic,
            partitions=partitions,
            replication_factor=replication_factor,
            config={},
            create=create_topic,
        )
        if registry_topic:
            created |= checks.ensure_topic(
                wire,
                where,
                registry_topic,
                partitions=1,
                replication_factor=replication_factor,
                config=TOPIC_CONFIG,
                create=True,
                registry=True,
            )
        if created:
            access.check_topics(wire, where, needs, producer_config)
        config = checks.topic_config(wire, topic)
        return ClusterFacts(
            topic_max_bytes=checks.max_message_bytes(config),
            topic_cleanup_policy=checks.cleanup_policy(config),
            pooled_ids=wire.api_version(DescribeTransactionsRequest) >= 0,
        )

    def transactions() -> None:
        probe = f"{id_prefix}tp-preflight.{sink_id}"  # under the ACL's prefix
        with KafkaWire(bootstrap_servers, config=producer_config, timeout_s=connect_timeout) as own:
            try:
                checks.check_transaction_timeout(own, where, transaction_timeout_ms, probe=probe)
            except checks.TransactionalIdDenied as e:
                acl = [a for a in needs if a.resource == "transactional-id"]
                raise access.denied(where, acl, producer_config) from e

    with wire:
        found = raise_first(run_all([topics, transactions], limit=2, name="twophase-preflight"))
    facts = found[0]
    assert isinstance(facts, ClusterFacts)
    return facts
