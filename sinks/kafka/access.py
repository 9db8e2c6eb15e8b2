"""What the Kafka sink's principal must be allowed, and the preflight check of it.

On a cluster with an authorizer, the sink's principal (its SASL user, or its
client certificate's name) needs these ACLs and no others
(:func:`required`):

* the target topic: WRITE (tasks write it), READ (the driver reads its log
  to settle commits, classify lost transactions and audit) and
  DESCRIBE_CONFIGS (preflight reads its ``max.message.bytes`` to size record
  batches);
* the registry topic: WRITE (writers announce their transactional ids in it;
  the driver writes claims, progress records and tombstones) and READ;
* TransactionalId, prefixed with ``transactional_id_prefix``: WRITE (tasks'
  transactions, the driver's commits and aborts, the preflight's probe).

WRITE and READ imply DESCRIBE. The registry topic needs CREATE as well when
the sink is to create it (an admin can create it instead: compacted, one
partition). Nothing is needed on the cluster (Kafka 3.0 and later: a
transactional producer's WRITE on its id covers idempotence); DESCRIBE_CONFIGS
on the cluster is optional (without it the preflight cannot compare
``transaction_timeout_ms`` with the brokers' maximum before its probe, and
says so in a warning). Set ``transactional_id_prefix``: every id the sink
uses starts with it, so one prefixed ACL covers them.

:func:`check_topics` asks the brokers (Metadata v8 and later, with the
topics' authorized operations) what the principal may do on both topics, and
raises :class:`~sinks.errors.PreflightError` naming each missing ACL and the
``kafka-acls`` command that grants it. A broker that does not say (tansu, or
no authorizer) is not checked. The transactional id's WRITE is found by the
preflight's InitProducerId probe (:mod:`sinks.kafka.checks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kafka.errors as Errors
from kafka.protocol.metadata import MetadataRequest

from sinks.errors import PreflightError
from sinks.kafka.wire import KafkaWire

_OPS = {"READ": 3, "WRITE": 4, "CREATE": 5, "DESCRIBE": 8, "DESCRIBE_CONFIGS": 10}
"""ACL operations by their code, the bit of each in an authorized-operations field"""
_UNSAID = -(2**31)
"""what a broker answers when it does not tell the authorized operations"""


@dataclass(frozen=True)
class Acl:
    """One ACL the sink needs: allow ``operation`` on ``resource`` ``name``."""

    resource: str  # "topic" or "transactional-id"
    name: str
    operation: str
    why: str
    prefixed: bool = False

    def command(self, principal: str) -> str:
        """The ``kafka-acls`` command that grants it to ``principal``."""
        kind = "--topic" if self.resource == "topic" else "--transactional-id"
        pattern = " --resource-pattern-type prefixed" if self.prefixed else ""
        return (
            f"kafka-acls.sh --bootstrap-server ... --add --allow-principal {principal} "
            f"--operation {self.operation.title().replace('_', '')} {kind} {self.name}{pattern}"
        )

    def __str__(self) -> str:
        pattern = " (prefixed)" if self.prefixed else ""
        return f"{self.operation} on {self.resource} {self.name!r}{pattern}"


def required(topic: str, registry: str | None, id_prefix: str) -> list[Acl]:
    """The least ACLs a sink writing ``topic`` needs (module docstring)."""
    acls = [
        Acl("topic", topic, "WRITE", "its tasks write the topic"),
        Acl("topic", topic, "READ", "the driver reads the topic's log to settle commits"),
        Acl(
            "topic",
            topic,
            "DESCRIBE_CONFIGS",
            "preflight reads the topic's max.message.bytes to size record batches",
        ),
    ]
    if registry:
        acls += [
            Acl("topic", registry, "WRITE", "writers announce their transactional ids in it"),
            Acl("topic", registry, "READ", "the driver reads the registry of transactional ids"),
        ]
    acls.append(
        Acl(
            "transactional-id",
            id_prefix or "tp",
            "WRITE",
            "the sink's transactions (every id starts with transactional_id_prefix)",
            prefixed=True,
        )
    )
    return acls


def principal(config: Mapping[str, Any]) -> str:
    """The principal the sink's settings authenticate as, for messages."""
    user = config.get("sasl_plain_username")
    return f"User:{user}" if user else "the sink's principal"


def check_topics(
    wire: KafkaWire,
    where: str,
    needs: Sequence[Acl],
    config: Mapping[str, Any],
) -> None:
    """Raise :class:`PreflightError` naming every topic ACL of ``needs`` the
    principal lacks on a topic that exists (a missing topic is left to the
    topic checks, which create it or say so)."""
    topics = sorted({a.name for a in needs if a.resource == "topic"})
    if not topics or wire.api_version(MetadataRequest) < 8:
        return  # (Metadata before v8 cannot tell the authorized operations)
    response = wire.send(
        MetadataRequest(
            topics=[MetadataRequest.MetadataRequestTopic(name=t) for t in topics],
            allow_auto_topic_creation=False,
            include_topic_authorized_operations=True,
            min_version=8,
        )
    )
    missing: list[Acl] = []
    for t in response.topics:
        error = Errors.for_code(t.error_code)
        wanted = [a for a in needs if a.resource == "topic" and a.name == t.name]
        if error is Errors.TopicAuthorizationFailedError:
            missing += wanted  # not even DESCRIBE (a WRITE or READ would imply it)
            continue
        if error is not Errors.NoError or t.authorized_operations in (None, _UNSAID):
            continue
        allowed = _operations(t.authorized_operations)
        missing += [a for a in wanted if _OPS[a.operation] not in allowed]
    if missing:
        raise denied(where, missing, config)


def _operations(field: Any) -> set[int]:
    """The operation codes of an authorized-operations field (kafka-python
    decodes it as the set of its bits; an int is the raw field)."""
    if isinstance(field, int):
        return {bit for bit in range(32) if field & (1 << bit)}
    return set(field)


def denied(where: str, missing: Sequence[Acl], config: Mapping[str, Any]) -> PreflightError:
    """The error naming ACLs the principal lacks, each with why and how to grant it."""
    who = principal(config)
    lines = [f"  - {a}: {a.why}\n      {a.command(who)}" for a in missing]
    return PreflightError(
        f"{where}: {who} lacks {len(missing)} ACL(s) the sink needs (docs/sinks/kafka.md, "
        "'Secured clusters'):\n" + "\n".join(lines)
    )
