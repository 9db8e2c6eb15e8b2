"""End to end through real Spark into real Delta tables on local disk (in-process driver).

Tables are read back with deltalake, their commits from ``_delta_log`` and their
data files by listing the directory (``tests/deltacheck.py``), and once more
through Spark's own Parquet reader: delta-spark's jars are not available here,
so Spark reads the files the snapshot lists, with partition discovery from the
Hive-style directories, which proves the files and directories are what Spark
expects.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet
import pytest
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import functions as F

from lifecycle import Job, PipelineState
from lifecycle.job_sinks import sink_label
from lifecycle.ledger import read_ledger
from sinks import DeltaSink, PreflightError, _faults
from sinks.base import JobScope
from sinks.delta import progress
from sinks.delta import table as delta_table
from sinks.delta.committer import app_id
from tests import deltacheck
from tests.conftest import write_input
from tests.sparkutil import INPUT_SCHEMA

# Partition values with a space, characters Spark escapes in directory names, and null.
KINDS = ["a", "b c", "x:/y", None]
KIND = "CASE id % 4 WHEN 0 THEN 'a' WHEN 1 THEN 'b c' WHEN 2 THEN 'x:/y' END"


def _stream(spark, path: Path, files_per_batch: int = 1):  # type: ignore[no-untyped-def]
    """The input files as a bounded stream of {id, name, amount, kind}."""
    return (
        spark.readStream.schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", files_per_batch)
        .json(str(path))
        .withColumn("kind", F.expr(KIND))
    )


def _expected(ids: range) -> list[tuple[object, ...]]:
    rows = [(i, f"name-{i}", i * 0.5, KINDS[i % 4]) for i in ids]
    return sorted(rows, key=lambda r: r[0])


@pytest.mark.parametrize("interval", [0.0, 4.0])
def test_bounded_job_exactly_once_one_version_per_checkpoint(spark, tmp_path, interval):  # type: ignore[no-untyped-def]
    n = write_input(tmp_path / "in", files=5, rows_per_file=200)
    uri = str(tmp_path / "orders")
    sink = DeltaSink(uri, partition_by=["kind"], sink_id="orders")
    job = Job(spark, "de2e", tmp_path / "state", checkpoint_interval=interval)
    job.add_pipeline("load", _stream(spark, tmp_path / "in"), [sink], bounded=True)
    result = job.run()

    assert result.pipelines == {"load": PipelineState.FINISHED}
    assert result.committed and result.final_checkpoint is not None
    label = sink_label("load", "orders")
    assert result.rows_committed == {label: n}
    rows = deltacheck.assert_exactly_once(uri, n)
    assert deltacheck.delta_rows(uri) == _expected(range(n))  # partition values round-trip
    assert rows.num_rows == n

    # one Delta version per checkpoint that committed rows, carrying txn(app, cut)
    ledger = read_ledger(tmp_path / "state")
    assert ledger is not None and ledger["pending"] == {} and ledger["decided"] is None
    app = app_id(JobScope("de2e", "load", "orders", ledger["incarnation"]))
    vs = deltacheck.assert_created_once(uri)
    assert vs[0].operation == "CREATE TABLE"  # created by the sink's preflight
    # version 1: the claim (only the owner's app transaction, no data)
    assert vs[1].files == [] and vs[1].app_txns == {
        "tp2.de2e.load.orders.owner": int(ledger["incarnation"], 16)
    }
    ours = deltacheck.assert_one_version_per_checkpoint(uri, ledger, "load", label, app)
    assert [v.version for v in ours] == list(range(2, len(vs)))  # nothing else wrote
    assert DeltaTable(uri).transaction_version(app) == 4  # the last of 5 batches
    assert set().union(*(v.batches() for v in ours)) == set(range(5))
    if interval == 0:
        assert len(ours) == 5  # every batch its own checkpoint
    deltacheck.assert_nothing_staged(uri)
    assert {p.split("/")[0] for p in deltacheck.snapshot_files(uri)} == {
        "kind=a",
        "kind=b c",
        "kind=x%3A%2Fy",
        "kind=__HIVE_DEFAULT_PARTITION__",
    }

    # Spark reads the files the snapshot lists: the same rows
    assert deltacheck.spark_rows(spark, uri) == _expected(range(n))
    if interval == 0:
        # delta-spark: every version as deltalake reads it, the history naming each
        # checkpoint's commit, and a streaming read seeing every row once
        history = deltacheck.assert_delta_spark_reads_every_version(spark, uri)
        recorded = [progress.parse_user_metadata(h["userMetadata"]) for h in history]
        batches = sorted(r[1] for r in recorded if r is not None and r[0] == app)
        assert batches == list(range(5)) and {
            h["operation"] for h in history if h["userMetadata"]
        } == {"WRITE"}
        seen = deltacheck.assert_streaming_read_sees_each_row_once(spark, uri, tmp_path / "read")
        assert len(seen) == n


def test_nothing_visible_before_checkpoint_completes(spark, tmp_path):  # type: ignore[no-untyped-def]
    """Hold the checkpoint's commit back and look at the table meanwhile
    (invariant 1): no new version, no rows, only staged files and markers.
    With a long interval the bounded job's 3 batches all go into its final
    checkpoint: exactly one Delta version holds them."""
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    uri = str(tmp_path / "orders")
    seen: dict[str, int] = {}

    def before_commit() -> None:
        dt = DeltaTable(uri)
        seen["version"] = dt.version()
        seen["rows"] = dt.to_pyarrow_table(columns=["id"]).num_rows
        seen["markers"] = len(deltacheck.markers(uri))
        seen["staged"] = len(deltacheck.data_files(uri) - deltacheck.snapshot_files(uri))
        seen["spark"] = len(deltacheck.spark_rows(spark, uri))

    _faults.register("driver.before_commit", before_commit)
    try:
        job = Job(spark, "dvis", tmp_path / "state", checkpoint_interval=60)
        job.add_pipeline(
            "load",
            _stream(spark, tmp_path / "in"),
            [DeltaSink(uri, partition_by=["kind"], sink_id="orders")],
            bounded=True,
        )
        result = job.run()
    finally:
        _faults.clear()
    assert seen, "the commit was never reached"
    # version 0 created the table, version 1 is the job's claim (no data)
    assert seen["version"] == 1 and seen["rows"] == 0 and seen["spark"] == 0, seen
    # 3 batches x 1 task x 4 partition values, all staged and invisible
    assert seen["markers"] == seen["staged"] == 12, seen

    assert result.committed and len(result.checkpoint_ids) == 1
    deltacheck.assert_exactly_once(uri, n)
    vs = deltacheck.assert_created_once(uri)
    assert len(vs) == 3 and vs[2].batches() == {0, 1, 2} and vs[2].batch == 2
    deltacheck.assert_nothing_staged(uri)


def test_preflight_errors_leave_the_table_unchanged(spark, tmp_path):  # type: ignore[no-untyped-def]
    """A schema that does not fit, or partition columns other than the table's,
    fail Job.run with a PreflightError naming the problem before any data moves;
    the table (and its earlier rows) stay as they were, and a correct job then
    appends to it."""
    uri = str(tmp_path / "orders")
    old = pa.table(
        {
            "id": pa.array(range(1000, 1010), pa.int64()),
            "name": [f"old-{i}" for i in range(10)],
            "amount": pa.array([1.0] * 10),
            "kind": ["a"] * 10,
        }
    )
    write_deltalake(uri, old, partition_by=["kind"])
    n = write_input(tmp_path / "in", files=2, rows_per_file=50)
    state = tmp_path / "state"

    def listing() -> dict[str, int]:
        root = Path(uri)
        return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}

    before = listing()
    stream = _stream(spark, tmp_path / "in")
    cases = [
        (
            stream,
            DeltaSink(uri, partition_by=["name"]),
            r"partitioned by \['kind'\], but DeltaSink was given partition_by=\['name'\]",
        ),
        (stream, DeltaSink(uri, partition_by=[]), r"partitioned by \['kind'\]"),
        (
            stream,
            DeltaSink(uri, partition_by=["nope"]),
            r"partition column\(s\) \['nope'\] are not columns of the DataFrame",
        ),
        (
            stream.withColumn("amount", F.col("amount").cast("string")),
            DeltaSink(uri),
            "column 'amount' is string in the DataFrame but double in the Delta table",
        ),
        (
            stream.drop("kind"),
            DeltaSink(uri, partition_by=["kind"]),
            r"partition column\(s\) \['kind'\] are not columns",
        ),
        (stream.drop("kind"), DeltaSink(uri), r"missing from the DataFrame: \['kind'\]"),
        (
            stream.withColumnRenamed("name", "Name"),
            DeltaSink(uri),
            "'Name' vs the table's 'name'",
        ),
    ]
    for df, sink, message in cases:
        job = Job(spark, "dpre", state, checkpoint_interval=0)
        job.add_pipeline("load", df, [sink], bounded=True)
        with pytest.raises(PreflightError, match=message) as e:
            job.run()
        assert uri in str(e.value)  # the message names the table
        assert listing() == before, f"{message}: the table directory changed"
        assert not (state / "pipelines" / "load" / "spark").exists()  # no query started
    doc = read_ledger(state)
    assert doc is not None and doc["pending"] == {} and doc["history"] == []

    job = Job(spark, "dpre", state, checkpoint_interval=0)
    job.add_pipeline("load", stream, [DeltaSink(uri)], bounded=True)
    assert job.run().committed
    ids = deltacheck.read_rows(uri, ["id"]).column("id").to_pylist()
    assert ids == [*range(n), *range(1000, 1010)]
    deltacheck.assert_created_once(uri)
    deltacheck.assert_nothing_staged(uri)


def test_jobs_racing_to_create_the_table(spark, tmp_path, monkeypatch, caplog):  # type: ignore[no-untyped-def]
    """Two jobs start at the same moment on a table that does not exist yet, and
    both try to create it (a barrier holds each creator until both have found
    no table, so the race happens every time): one creates it (version 0, the
    only CREATE), the other finds it created and uses it; both jobs' rows are
    in it exactly once."""
    uri = str(tmp_path / "orders")
    starts = {"race-a": 0, "race-b": 1000}
    counts = {
        j: write_input(tmp_path / j, files=2, rows_per_file=100, start=s) for j, s in starts.items()
    }
    barrier = threading.Barrier(len(starts))
    create = delta_table.create

    def racing_create(*args, **kwargs):  # type: ignore[no-untyped-def]
        barrier.wait(timeout=60)  # both saw no table: now both create it
        return create(*args, **kwargs)

    monkeypatch.setattr(delta_table, "create", racing_create)
    caplog.set_level(logging.INFO, logger="sinks.delta")
    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            job = Job(spark, name, tmp_path / f"state-{name}", checkpoint_interval=0)
            job.add_pipeline(
                "load",
                _stream(spark, tmp_path / name),
                [DeltaSink(uri, partition_by=["kind"], sink_id="orders")],
                bounded=True,
            )
            results[name] = job.run(handle_signals=False)
        except BaseException as e:  # reported below
            results[name] = e

    threads = [threading.Thread(target=run, args=(j,)) for j in starts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for name, r in results.items():
        assert not isinstance(r, BaseException), f"{name}: {r!r}"
        assert r.committed, name  # type: ignore[attr-defined]
    assert len(results) == 2
    lost = [r for r in caplog.records if "was created concurrently by another writer" in r.message]
    assert len(lost) == 1, "exactly one of the two creators must have lost the race"

    vs = deltacheck.assert_created_once(uri)
    assert [v.version for v in vs if v.operation == "CREATE TABLE"] == [0]
    expected = [*range(counts["race-a"]), *range(1000, 1000 + counts["race-b"])]
    assert deltacheck.read_rows(uri, ["id"]).column("id").to_pylist() == expected
    dt = DeltaTable(uri)
    assert dt.metadata().partition_columns == ["kind"]
    assert [f.name for f in dt.schema().fields] == ["id", "name", "amount", "kind"]
    for name in starts:
        ledger = read_ledger(tmp_path / f"state-{name}")
        assert ledger is not None
        app = app_id(JobScope(name, "load", "orders", ledger["incarnation"]))
        assert dt.transaction_version(app) == 1  # 2 batches each
        deltacheck.assert_one_version_per_checkpoint(
            uri, ledger, "load", sink_label("load", "orders"), app
        )
    deltacheck.assert_nothing_staged(uri)
    assert deltacheck.spark_rows(spark, uri) == _expected(range(200)) + _expected(range(1000, 1200))


def test_a_long_history_with_checkpoints_and_log_cleanup_reads_alike(spark, tmp_path):  # type: ignore[no-untyped-def]
    """A table delta-spark made with a Delta checkpoint every 3 versions and
    its log (and removed files) kept one second: two runs of the sink (a delta-spark INSERT
    between them) write checkpoints, and log cleanup deletes the commits
    they cover. delta-spark reads every version its history still has as
    deltalake does, the latest from a checkpoint; the checkpoint carries the
    sink's app transactions (what a restart reads to skip committed batches),
    for deltalake and delta-spark alike."""
    from lifecycle.testing import jars

    jars.require("delta")
    uri = tmp_path / "t"
    spark.sql(
        f"CREATE TABLE delta.`{uri}` (id BIGINT, name STRING, amount DOUBLE, kind STRING) "
        "USING delta PARTITIONED BY (kind) TBLPROPERTIES (delta.checkpointInterval = 3, "
        "delta.logRetentionDuration = 'interval 1 seconds', "
        "delta.deletedFileRetentionDuration = 'interval 1 seconds')"
    )

    def run(name: str, start: int) -> None:
        write_input(tmp_path / name, files=6, rows_per_file=20, start=start)
        job = Job(spark, name, tmp_path / f"state-{name}", checkpoint_interval=0)
        job.add_pipeline("load", _stream(spark, tmp_path / name), [DeltaSink(uri)], bounded=True)
        job.run()

    run("first", 0)
    time.sleep(1.2)  # the first commits expire
    spark.sql(f"INSERT INTO delta.`{uri}` VALUES (1000, 'x', 1.0, 'a')")
    run("second", 120)
    log_dir = uri / "_delta_log"
    assert not (log_dir / f"{0:020d}.json").exists(), "log cleanup deleted no commit"
    checkpoints = sorted(log_dir.glob("*.checkpoint.parquet"))
    assert checkpoints, "no Delta checkpoint was written"
    ids = sorted(deltacheck.read_rows(uri).column("id").to_pylist())
    assert ids == [*range(240), 1000]
    # delta-spark refuses time travel past the deleted-file retention: back to its default
    spark.sql(
        f"ALTER TABLE delta.`{uri}` SET TBLPROPERTIES "
        "(delta.deletedFileRetentionDuration = 'interval 7 days', "
        "delta.logRetentionDuration = 'interval 30 days')"
    )
    deltacheck.assert_delta_spark_reads_every_version(spark, uri)
    jvm = spark._jvm.org.apache.spark.sql.delta.DeltaLog
    fresh = jvm.forTable(spark._jsparkSession, f"file://{uri}").startTransaction()
    txns = pa.parquet.read_table(checkpoints[-1], columns=["txn"]).column("txn").to_pylist()
    for name in ("first", "second"):
        ledger = read_ledger(tmp_path / f"state-{name}")
        assert ledger is not None
        app = app_id(JobScope(name, "load", DeltaSink(uri).sink_id, ledger["incarnation"]))
        assert DeltaTable(str(uri)).transaction_version(app) == 5
        assert int(fresh.txnVersion(app)) == 5
        assert app in {t["appId"] for t in txns if t}, "a checkpoint lost a sink's app version"
