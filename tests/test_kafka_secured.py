"""The Kafka sink on a secured Apache Kafka: SASL_SSL (SCRAM-SHA-512), ACLs enforced.

The broker (``lifecycle/testing/kafka_security.py``) lets the sink's user do
only what the ACLs of :func:`sinks.kafka.access.required` allow, the list the
docs/sinks/kafka.md gives. Two tests derive that list from both sides:

* it is enough: a job killed after its tasks' transactions were flushed, then
  restarted (fences, recovery commits, registry reads and writes), ends with
  every row once for a read_committed reader; ``twophase status`` and
  ``twophase audit`` work with the password given in the environment; and the
  password appears in no log, ledger or status output;
* each ACL of it is needed: without it the preflight fails, naming it and
  the ``kafka-acls`` command that grants it.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from lifecycle.testing import jars
from sinks.kafka import access
from tests.conftest import write_input
from tests.kafkacheck import consume_ids
from tests.procs import ROOT, run_job, twophase
from tests.test_apache_kafka import _transaction_version
from tests.tiers import SLOW

USER = "orders-writer"
PREFIX = "orders-eo."
PASSWORD_ENV = "TWOPHASE_TEST_KAFKA_PASSWORD"


class Secured:
    """A SASL_SSL broker with the sink's user, its topics and exactly the listed ACLs."""

    def __init__(self, broker: Any, security: Any) -> None:
        from kafka import KafkaAdminClient
        from kafka.admin import NewTopic

        self.broker, self.security = broker, security
        self.topic = f"orders-{uuid.uuid4().hex[:8]}"
        self.registry = f"orders-registry-{uuid.uuid4().hex[:8]}"
        self.admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, **broker.client())
        self.admin.create_topics(
            [
                NewTopic(self.topic, 3, 1),
                NewTopic(self.registry, 1, 1, topic_configs={"cleanup.policy": "compact"}),
            ]
        )
        self.acls = access.required(self.topic, self.registry, PREFIX)
        self.grant(self.acls)

    def _binding(self, acl: access.Acl) -> Any:
        from kafka.admin import (
            ACL,
            ACLOperation,
            ACLPermissionType,
            ACLResourcePatternType,
            ResourcePattern,
            ResourceType,
        )

        kind = ResourceType.TOPIC if acl.resource == "topic" else ResourceType.TRANSACTIONAL_ID
        pattern = ACLResourcePatternType.LITERAL
        if acl.prefixed:
            pattern = ACLResourcePatternType.PREFIXED
        return ACL(
            f"User:{USER}",
            "*",
            ACLOperation[acl.operation],
            ACLPermissionType.ALLOW,
            ResourcePattern(kind, acl.name, pattern),
        )

    def grant(self, acls: list[access.Acl]) -> None:
        result = self.admin.create_acls([self._binding(a) for a in acls])
        assert not result["failed"], result

    def revoke(self, acl: access.Acl) -> None:
        from kafka.admin import ACLFilter, ResourcePatternFilter

        b = self._binding(acl)
        pattern = ResourcePatternFilter(
            b.resource_pattern.resource_type,
            b.resource_pattern.resource_name,
            b.resource_pattern.pattern_type,
        )
        found = self.admin.delete_acls(
            [ACLFilter(b.principal, b.host, b.operation, b.permission_type, pattern)]
        )
        assert any(matches for _, matches, _ in found), found

    def sink_config(self) -> dict[str, Any]:
        return self.security.client(USER)

    def password(self) -> str:
        return str(self.security.password(USER))


@pytest.fixture(scope="module")
def secured() -> Iterator[Secured]:
    from lifecycle.testing.apache_kafka import ApacheKafka
    from lifecycle.testing.kafka_security import SecureListener

    jars.require("kafka-broker")
    security = SecureListener(users={USER: f"pw-{uuid.uuid4().hex}"})
    with ApacheKafka(security=security) as broker:
        s = Secured(broker, security)
        try:
            yield s
        finally:
            s.admin.close()


def _preflight(s: Secured) -> None:
    from sinks import KafkaSink

    sink = KafkaSink(
        s.broker.bootstrap,
        s.topic,
        key="id",
        producer_config=s.sink_config(),
        transactional_id_prefix=PREFIX,
        registry_topic=s.registry,
        connect_timeout=10,
    )
    try:
        sink.preflight(pa.schema([("id", pa.int64())]))
    finally:
        sink.close()


def test_each_listed_acl_is_needed_and_its_absence_is_named_at_preflight(
    secured: Secured,
) -> None:
    from sinks import PreflightError

    _preflight(secured)  # the whole list: passes
    for acl in secured.acls:
        secured.revoke(acl)
        try:
            deadline = time.monotonic() + 15  # an ACL change reaches the authorizer soon
            while True:
                try:
                    _preflight(secured)
                except PreflightError as e:
                    message = str(e)
                    break
                assert time.monotonic() < deadline, f"preflight passed without {acl}"
                time.sleep(0.3)
            assert str(acl) in message and acl.command(f"User:{USER}") in message, message
            assert message.count("\n  - ") == 1, message  # only the missing one
        finally:
            secured.grant([acl])


@SLOW  # about a minute; each listed ACL is checked at preflight in the default run
def test_a_killed_job_with_exactly_the_listed_acls_is_exact_and_shows_no_secret(  # type: ignore[no-untyped-def]
    secured: Secured, tmp_path: Path
):
    s = secured
    assert _transaction_version(s.broker) == 2  # Kafka 4.x's default, as users run it
    n = write_input(tmp_path / "in", files=4, rows_per_file=100)
    job = f"sec{uuid.uuid4().hex[:8]}"
    state = tmp_path / "state"
    args = ["--bootstrap", s.broker.bootstrap, "--topic", s.topic, "--state", str(state)]
    args += ["--input", str(tmp_path / "in"), "--job", job, "--sasl-user", USER]
    args += ["--cafile", s.security.cafile, "--id-prefix", PREFIX, "--registry", s.registry]
    env = {PASSWORD_ENV: s.password()}
    transcript = tmp_path / "job.log"
    first = run_job(
        "kafka_job.py",
        args,
        transcript,
        "executor.prepared#0=raise;driver.after_record@2=kill",
        env=env,
    )
    assert first.proc.returncode == -signal.SIGKILL, first.tail(3000)
    second = run_job("kafka_job.py", args, transcript, None, env=env)
    assert second.proc.returncode == 0, second.tail(5000)

    from sinks.kafka.log import read_topic

    admin = s.broker.client()
    ids = consume_ids(s.broker.bootstrap, s.topic, "read_committed", s.security.librdkafka("admin"))
    twice = [i for i, c in Counter(ids).items() if c > 1]
    assert not twice and sorted(ids) == list(range(n)), f"{len(ids)} rows, twice: {twice[:5]}"
    deadline = time.monotonic() + 10  # Apache Kafka writes markers just after EndTxn
    while (left := read_topic(s.broker.bootstrap, s.topic, admin).n_open) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert left == 0, f"{left} record(s) left in open transactions"
    assert read_topic(s.broker.bootstrap, s.topic, admin).n_aborted > 0  # the kill's work

    # the operator's commands, with the password only in the environment
    cli_env = {"PYTHONPATH": str(ROOT), "TWOPHASE_KAFKA_SASL_PLAIN_PASSWORD": s.password()}
    outputs = []
    for command in (["status", str(state)], ["audit", str(state), "--all"]):
        done = twophase(*command, env=cli_env, timeout=180)
        outputs.append(done.stdout + done.stderr)
        assert done.returncode == 0, f"twophase {command[0]}:\n{outputs[-1]}"
    assert "mismatch" not in outputs[1] and "expired" not in outputs[1], outputs[1]

    secret = s.password()
    leaks = [str(p) for p in state.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaks, f"the password is in {leaks}"
    assert secret not in transcript.read_text(errors="replace")
    assert not any(secret in o for o in outputs)
    print(f"transcript of the secured run: {transcript}")
