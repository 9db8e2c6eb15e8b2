"""Errors with the cause first: what a failed job says, through real Spark,
PostgreSQL and Kafka (the kinds are in lifecycle/errors.py, the translations in
sinks/explain.py)."""

from __future__ import annotations

import decimal
import json
import logging
import shutil
import uuid
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from lifecycle import (
    CheckpointCommitError,
    Job,
    JobFailedError,
    PipelineFailedError,
    RecoveryRefusedError,
    TaskFailedError,
)
from lifecycle.failures import cause_of
from sinks import ConfigError, KafkaSink, PostgresSink, _faults
from sinks.base import JobScope, WriteContext
from sinks.errors import CommitError
from tests.conftest import write_input
from tests.pgcheck import job_prepared
from tests.sparkutil import INPUT_SCHEMA


def _json_rows(path: Path, rows: list[dict[str, object]]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "part-0.json").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _failure_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name.startswith("lifecycle") and r.levelno >= logging.ERROR
    ]


def test_upsert_not_null_names_column_and_target_table(spark, pg_dsn, tmp_path, caplog):  # type: ignore[no-untyped-def]
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id bigint PRIMARY KEY, name text NOT NULL, amount float8)")
    rows = [{"id": i, "name": None if i == 3 else f"n{i}", "amount": 1.0} for i in range(10)]
    _json_rows(tmp_path / "in", rows)
    sink = PostgresSink(pg_dsn, "orders", key=["id"])
    job = Job(spark, "nulls", tmp_path / "state", checkpoint_interval=0)
    df = spark.readStream.schema(INPUT_SCHEMA).json(str(tmp_path / "in"))
    job.add_pipeline("load", df, [sink], bounded=True)
    caplog.set_level(logging.INFO)
    with pytest.raises(TaskFailedError) as e:
        job.run()
    err = e.value
    message = str(err)
    first = message.splitlines()[0]
    assert len(message.splitlines()) <= 3
    assert "pipeline 'load'" in first and f"sink '{sink.sink_id}'" in first
    assert "batch 0" in first
    assert 'column "name"' in first and "public.orders" in first and "NOT NULL" in first
    assert "stage_" not in message
    assert "(full trace in the log)" in first
    assert (err.pipeline, err.sink, err.batch) == ("load", sink.sink_id, 0)
    assert 'column "name"' in err.cause
    # the full trace is logged once, at ERROR, with the executor's traceback in it
    logged = _failure_records(caplog)
    assert len(logged) == 1, [r.getMessage()[:200] for r in logged]
    text = logged[0].getMessage()
    assert text.startswith(first) and "psycopg.errors.NotNullViolation" in text
    assert job_prepared(pg_dsn, "nulls") == []  # the failed tasks left nothing prepared


def test_too_large_kafka_record_names_the_limit_and_the_setting(  # type: ignore[no-untyped-def]
    spark, kafka_bootstrap, kafka_topic, tmp_path
):
    """kafka-python refuses a record above the producer's max_request_size (1 MiB
    by default) before sending it (tansu itself enforces no message size)."""
    topic = kafka_topic(1)
    _json_rows(tmp_path / "in", [{"id": 1, "payload": "x" * 1_500_000}, {"id": 2, "payload": "y"}])
    sink = KafkaSink(kafka_bootstrap, topic, key="id", value="payload")
    job = Job(spark, f"big{uuid.uuid4().hex[:8]}", tmp_path / "state", checkpoint_interval=0)
    df = spark.readStream.schema("id long, payload string").json(str(tmp_path / "in"))
    job.add_pipeline("load", df, [sink], bounded=True)
    with pytest.raises(TaskFailedError) as e:
        job.run()
    message = str(e.value)
    first = message.splitlines()[0]
    assert len(message.splitlines()) <= 3
    assert "pipeline 'load'" in first and f"sink '{sink.sink_id}'" in first and "batch 0" in first
    assert "max_request_size=1,048,576 bytes" in first
    assert "1,500,0" in first  # the record's size (value plus key and overhead)
    assert "max.message.bytes" in first and "producer_config" in first


def test_the_kinds_are_told_apart(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """A commit failure spans a checkpoint; a recovery refusal stops the start."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        for t in ("lost", "ok"):  # each state_dir (incarnation) its own table
            c.execute(f"CREATE TABLE {t} (id bigint PRIMARY KEY, name text, amount float8)")
    write_input(tmp_path / "in", files=1, rows_per_file=20)
    sinks = {t: PostgresSink(pg_dsn, t, commit_timeout=5, sink_id="orders") for t in ("lost", "ok")}
    sink = sinks["lost"]

    def make(state: str) -> Job:
        job = Job(spark, "kinds", tmp_path / state, checkpoint_interval=0)
        df = spark.readStream.schema(INPUT_SCHEMA).json(str(tmp_path / "in"))
        job.add_pipeline("load", df, [sinks[state]], bounded=True)
        return job

    # another session holds a lock the sink's commit waits for, past its commit_timeout
    locker = psycopg.connect(pg_dsn)
    _faults.register(
        "driver.before_commit",
        lambda: locker.execute("LOCK TABLE twophase.progress IN ACCESS EXCLUSIVE MODE"),
    )
    try:
        with pytest.raises(JobFailedError) as commit:
            make("lost").run()
    finally:
        _faults.clear()
        locker.close()
    err = commit.value
    assert isinstance(err, CheckpointCommitError)
    assert not isinstance(err, PipelineFailedError | RecoveryRefusedError)
    assert err.checkpoint >= 1 and list(err.failed) == [f"load/{sink.sink_id}"]
    assert "CommitError" in err.cause, err.cause
    assert isinstance(err.__cause__, CommitError)
    assert f"checkpoint {err.checkpoint}" in str(err).splitlines()[0]

    make("ok").run()  # commits; then its Spark checkpoint vanishes
    shutil.rmtree(tmp_path / "ok" / "pipelines" / "load" / "spark")
    with pytest.raises(JobFailedError) as refused:
        make("ok").run()
    assert isinstance(refused.value, RecoveryRefusedError)
    assert isinstance(refused.value, ConfigError)  # as before: the state does not match
    assert not isinstance(refused.value, CheckpointCommitError | PipelineFailedError)
    assert "Spark checkpoint" in str(refused.value)


# -- translations of the real errors of a real writer (no Spark) ----------------------


def _writer_error(dsn: str, ddl: str, key: list[str], batch: pa.RecordBatch) -> tuple[str, str]:
    """Run the PostgreSQL sink's own writer on ``batch``; return (cause, raw error)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(ddl)
    sink = PostgresSink(dsn, "t", key=key)
    sink.preflight(batch.schema)
    ctx = WriteContext(JobScope("tr", "p", sink.sink_id), 1, 0, 0, 1)
    writer = sink.open_writer(ctx, batch.schema)
    try:
        writer.write(batch)
        writer.prepare()
    except Exception as e:
        return cause_of(e, sink), str(e)
    finally:
        writer.close(failed=True)
    raise AssertionError("the write did not fail")


@pytest.mark.parametrize(
    ("ddl", "key", "values", "expected"),
    [
        (
            "CREATE TABLE t (id bigint PRIMARY KEY, code varchar(3))",
            ["id"],
            {"id": [1], "code": ["abcdef"]},
            ['too long for column "code"', "character varying(3)", "public.t"],
        ),
        (
            "CREATE TABLE t (id bigint PRIMARY KEY, amount numeric(5,2))",
            ["id"],
            {"id": [1], "amount": pa.array([decimal.Decimal("12345.00")], pa.decimal128(10, 2))},
            ['out of range for column "amount"', "public.t", "numeric field overflow"],
        ),
        (
            "CREATE TABLE t (id bigint PRIMARY KEY, code text UNIQUE)",
            ["id"],
            {"id": [1, 2], "code": ["same", "same"]},
            ["duplicate key in public.t", "Key (code)=(same)", "upserts by key ['id']"],
        ),
        (
            "CREATE TABLE t (id bigint PRIMARY KEY, code text)",
            [],
            {"id": [1, 1], "code": ["a", "b"]},
            ["duplicate key in public.t", "Key (id)=(1)", "pass key=[...]"],
        ),
    ],
)
def test_postgres_errors_in_user_terms(pg_dsn, ddl, key, values, expected):  # type: ignore[no-untyped-def]
    batch = pa.record_batch(values)
    cause, raw = _writer_error(pg_dsn, ddl, key, batch)
    for text in expected:
        assert text in cause, (cause, raw)
    assert "stage_" not in cause and "\n" not in cause
    if "varchar" in ddl:
        assert "stage_" in raw  # the raw error named the upsert's private staging table
