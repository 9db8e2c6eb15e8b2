"""The orderings a Kafka writer keeps while it saves round trips (issue 46).

A writer sends what does not need an answer beside what does (the leaders
beside the coordinator's requests), adds the registry's partition and its
data partitions to its transaction in one request, frames its first batch
while its announcement is on its way, and keeps its connection for the
Python worker's next task (:mod:`sinks.kafka.task_wires`). What must stay in
order stays: no data record before the announcement is acknowledged (the
registry names every transaction that holds data), and nothing a fenced
producer sends is ever appended (``tests/test_kafka_zombies.py`` fences one
between its InitProducerId and its first AddPartitionsToTxn).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from sinks.base import JobScope
from sinks.kafka import KafkaSink, task_wires
from sinks.kafka.log import read_topic
from sinks.kafka.produce import ProduceError
from tests.kafkacheck import read_settled
from tests.test_kafka_pool import _ctx
from tests.test_kafka_unit import INC, SCHEMA, committed_ids, job_name, make_topic, rows


@pytest.fixture(autouse=True)
def no_idle_wires() -> Iterator[None]:
    task_wires.close_idle()
    yield
    task_wires.close_idle()


def _registry(bootstrap: str, max_message_bytes: int | None = None) -> str:
    name = f"reg-{uuid.uuid4().hex[:10]}"
    config = {"cleanup.policy": "compact"}
    if max_message_bytes is not None:
        config["max.message.bytes"] = str(max_message_bytes)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(name, 1, 1, topic_configs=config)])
    finally:
        admin.close()
    return name


def test_no_data_record_is_sent_when_the_announcement_is_refused(kafka_bootstrap: str) -> None:
    """The registry refuses the announcement (its ``max.message.bytes`` is
    smaller than the record) while the data partitions would take the batch:
    the data is framed while the announcement is on its way, but sent only
    after its acknowledgement, so the topic holds no record of the attempt at
    all, whatever its transaction's fate (pipelined behind the announcement on
    the same connection, the batch was appended, then aborted). The attempt
    fails, and its connection is closed, not kept for the next task."""
    topic = make_topic(kafka_bootstrap, partitions=2)
    registry = _registry(kafka_bootstrap, max_message_bytes=80)
    sink = KafkaSink(kafka_bootstrap, topic, key="id", sink_id="k", registry_topic=registry)
    try:
        sink.preflight(SCHEMA)
        scope = JobScope(job_name(), "p", "k", INC)
        lane = sink.committer().lease(scope, 0)
        writer = sink.open_writer(_ctx(scope, 0, 0, lane), SCHEMA)
        with pytest.raises(ProduceError, match=r"MessageSizeTooLarge|RecordTooLarge"):
            writer.write(rows(0, 200))
        writer.close(failed=True)
        assert task_wires.idle_count() == 0
        log = read_topic(kafka_bootstrap, topic)
        assert (log.committed, log.aborted, log.open) == ([], [], [])
        announced = read_topic(kafka_bootstrap, registry)
        assert (announced.committed, announced.open) == ([], [])
    finally:
        sink.close()


def test_the_announcement_commits_with_the_data_and_the_worker_keeps_its_wire(
    kafka_bootstrap: str,
) -> None:
    """Two tasks in a row, as a Python worker runs them: the second writes over
    the connection the first left (one wire in all), each announcement is in
    the registry and commits with its data, and read_committed reads each row
    once."""
    topic = make_topic(kafka_bootstrap, partitions=2)
    registry = _registry(kafka_bootstrap)
    sink = KafkaSink(kafka_bootstrap, topic, key="id", sink_id="k", registry_topic=registry)
    try:
        sink.preflight(SCHEMA)
        scope = JobScope(job_name(), "p", "k", INC)
        lane = sink.committer().lease(scope, 0)
        done, wires = [], []
        for partition in (0, 1):
            writer = sink.open_writer(_ctx(scope, 0, partition, lane), SCHEMA)
            writer.write(rows(100 * partition, 50))
            wires.append(writer._wire)
            done.append(writer.prepare())
            writer.close()
            assert task_wires.idle_count() == 1
        assert wires[0] is not None and wires[0] is wires[1]
        sink.committer().commit(done)
        log = read_settled(kafka_bootstrap, topic)
        assert committed_ids(log) == [*range(50), *range(100, 150)]
        assert log.n_aborted == log.n_open == 0
        announced = read_settled(kafka_bootstrap, registry)
        keys = sorted(r.key for r in announced.committed if r.key is not None)
        assert keys == sorted(c["transactional_id"].encode() for c in done)
    finally:
        sink.close()
