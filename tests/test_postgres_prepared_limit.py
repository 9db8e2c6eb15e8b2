"""PostgreSQL's max_prepared_transactions: estimated at preflight, guarded at run
time, and named when it is hit anyway. A server of its own with a small limit."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pyarrow as pa
import pytest

from lifecycle import Job
from lifecycle.testing.postgres_server import PostgresServer
from sinks import PostgresSink, PreparedLimitError
from sinks.base import ExpectedLoad, JobScope, WriteContext
from tests.conftest import write_input
from tests.pgcheck import assert_exactly_once, job_prepared
from tests.sparkutil import INPUT_SCHEMA

LIMIT = 12


@pytest.fixture(scope="module")
def small_server() -> Iterator[PostgresServer]:
    with PostgresServer(settings={"max_prepared_transactions": str(LIMIT)}) as server:
        server.start()
        yield server


@pytest.fixture
def dsn(small_server: PostgresServer) -> Iterator[str]:
    with psycopg.connect(small_server.dsn(), autocommit=True) as c:
        for (gid,) in c.execute("SELECT gid FROM pg_prepared_xacts").fetchall():
            c.execute(f"ROLLBACK PREPARED '{gid}'")
        c.execute("DROP TABLE IF EXISTS orders")
        c.execute("CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8)")
    yield small_server.dsn()


SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64())])


def test_preflight_estimate_warns_with_the_number_to_set(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    sink = PostgresSink(dsn, "orders")
    sink.preflight(SCHEMA)
    caplog.set_level(logging.WARNING, logger="sinks.postgres")
    sink.expect_load(ExpectedLoad(tasks_per_batch=2, batches_per_checkpoint=3))
    assert not caplog.records  # 6 < 12
    sink.expect_load(ExpectedLoad(tasks_per_batch=4, batches_per_checkpoint=6))
    said = caplog.records[-1].getMessage()
    assert "max_prepared_transactions is 12" in said and "about 24" in said
    assert "at least 48" in said


def test_the_limit_hit_names_the_setting(dsn: str) -> None:
    sink = PostgresSink(dsn, "orders")
    sink.preflight(SCHEMA)
    scope = JobScope("limit", "p", sink.sink_id, "0123456789ab")
    sink.committer().claim(scope)
    for part in range(LIMIT + 1):
        w = sink.open_writer(WriteContext(scope, 1, 0, part, part), SCHEMA)
        w.write(pa.RecordBatch.from_pydict({"id": [part], "name": ["x"], "amount": [1.0]}))
        if part < LIMIT:
            assert w.prepare() is not None
            w.close()
            continue
        with pytest.raises(PreparedLimitError) as e:
            w.prepare()
        w.close(failed=True)
    message = str(e.value)
    assert "max_prepared_transactions" in message and "currently 12" in message
    assert "postgresql.conf" in message and "checkpoint_interval" in message
    assert len(job_prepared(dsn, "limit")) == LIMIT


def test_the_job_checkpoints_early_before_the_limit(spark, dsn, tmp_path, caplog):  # type: ignore[no-untyped-def]
    """Ten batches of three tasks, a checkpoint interval far longer than the
    run: without the guard 30 transactions would wait for one checkpoint on a
    server that holds 12."""
    n = write_input(tmp_path / "in", files=10, rows_per_file=30)
    df = (
        spark.readStream.schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(tmp_path / "in"))
    )
    job = Job(spark, "early", tmp_path / "state", checkpoint_interval=600)
    job.add_pipeline(
        "load",
        df,
        [PostgresSink(dsn, "orders")],
        bounded=True,
        transform=lambda d: d.repartition(3),
    )
    caplog.set_level(logging.INFO, logger="lifecycle")
    result = job.run()
    assert_exactly_once(dsn, "orders", n)
    assert job_prepared(dsn, "early") == []
    early = [r for r in caplog.records if "taking a checkpoint early" in r.getMessage()]
    assert early and "max_prepared_transactions=12" in early[0].getMessage()
    assert result.checkpoints >= 2
