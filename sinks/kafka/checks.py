"""Checks of the Kafka sink: its settings, topics and the transaction timeout."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import kafka.errors as Errors
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

from sinks.errors import ConfigError, PreflightError
from sinks.kafka.registry import DEFAULT_TOPIC
from sinks.kafka.wire import KafkaWire

log = logging.getLogger("sinks.kafka")

_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_RESERVED = {
    "bootstrap_servers": "pass it as the first argument",
    "transactional_id": "it is derived from the task (see transactional_id_prefix)",
    "transaction_timeout_ms": "pass transaction_timeout_ms=",
    "enable_idempotence": "transactions need it",
    "acks": "transactions need acks='all'",
    "key_serializer": "keys are sent as bytes",
    "value_serializer": "values are sent as bytes",
    "partitioner": "rows are partitioned by murmur2 of the key, as Kafka's default partitioner",
}


def check_settings(
    bootstrap_servers: str | list[str],
    topic: str,
    registry_topic: str | None,
    transaction_timeout_ms: int,
    partitions: int,
    replication_factor: int,
    producer_config: dict[str, Any] | None,
) -> None:
    """Raise :class:`ConfigError` for settings of ``KafkaSink`` that cannot work."""
    if not bootstrap_servers:
        raise ConfigError("KafkaSink needs bootstrap_servers, e.g. 'broker:9092'")
    for what, name in (("topic", topic), ("registry_topic", registry_topic or "x")):
        if not isinstance(name, str) or not _TOPIC.match(name) or name in (".", ".."):
            raise ConfigError(
                f"{what} {name!r} is not a valid Kafka topic name "
                "(1-249 characters from A-Z a-z 0-9 . _ -)"
            )
    if not isinstance(transaction_timeout_ms, int) or transaction_timeout_ms <= 0:
        raise ConfigError("transaction_timeout_ms must be a positive integer (milliseconds)")
    if partitions < 1 or replication_factor < 1:
        raise ConfigError("partitions and replication_factor must be at least 1")
    bad = sorted(set(producer_config or {}) & set(_RESERVED))
    if bad:
        raise ConfigError(
            f"producer_config may not set {bad}: " + "; ".join(f"{k}: {_RESERVED[k]}" for k in bad)
        )


def ensure_topic(
    wire: KafkaWire,
    where: str,
    topic: str,
    *,
    partitions: int,
    replication_factor: int,
    config: dict[str, str],
    create: bool,
    registry: bool = False,
) -> bool:
    """Raise unless ``topic`` exists; create it first when ``create`` (and
    return True). ``where`` names the sink in messages; ``registry``: the topic
    is the sink's registry of transactional ids."""
    if wire.partition_leaders(topic) is not None:
        return False
    if not create:
        raise PreflightError(
            f"topic {topic!r} does not exist ({where}); create it, or pass "
            "create_topic=True (with partitions= and replication_factor=) to KafkaSink"
        )
    try:
        wire.admin.create_topics(
            [NewTopic(topic, partitions, replication_factor, topic_configs=config)]
        )
    except Errors.TopicAlreadyExistsError:
        pass  # created concurrently
    except Exception as e:
        hint = ""
        if registry:
            hint = (
                f"; it is the registry of transactional ids (default {DEFAULT_TOPIC}): create "
                "it as an admin (compacted), or pass registry_topic= naming a topic you may write"
            )
        raise PreflightError(f"cannot create topic {topic!r} ({where}): {e}{hint}") from e
    log.info("created Kafka topic %s (%d partition(s))", topic, partitions)
    return True


def broker_max_timeout(wire: KafkaWire) -> int | None:
    """The smallest ``transaction.max.timeout.ms`` the brokers report, or None
    when none reports it (tansu answers DescribeConfigs with no entries)."""
    found: list[int] = []
    for node in wire.broker_ids():
        try:
            res = wire.admin.describe_configs(
                [ConfigResource(ConfigResourceType.BROKER, str(node))], config_filter="all"
            )
        except Exception as e:
            log.debug("DescribeConfigs of broker %s failed: %r", node, e)
            continue
        entry = res.get("broker", {}).get(str(node), {}).get("transaction.max.timeout.ms")
        if entry and entry.get("value") is not None:
            found.append(int(entry["value"]))
    return min(found) if found else None


def topic_config(wire: KafkaWire, topic: str) -> dict[str, str]:
    """The topic's configuration (its own values, or the brokers' defaults) by
    name; empty when the broker does not say (tansu answers DescribeConfigs
    with no entries)."""
    try:
        res = wire.admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    except Exception as e:
        log.debug("DescribeConfigs of topic %s failed: %r", topic, e)
        return {}
    entries = res.get("topic", {}).get(topic, {})
    return {
        name: str(entry["value"])
        for name, entry in entries.items()
        if isinstance(entry, dict) and entry.get("value") is not None
    }


def max_message_bytes(config: dict[str, str]) -> int | None:
    """A topic's ``max.message.bytes`` (:func:`topic_config`), the largest
    record batch it takes; None when the broker did not say."""
    value = config.get("max.message.bytes")
    return int(value) if value is not None else None


def cleanup_policy(config: dict[str, str]) -> str | None:
    """A topic's ``cleanup.policy`` (:func:`topic_config`): ``delete``,
    ``compact`` or both (``compact,delete``); None when the broker did not say."""
    return config.get("cleanup.policy")


def is_compacted(policy: str | None) -> bool:
    """Whether a topic of ``cleanup.policy`` ``policy`` is compacted (keeps the
    last record per key, and a tombstone deletes the key)."""
    return policy is not None and "compact" in (p.strip() for p in policy.split(","))


_PASSING = (
    Errors.CoordinatorLoadInProgressError,
    Errors.CoordinatorNotAvailableError,
    Errors.NotCoordinatorError,
    Errors.ConcurrentTransactionsError,
)
"""InitProducerId answers a client retries (a new cluster's transaction log
being created or loaded, a coordinator that moved, the probe's earlier abort
still completing)"""


def _init_probe(wire: KafkaWire, probe: str, timeout_ms: int, within: float = 60.0) -> Any:
    """InitProducerId for ``probe``, retried while the answer is one that passes;
    the error class of the last answer."""
    deadline = time.monotonic() + within
    while True:
        coordinator = wire.find_coordinators([probe])[probe]
        error, _, _ = wire.init_producer_id(coordinator, probe, timeout_ms)
        if error not in _PASSING or time.monotonic() > deadline:
            return error
        time.sleep(0.2)


class TransactionalIdDenied(PreflightError):
    """The ACLs do not let the sink's principal use its transactional ids."""


def check_transaction_timeout(wire: KafkaWire, where: str, mine: int, probe: str) -> None:
    """Refuse a ``transaction_timeout_ms`` (``mine``) above the brokers' maximum,
    and a cluster that will not start a transaction (disabled, or ACLs), found
    by an InitProducerId for the transactional id ``probe``. ``where`` names the
    sink in messages."""
    broker_max = broker_max_timeout(wire)
    if broker_max is not None and mine > broker_max:
        raise PreflightError(
            f"transaction_timeout_ms={mine} exceeds the broker's transaction.max.timeout.ms="
            f"{broker_max} ({where}); lower transaction_timeout_ms or raise "
            "transaction.max.timeout.ms on the brokers"
        )
    if broker_max is None:
        log.info(
            "%s: the broker does not report transaction.max.timeout.ms (tansu does not; "
            "Apache Kafka does to a principal with DESCRIBE_CONFIGS on the cluster), so "
            "transaction_timeout_ms=%d cannot be compared with it (an InitProducerId probe "
            "follows, which Apache Kafka refuses for a timeout above its maximum; tansu "
            "enforces no transaction timeout at all)",
            where,
            mine,
        )
    # The definitive test: InitProducerId with a timeout above the maximum is
    # refused (INVALID_TRANSACTION_TIMEOUT), as is one the ACLs do not allow.
    try:
        error = _init_probe(wire, probe, mine)
    except Errors.TransactionalIdAuthorizationFailedError as e:  # FindCoordinator's answer
        raise TransactionalIdDenied(f"{where}: FindCoordinator of {probe} was refused") from e
    except Exception as e:
        raise PreflightError(
            f"{where}: the broker cannot start a transaction ({e!r}); "
            "exactly-once needs a broker with transactions enabled"
        ) from e
    if error is Errors.InvalidTransactionTimeoutError:
        raise PreflightError(
            f"transaction_timeout_ms={mine} is larger than the broker's "
            f"transaction.max.timeout.ms ({where}); lower it, or raise "
            "transaction.max.timeout.ms on the brokers"
        )
    if error in _PASSING:
        raise PreflightError(
            f"{where}: the transaction coordinator did not become available within a minute "
            f"({error.__name__}); is the broker's __transaction_state topic healthy?"
        )
    if error is Errors.TransactionalIdAuthorizationFailedError:
        raise TransactionalIdDenied(f"{where}: InitProducerId of {probe} was refused")
    if error is not Errors.NoError:
        raise PreflightError(
            f"{where}: the broker refused a transaction ({error.__name__}); "
            "check the TransactionalId ACLs (WRITE on the transactional_id_prefix)"
        )


def min_safe_timeout_ms(
    checkpoint_interval_s: float,
    *,
    batch_duration_s: float = 60.0,
    commit_timeout_s: float = 300.0,
    restart_s: float = 300.0,
) -> int:
    """The smallest ``transaction_timeout_ms`` that cannot abort a prepared
    transaction before its commit.

    A transaction opens at a task's first write of batch N and is committed
    by the first checkpoint after Spark completed N: it stays open for up to
    the batch's duration, plus one checkpoint interval, plus the commit's
    retries (``commit_timeout``), plus the time to restart a crashed driver
    (recovery commits it). If it is open longer, Apache Kafka aborts it and
    its rows are lost (the commit then raises TransactionLostError)."""
    total = batch_duration_s + max(0.0, checkpoint_interval_s) + commit_timeout_s + restart_s
    return int(total * 1000)


def check_checkpoint_interval(
    where: str,
    timeout_ms: int,
    checkpoint_interval_s: float,
    *,
    commit_timeout_s: float,
    batch_duration_s: float = 60.0,
    restart_s: float = 300.0,
) -> None:
    """Raise :class:`PreflightError` when the sink's ``transaction_timeout_ms``
    (``timeout_ms``) is smaller than :func:`min_safe_timeout_ms` for this
    checkpoint interval. ``where`` names the sink in messages."""
    need = min_safe_timeout_ms(
        checkpoint_interval_s,
        batch_duration_s=batch_duration_s,
        commit_timeout_s=commit_timeout_s,
        restart_s=restart_s,
    )
    if timeout_ms < need:
        raise PreflightError(
            f"{where}: transaction_timeout_ms={timeout_ms} is "
            f"too small for checkpoint_interval={checkpoint_interval_s:g}s: a prepared "
            f"transaction may wait up to {need} ms (batch {batch_duration_s:g}s + interval "
            f"+ commit_timeout {commit_timeout_s:g}s + restart {restart_s:g}s) for its "
            "commit, and Kafka aborts it after transaction_timeout_ms, losing its rows. "
            f"Raise transaction_timeout_ms to at least {need} (and the brokers' "
            "transaction.max.timeout.ms with it), or checkpoint more often"
        )
