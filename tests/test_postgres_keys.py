"""Keyed writes to PostgreSQL (the rules of :mod:`sinks.keys`), no Spark.

Each test drives the sink as a batch does: preflight and claim on the driver,
a writer per partition that writes and prepares, the commit. The data is
hostile: null keys, different rows of one key in one batch, ties of the
ordering column, a table with identity, serial and defaulted columns the
DataFrame does not feed, column names with dots.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from lifecycle import Job, TaskFailedError
from sinks import (
    ConfigError,
    DuplicateKeyError,
    NullKeyError,
    PostgresSink,
    PreflightError,
)
from sinks.base import JobScope, WriteContext
from tests.pgcheck import job_prepared
from tests.sparkutil import INPUT_SCHEMA

JOB = "keys"


def _table(dsn: str, ddl: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(ddl)


def _rows(dsn: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as c:
        return c.execute(query).fetchall()


def _write(sink: PostgresSink, batches: Sequence[pa.RecordBatch], batch_id: int = 0) -> None:
    """One batch: every record batch through one writer (one partition), then
    the commit."""
    schema = batches[0].schema
    sink.preflight(schema)
    scope = JobScope(JOB, "p", sink.sink_id, "0123456789ab")
    sink.committer().claim(scope)
    w = sink.open_writer(WriteContext(scope, 1, batch_id, 0, batch_id * 10), schema)
    failed = True
    try:
        for b in batches:
            w.write(b)
        c = w.prepare()
        failed = False
    finally:
        w.close(failed=failed)
    assert c is not None
    sink.committer().commit([c])


def _json_rows(path: Path, rows: list[dict[str, object]]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "part-0.json").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _batch(**cols: Any) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(cols)


def test_null_keys_fail_the_batch_with_the_column_named(pg_dsn: str) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint UNIQUE, name text)")
    sink = PostgresSink(pg_dsn, "t", key=["id"])
    ids = [None if i % 5 == 0 else i for i in range(40)]  # 8 null keys of 40, as reported
    with pytest.raises(NullKeyError, match=r"8 row\(s\) of batch 0 have a null in key column 'id'"):
        _write(sink, [_batch(id=ids, name=[f"n{i}" for i in range(40)])])
    assert _rows(pg_dsn, "SELECT count(*) FROM t") == [(0,)]
    assert job_prepared(pg_dsn, JOB) == []


def test_a_null_key_after_clean_record_batches_fails_the_whole_batch(pg_dsn: str) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, name text)")
    sink = PostgresSink(pg_dsn, "t", key=["id"])
    good = _batch(id=[1, 2], name=["a", "b"])
    with pytest.raises(NullKeyError):
        _write(sink, [good, _batch(id=[3, None], name=["c", "d"])])
    assert _rows(pg_dsn, "SELECT count(*) FROM t") == [(0,)]
    assert job_prepared(pg_dsn, JOB) == []


def test_preflight_warns_about_nullable_key_and_order_columns(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, v bigint, name text)")
    schema = pa.schema(
        [pa.field("id", pa.int64()), pa.field("v", pa.int64()), pa.field("name", pa.string())]
    )
    caplog.set_level(logging.WARNING, logger="sinks.keys")
    PostgresSink(pg_dsn, "t", key=["id"], order_by="v").preflight(schema)
    said = [r.getMessage() for r in caplog.records]
    assert any("key column 'id' is nullable" in m for m in said), said
    assert any("order_by column 'v' is nullable" in m for m in said), said
    caplog.clear()
    strict = pa.schema(
        [pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.int64(), nullable=False)]
    )
    PostgresSink(pg_dsn, "t", key=["id"], order_by="v").preflight(strict)
    assert not caplog.records


def test_different_rows_of_one_key_without_order_by_are_refused(pg_dsn: str) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, name text)")
    _table(pg_dsn, "INSERT INTO t VALUES (7, 'before')")
    sink = PostgresSink(pg_dsn, "t", key=["id"])
    with pytest.raises(DuplicateKeyError, match=r"\(id=7\).*order_by="):
        _write(sink, [_batch(id=[1, 7, 2, 7], name=["a", "x", "b", "y"])])
    assert _rows(pg_dsn, "SELECT id, name FROM t") == [(7, "before")]
    assert job_prepared(pg_dsn, JOB) == []


def test_equal_rows_of_one_key_are_one_row(pg_dsn: str) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, name text, x float8)")
    sink = PostgresSink(pg_dsn, "t", key=["id"])
    nan = float("nan")
    _write(sink, [_batch(id=[1, 2, 1, 2], name=["a", None, "a", None], x=[nan, 1.0, nan, 1.0])])
    assert _rows(pg_dsn, "SELECT id, name, x::text FROM t ORDER BY id") == [
        (1, "a", "NaN"),
        (2, None, "1"),
    ]


def test_order_by_the_greatest_value_wins(pg_dsn: str) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, v bigint, name text)")
    _table(pg_dsn, "INSERT INTO t VALUES (1, 100, 'older batch')")
    sink = PostgresSink(pg_dsn, "t", key=["id"], order_by="v")
    _write(
        sink,
        [
            _batch(id=[1, 2, 1], v=[5, 1, 9], name=["a5", "b1", "a9"]),
            _batch(id=[2, 1, 3], v=[3, 2, 1], name=["b3", "a2", "c1"]),
        ],
    )
    # within the batch the greatest v wins; across batches the later batch wins
    assert _rows(pg_dsn, "SELECT id, v, name FROM t ORDER BY id") == [
        (1, 9, "a9"),
        (2, 3, "b3"),
        (3, 1, "c1"),
    ]


def test_order_by_ties_and_nulls(pg_dsn: str) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, v bigint, name text)")
    sink = PostgresSink(pg_dsn, "t", key=["id"], order_by="v")
    with pytest.raises(DuplicateKeyError, match=r"\(id=4\).*tied at their greatest 'v'"):
        _write(sink, [_batch(id=[4, 4, 4], v=[9, 9, 1], name=["x", "y", "z"])])
    with pytest.raises(NullKeyError, match=r"null in order_by column 'v'"):
        _write(sink, [_batch(id=[4, 5], v=[1, None], name=["x", "y"])], batch_id=1)
    assert _rows(pg_dsn, "SELECT count(*) FROM t") == [(0,)]
    # a tie below the greatest value, or between equal rows, decides nothing
    _write(sink, [_batch(id=[4, 4, 4, 5, 5], v=[1, 1, 2, 3, 3], name=["x", "y", "z", "w", "w"])], 2)
    assert _rows(pg_dsn, "SELECT id, v, name FROM t ORDER BY id") == [(4, 2, "z"), (5, 3, "w")]
    assert job_prepared(pg_dsn, JOB) == []


def test_order_by_configuration_is_checked() -> None:
    dsn = "host=127.0.0.1 dbname=x"
    with pytest.raises(ConfigError, match="needs key"):
        PostgresSink(dsn, "t", order_by="v")
    with pytest.raises(ConfigError, match="is a key column"):
        PostgresSink(dsn, "t", key=["id"], order_by="id")


def test_order_by_must_be_a_column(pg_dsn: str) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, v bigint)")
    with pytest.raises(PreflightError, match="order_by column 'w'"):
        PostgresSink(pg_dsn, "t", key=["id"], order_by="w").preflight(
            pa.schema([("id", pa.int64()), ("v", pa.int64())])
        )


def test_upsert_leaves_identity_serial_and_default_columns_to_the_table(pg_dsn: str) -> None:
    _table(
        pg_dsn,
        "CREATE TABLE t (row_id bigint GENERATED ALWAYS AS IDENTITY, seq serial NOT NULL,"
        " id bigint PRIMARY KEY, name text NOT NULL,"
        " created timestamptz NOT NULL DEFAULT now(), amount numeric(10, 2))",
    )
    sink = PostgresSink(pg_dsn, "t", key=["id"])

    def amounts(*a: str | None) -> pa.Array:
        return pa.array([None if x is None else Decimal(x) for x in a], pa.decimal128(10, 2))

    _write(sink, [_batch(id=[1, 2], name=["a", "b"], amount=amounts("1.5", "2.25"))])
    _write(sink, [_batch(id=[2, 3], name=["b2", "c"], amount=amounts("3.1", None))], batch_id=1)
    rows = _rows(pg_dsn, "SELECT row_id, seq, id, name, amount::text FROM t ORDER BY id")
    # the staging table keeps the target's type modifiers: numeric(10, 2)
    assert [r[2:] for r in rows] == [(1, "a", "1.50"), (2, "b2", "3.10"), (3, "c", None)]
    assert [r[0] for r in rows][:2] == [1, 2] and rows[2][0] > 2  # identities kept, new one drawn
    assert _rows(pg_dsn, "SELECT count(*) FROM t WHERE created IS NULL") == [(0,)]


def test_dotted_column_names_as_keys_and_order(pg_dsn: str) -> None:
    _table(pg_dsn, 'CREATE TABLE t ("order.id" bigint PRIMARY KEY, "v.x" int, "a b" text)')
    sink = PostgresSink(pg_dsn, "t", key=["order.id"], order_by="v.x")
    b = pa.RecordBatch.from_pydict(
        {"order.id": [1, 1, 2], "v.x": [1, 2, 1], "a b": ["x", "y", "z"]}
    )
    _write(sink, [b])
    assert _rows(pg_dsn, 'SELECT * FROM t ORDER BY "order.id"') == [(1, 2, "y"), (2, 1, "z")]


# -- through Spark ------------------------------------------------------------------------


def test_null_keys_fail_the_job_with_the_column_named(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """The reported case: 40 rows, 8 with a null key, a unique index on the
    nullable key column. Before, 33 rows landed and the job exited 0."""
    _table(pg_dsn, "CREATE TABLE orders (id bigint UNIQUE, name text, amount float8)")
    rows = [{"id": None if i % 5 == 0 else i, "name": f"n{i}", "amount": 1.0} for i in range(40)]
    _json_rows(tmp_path / "in", rows)
    sink = PostgresSink(pg_dsn, "orders", key=["id"])
    job = Job(spark, "nullkeys", tmp_path / "state", checkpoint_interval=0)
    df = spark.readStream.schema(INPUT_SCHEMA).json(str(tmp_path / "in"))
    job.add_pipeline("load", df, [sink], bounded=True)
    with pytest.raises(TaskFailedError) as e:
        job.run()
    first = str(e.value).splitlines()[0]
    assert "null in key column 'id'" in first and "NullKeyError" not in first.split(":")[0]
    assert _rows(pg_dsn, "SELECT count(*) FROM orders") == [(0,)]
    assert job_prepared(pg_dsn, "nullkeys") == []


def test_dotted_names_through_spark(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """A key column and an event-time column with dots in their names: Spark
    would read ``order.id`` as a field of a struct ``order``."""
    _table(pg_dsn, 'CREATE TABLE orders ("order.id" bigint PRIMARY KEY, "at.time" timestamptz)')
    rows = [{"order.id": i % 30, "at.time": f"2024-01-01T00:{i % 60:02d}:00Z"} for i in range(30)]
    _json_rows(tmp_path / "in", rows)
    df = spark.readStream.schema("`order.id` long, `at.time` timestamp").json(str(tmp_path / "in"))
    job = Job(spark, "dots", tmp_path / "state", checkpoint_interval=0)
    sink = PostgresSink(pg_dsn, "orders", key=["order.id"])
    job.add_pipeline("load", df, [sink], bounded=True, event_time="at.time", transform=lambda d: d)
    job.run()
    assert _rows(pg_dsn, 'SELECT count(*), count(DISTINCT "order.id") FROM orders') == [(30, 30)]
    assert job_prepared(pg_dsn, "dots") == []
