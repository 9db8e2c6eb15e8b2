"""End to end through real Spark and a real Kafka-protocol broker (in-process driver).

The broker is the session's ``kafka_bootstrap`` (tansu, or Apache Kafka when
``TWOPHASE_KAFKA_BOOTSTRAP`` is set). Exactly-once and "nothing left open" are
decided from the control markers in the raw log (``tests/kafkacheck.py``),
never by a read_committed consumer.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import psycopg
import pytest

from lifecycle import Job, PipelineState
from lifecycle.job_sinks import sink_label
from lifecycle.ledger import read_ledger
from sinks import KafkaSink, PostgresSink, _faults
from sinks.kafka.log import read_topic
from sinks.kafka.pool import lane_of
from tests.conftest import write_input
from tests.kafkacheck import (
    assert_exactly_once,
    assert_nothing_open,
    committed_ids,
    job_transactional_ids,
    open_txns,
)
from tests.pgcheck import assert_exactly_once as pg_exactly_once
from tests.pgcheck import job_prepared
from tests.sparkutil import INPUT_SCHEMA


def _stream(spark, path: Path, files_per_batch: int = 1):  # type: ignore[no-untyped-def]
    return (
        spark.readStream.schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", files_per_batch)
        .json(str(path))
    )


def _job_name(kind: str) -> str:
    # unique per test: the registry topic is shared by every test of a cluster
    return f"{kind}{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("interval", [0.0, 4.0])
def test_bounded_job_commits_every_row_once(  # type: ignore[no-untyped-def]
    spark, kafka_bootstrap, kafka_topic, tmp_path, interval
):
    n = write_input(tmp_path / "in", files=4, rows_per_file=250)
    topic = kafka_topic(3)
    name = _job_name("ke2e")
    sink = KafkaSink(kafka_bootstrap, topic, key="id")
    job = Job(spark, name, tmp_path / "state", checkpoint_interval=interval)
    job.add_pipeline("load", _stream(spark, tmp_path / "in"), [sink], bounded=True)
    result = job.run()
    assert result.pipelines == {"load": PipelineState.FINISHED}
    assert result.final_checkpoint is not None and result.committed
    assert result.rows_committed == {sink_label("load", sink.sink_id): n}
    log = assert_exactly_once(kafka_bootstrap, topic, n)
    assert log.n_aborted == 0  # no task failed: nothing was ever aborted
    assert len({r.partition for r in log.committed}) == 3
    assert_nothing_open(kafka_bootstrap, topic, name)
    ids = job_transactional_ids(kafka_bootstrap, name)
    if ids is not None:  # pooled ids (sinks/kafka/pool.py): a lane per batch in flight
        lanes = {lane_of(t, "") for t in ids}
        assert None not in lanes and len(lanes) <= 4, ids
        if interval == 0:  # a checkpoint after each batch: lanes come back and are reused
            assert len(lanes) < 4, ids
    if interval > 0:
        # 4 batches of one file each, grouped: fewer checkpoints than batches
        assert result.checkpoints < 4


def test_nothing_visible_before_checkpoint_completes(  # type: ignore[no-untyped-def]
    spark, kafka_bootstrap, kafka_topic, tmp_path
):
    """Hold the commit back and read the log meanwhile: invariant 1. Three
    batches wait for one (final) checkpoint; at ``driver.before_commit`` every
    row is written and flushed, in transactions that are open, not committed."""
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    topic = kafka_topic(3)
    name = _job_name("kvis")
    seen: dict[str, object] = {}
    release = threading.Event()

    def before_commit() -> None:
        log = read_topic(kafka_bootstrap, topic)
        seen["committed"] = len(log.committed)
        seen["aborted"] = log.n_aborted
        seen["open"] = log.n_open
        seen["open_txns"] = len(open_txns(kafka_bootstrap, name))
        release.set()

    _faults.register("driver.before_commit", before_commit)
    try:
        job = Job(spark, name, tmp_path / "state", checkpoint_interval=60)
        job.add_pipeline(
            "load",
            _stream(spark, tmp_path / "in"),
            [KafkaSink(kafka_bootstrap, topic, key="id")],
            bounded=True,
        )
        result = job.run()
    finally:
        _faults.clear()
    assert release.is_set()
    assert seen["committed"] == 0 and seen["aborted"] == 0
    assert seen["open"] == n  # all written, none visible
    assert seen["open_txns"] >= 3  # at least one transaction per batch
    assert result.checkpoints == 1  # the final one, holding all three batches
    assert_exactly_once(kafka_bootstrap, topic, n)
    assert_nothing_open(kafka_bootstrap, topic, name)
    ids = job_transactional_ids(kafka_bootstrap, name)
    if ids is not None:  # three batches open at once: three lanes of pooled ids
        assert {lane_of(t, "") for t in ids} == {0, 1, 2}, ids


def test_postgres_and_kafka_commit_on_the_same_checkpoint(  # type: ignore[no-untyped-def]
    spark, kafka_bootstrap, kafka_topic, pg_dsn, tmp_path
):
    """One pipeline, two sinks: every checkpoint commits the same batches to both."""
    n = write_input(tmp_path / "in", files=3, rows_per_file=200)
    topic = kafka_topic(3)
    name = _job_name("kdual")
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8)")
    kafka = KafkaSink(kafka_bootstrap, topic, key="id")
    pg = PostgresSink(pg_dsn, "orders")
    job = Job(spark, name, tmp_path / "state", checkpoint_interval=0)
    job.add_pipeline("load", _stream(spark, tmp_path / "in"), [kafka, pg], bounded=True)
    result = job.run()
    labels = {sink_label("load", kafka.sink_id), sink_label("load", pg.sink_id)}
    assert result.rows_committed == dict.fromkeys(labels, n)

    doc = read_ledger(tmp_path / "state")
    assert doc is not None and doc["pending"] == {} and doc["decided"] is None
    with_rows = [cp for cp in doc["history"] if cp["rows"]]
    assert len(with_rows) >= 2  # interval 0: batches commit in several checkpoints
    for cp in with_rows:  # each checkpoint committed both sinks, the same rows
        assert set(cp["rows"]) == labels, cp
        assert len(set(cp["rows"].values())) == 1, cp
        assert cp["committed_at"] is not None
    assert sum(cp["rows"][sink_label("load", pg.sink_id)] for cp in with_rows) == n

    log = assert_exactly_once(kafka_bootstrap, topic, n)
    assert committed_ids(log) == list(range(n))
    assert_nothing_open(kafka_bootstrap, topic, name)
    pg_exactly_once(pg_dsn, "orders", n)
    assert job_prepared(pg_dsn, name) == []
