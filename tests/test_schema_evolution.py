"""Schemas that evolve: new DataFrame columns added to the target, once, at job
start (PostgreSQL ``add_columns=True``), never blocking the table's readers."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from lifecycle import Job
from sinks import PostgresSink, PreflightError
from sinks.base import JobScope, WriteContext
from sinks.postgres import catalog
from tests import deltacheck
from tests.pgcheck import job_prepared


def _sql(dsn: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        cur = c.execute(query)
        return cur.fetchall() if cur.description else []


def _columns(dsn: str) -> list[str]:
    return [
        r[0]
        for r in _sql(
            dsn,
            "SELECT column_name FROM information_schema.columns WHERE table_name = 't'"
            " ORDER BY ordinal_position",
        )
    ]


WIDER = pa.schema([("id", pa.int64()), ("name", pa.string()), ("score", pa.float64())])


def test_without_add_columns_a_new_column_fails_preflight(pg_dsn: str) -> None:
    _sql(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, name text)")
    with pytest.raises(PreflightError, match="column 'score' is missing"):
        PostgresSink(pg_dsn, "t").preflight(WIDER)


def test_add_columns_adds_them_after_preflight_and_before_any_write(pg_dsn: str) -> None:
    _sql(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, name text NOT NULL)")
    sink = PostgresSink(pg_dsn, "t", key=["id"], add_columns=True)
    sink.preflight(WIDER)
    assert _columns(pg_dsn) == ["id", "name"]  # preflight changes nothing
    scope = JobScope("evolve", "p", sink.sink_id, "0123456789ab")
    with pytest.raises(RuntimeError, match="evolve_schema"):
        sink.open_writer(WriteContext(scope, 1, 0, 0, 0), WIDER)
    sink.evolve_schema(WIDER)
    sink.evolve_schema(WIDER)  # a second time: nothing to add
    cols = _sql(
        pg_dsn,
        "SELECT column_name, data_type, is_nullable FROM information_schema.columns"
        " WHERE table_name = 't' ORDER BY ordinal_position",
    )
    assert cols == [
        ("id", "bigint", "NO"),
        ("name", "text", "NO"),
        ("score", "double precision", "YES"),
    ]
    sink.committer().claim(scope)
    w = sink.open_writer(WriteContext(scope, 1, 0, 0, 0), WIDER)
    w.write(pa.RecordBatch.from_pydict({"id": [1], "name": ["a"], "score": [0.5]}, schema=WIDER))
    c = w.prepare()
    w.close()
    sink.committer().commit([c])
    assert _sql(pg_dsn, "SELECT * FROM t") == [(1, "a", 0.5)]


def test_a_busy_table_refuses_the_start_without_blocking_its_readers(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepared transaction of someone else holds the table: the ALTER gives
    up after its tries, and a reader that comes meanwhile is not queued behind
    it for longer than one try's half second."""
    monkeypatch.setattr(catalog, "_ALTER_ATTEMPTS", 3)
    _sql(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, name text)")
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        other.execute("BEGIN")
        other.execute("INSERT INTO t VALUES (1, 'held')")
        other.execute("PREPARE TRANSACTION 'someone-else'")
    try:
        sink = PostgresSink(pg_dsn, "t", add_columns=True)
        sink.preflight(WIDER)
        reads: list[float] = []

        def read() -> None:
            time.sleep(0.2)
            for _ in range(10):
                started = time.monotonic()
                _sql(pg_dsn, "SELECT count(*) FROM t")
                reads.append(time.monotonic() - started)
                time.sleep(0.1)

        reader = threading.Thread(target=read)
        reader.start()
        with pytest.raises(PreflightError, match=r"could not add the columns 'score'.*3 tries"):
            sink.evolve_schema(WIDER)
        reader.join()
        assert max(reads) < 0.9, reads
    finally:
        _sql(pg_dsn, "ROLLBACK PREPARED 'someone-else'")
    assert [
        r[0]
        for r in _sql(
            pg_dsn, "SELECT column_name FROM information_schema.columns WHERE table_name = 't'"
        )
    ] == ["id", "name"]


def test_a_job_adds_the_columns_at_start(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    _sql(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY)")
    (tmp_path / "in").mkdir()
    rows = [{"id": i, "name": f"n{i}", "score": i / 2} for i in range(20)]
    (tmp_path / "in" / "part-0.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = spark.readStream.schema("id long, name string, score double").json(str(tmp_path / "in"))
    job = Job(spark, "evolve", tmp_path / "state", checkpoint_interval=0)
    job.add_pipeline(
        "load", df, [PostgresSink(pg_dsn, "t", key=["id"], add_columns=True)], bounded=True
    )
    job.run()
    assert _sql(pg_dsn, "SELECT count(*), count(name), sum(score) FROM t") == [(20, 20, 95.0)]
    assert job_prepared(pg_dsn, "evolve") == []


# -- Delta (schema_mode="merge") ----------------------------------------------------------


def test_delta_schema_merge_adds_columns_in_a_version_of_their_own(spark, tmp_path):  # type: ignore[no-untyped-def]
    from deltalake import DeltaTable, write_deltalake

    from sinks import DeltaSink

    uri = tmp_path / "t"
    write_deltalake(str(uri), pa.table({"id": pa.array([1, 2], pa.int64())}))
    with pytest.raises(PreflightError, match="not in the table: \\['name', 'score'\\]"):
        DeltaSink(uri).preflight(WIDER)
    (tmp_path / "in").mkdir()
    rows = [{"id": i, "name": f"n{i}", "score": i / 2} for i in range(3, 23)]
    (tmp_path / "in" / "part-0.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = spark.readStream.schema("id long, name string, score double").json(str(tmp_path / "in"))
    job = Job(spark, "evolve", tmp_path / "state", checkpoint_interval=0)
    job.add_pipeline("load", df, [DeltaSink(uri, schema_mode="merge")], bounded=True)
    job.run()
    dt = DeltaTable(str(uri))
    fields = {f.name: f.nullable for f in dt.schema().fields}
    assert fields == {"id": True, "name": True, "score": True}
    history = sorted(dt.history(), key=lambda h: h["version"])
    ops = [h["operation"] for h in history]
    assert "ADD COLUMN" in ops and ops.index("ADD COLUMN") < len(ops) - 1  # before the data
    got = dt.to_pyarrow_table().to_pylist()
    assert len(got) == 22 and sum(1 for r in got if r["name"] is None) == 2
    # delta-spark reads each version in its own schema, and a stream from the start
    # reads the rows written before the new columns with nulls in them
    deltacheck.assert_delta_spark_reads_every_version(spark, uri)
    seen = deltacheck.assert_streaming_read_sees_each_row_once(spark, uri, tmp_path / "read")
    assert len(seen) == 22


def test_delta_schema_merge_refuses_a_type_change(tmp_path):  # type: ignore[no-untyped-def]
    from deltalake import write_deltalake

    from sinks import DeltaSink

    uri = tmp_path / "t"
    write_deltalake(str(uri), pa.table({"id": pa.array([1], pa.int64()), "name": ["a"]}))
    changed = pa.schema([("id", pa.int64()), ("name", pa.int64()), ("extra", pa.string())])
    with pytest.raises(
        PreflightError,
        match=r"column 'name' is long in the DataFrame but string"
        r".*never changes a column's type: cast 'name' to string",
    ):
        DeltaSink(uri, schema_mode="merge").preflight(changed)
