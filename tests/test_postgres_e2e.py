"""End to end through real Spark and a real PostgreSQL server (in-process driver)."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest

from lifecycle import Job, PipelineState, cli
from lifecycle.ledger import read_ledger
from sinks import PostgresSink, PreflightError, _faults
from tests.conftest import write_input
from tests.pgcheck import assert_exactly_once, job_prepared
from tests.sparkutil import INPUT_SCHEMA


def _stream(spark, path: Path, files_per_batch: int = 1):  # type: ignore[no-untyped-def]
    return (
        spark.readStream.schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", files_per_batch)
        .json(str(path))
    )


def _create(dsn: str, table: str = "orders", key: bool = False) -> None:
    pk = " PRIMARY KEY" if key else ""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE {table} (id bigint{pk}, name text, amount float8)")


@pytest.mark.parametrize("interval", [0.0, 4.0])
def test_bounded_job_commits_every_row_once(spark, pg_dsn, tmp_path, interval):  # type: ignore[no-untyped-def]
    n = write_input(tmp_path / "in", files=4, rows_per_file=250)
    _create(pg_dsn)
    job = Job(spark, "e2e", tmp_path / "state", checkpoint_interval=interval)
    password = "e2e-Secret-3b9d"  # the test server trusts loopback: any password works
    sink = PostgresSink(psycopg.conninfo.make_conninfo(pg_dsn, password=password), "public.orders")
    job.add_pipeline("load", _stream(spark, tmp_path / "in"), [sink], bounded=True)
    result = job.run()
    assert result.pipelines == {"load": PipelineState.FINISHED}
    assert result.final_checkpoint is not None
    assert sum(result.rows_committed.values()) == n
    assert_exactly_once(pg_dsn, "orders", n)
    assert job_prepared(pg_dsn, "e2e") == []
    if interval > 0:
        # 4 batches of one file each, grouped: fewer checkpoints than batches
        assert result.checkpoints < 4
    # the run recorded the sink's settings for `twophase`, without the password
    doc = read_ledger(tmp_path / "state")
    assert doc is not None and doc["sinks"] == {f"load/{sink.sink_id}": sink.settings()}
    ledger_files = [f for f in (tmp_path / "state" / "ledger").iterdir() if f.is_file()]
    assert ledger_files and all(password.encode() not in f.read_bytes() for f in ledger_files)
    assert cli.main(["lingering", str(tmp_path / "state")]) == 0  # nothing lingering


def test_nothing_visible_before_checkpoint_completes(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """Hold the commit back and look at the table meanwhile: invariant 1."""
    n = write_input(tmp_path / "in", files=2, rows_per_file=100)
    _create(pg_dsn)
    seen: dict[str, int] = {}
    release = threading.Event()

    def before_commit() -> None:
        with psycopg.connect(pg_dsn) as c:
            seen["rows"] = c.execute("SELECT count(*) FROM orders").fetchone()[0]
            seen["prepared"] = len(job_prepared(pg_dsn, "vis"))
        release.set()

    _faults.register("driver.before_commit", before_commit)
    try:
        job = Job(spark, "vis", tmp_path / "state", checkpoint_interval=60)
        job.add_pipeline(
            "load",
            _stream(spark, tmp_path / "in", 2),
            [PostgresSink(pg_dsn, "orders")],
            bounded=True,
        )
        job.run()
    finally:
        _faults.clear()
    assert release.is_set()
    assert seen["rows"] == 0 and seen["prepared"] >= 1
    assert_exactly_once(pg_dsn, "orders", n)


def test_upsert_by_key_last_row_wins(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    _create(pg_dsn, key=True)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("INSERT INTO orders VALUES (1, 'old', 0), (500, 'keep', 7)")
    inp = tmp_path / "in"
    inp.mkdir()
    # the same ids twice, in two files of one batch: upsert must not deadlock
    (inp / "a.json").write_text(
        "".join(f'{{"id": {i}, "name": "a{i}", "amount": {i}}}\n' for i in range(200))
    )
    (inp / "b.json").write_text(
        "".join(f'{{"id": {i}, "name": "b{i}", "amount": {i}}}\n' for i in range(100, 300))
    )
    job = Job(spark, "ups", tmp_path / "state", checkpoint_interval=0)
    job.add_pipeline(
        "load", _stream(spark, inp, 1), [PostgresSink(pg_dsn, "orders", key=["id"])], bounded=True
    )
    job.run()
    with psycopg.connect(pg_dsn) as c:
        rows = dict(c.execute("SELECT id, name FROM orders").fetchall())
    assert len(rows) == 301
    assert rows[1] == "a1" and rows[150] in ("a150", "b150") and rows[250] == "b250"
    assert rows[500] == "keep"
    assert job_prepared(pg_dsn, "ups") == []


def test_preflight_errors_name_the_problem(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    df = _stream(spark, tmp_path)
    schema = __import__("pyspark").sql.pandas.types.to_arrow_schema(df.schema)
    with pytest.raises(PreflightError, match=r"does not exist.*create_table=True"):
        PostgresSink(pg_dsn, "public.missing").preflight(schema)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE wrong (id bigint, name int, amount float8, extra text NOT NULL)")
    with pytest.raises(PreflightError) as e:
        PostgresSink(pg_dsn, "wrong").preflight(schema)
    assert "'name'" in str(e.value) and "integer" in str(e.value)
    assert "'extra'" in str(e.value) and "NOT NULL" in str(e.value)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE nokey (id bigint, name text, amount float8)")
    with pytest.raises(PreflightError, match="unique index"):
        PostgresSink(pg_dsn, "nokey", key=["id"]).preflight(schema)
    # a hostile table name is an identifier, not SQL
    evil = 'orders"; drop table wrong; --'
    PostgresSink(pg_dsn, evil, create_table=True).preflight(schema)
    with psycopg.connect(pg_dsn) as c:
        names = {r[0] for r in c.execute("SELECT relname FROM pg_class WHERE relkind='r'")}
    assert evil in names and "wrong" in names
