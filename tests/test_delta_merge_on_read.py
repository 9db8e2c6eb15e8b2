"""Keyed merges on read: on a table with deletion vectors, a keyed sink marks
the changed rows deleted in the files that hold them (``sinks/delta/spark_dv.py``)
and writes only the changed rows; delta-spark reads the result.

The crash test kills the real driver between the vector write and the
commit; the restart's sweep deletes what the killed attempt staged (found by
its markers) and the job writes everything exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from lifecycle.testing import jars, verify
from sinks import DeltaSink, _faults
from sinks.delta import roaring
from sinks.delta.storage import STAGING_DIR
from tests import deltacheck, tiers
from tests.procs import run_job
from tests.test_delta_merge import write_batches
from tests.test_delta_s3_merge import expected
from tests.test_delta_s3_merge import write_batches as write_inputs

PROPS = (
    "delta.enableDeletionVectors = true, delta.enableChangeDataFeed = true, "
    "delta.enableRowTracking = true"
)


@pytest.fixture
def interpreted(spark):  # type: ignore[no-untyped-def]
    """The session without code generation (delta-spark's DML on a few rows
    spends most of its time compiling generated code)."""
    jars.require("delta")
    key = "spark.sql.codegen.factoryMode"
    before = spark.conf.get(key, "FALLBACK")
    spark.conf.set(key, "NO_CODEGEN")
    yield spark
    spark.conf.set(key, before)


def _log(uri: Path, version: int) -> list[dict[str, Any]]:
    lines = (uri / "_delta_log" / f"{version:020d}.json").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def _rows(spark, uri: Path, columns: str = "id, w") -> list[tuple[Any, ...]]:  # type: ignore[no-untyped-def]
    df = spark.read.format("delta").load(str(uri))
    return sorted(tuple(r) for r in df.selectExpr(*columns.split(", ")).collect())


def _feed(spark, uri: Path, since: int) -> list[tuple[Any, ...]]:  # type: ignore[no-untyped-def]
    df = (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", since)
        .load(str(uri))
    )
    return sorted(
        tuple(r) for r in df.select("id", "_change_type", "_commit_version", "w").collect()
    )


def test_roaring_serialization_reads_back_in_delta_spark(interpreted):  # type: ignore[no-untyped-def]
    """The vector bytes of sparse, dense (a bitset container) and 64-bit row
    indexes parse with delta-spark's own reader to exactly the same set."""
    jvm = interpreted._jvm
    cases = [[0], [3, 1, 3, 2], list(range(0, 70000, 7)), list(range(5000)), [2**32 + 5, 9, 2**33]]
    for rows in cases:
        bitmap = jvm.org.apache.spark.sql.delta.deletionvectors.RoaringBitmapArray.readFrom(
            roaring.serialize(rows)
        )
        assert list(bitmap.toArray()) == sorted(set(rows))
    with pytest.raises(ValueError):
        roaring.serialize([-1])


def test_a_keyed_merge_on_a_table_with_deletion_vectors_marks_rows_deleted(interpreted, tmp_path):  # type: ignore[no-untyped-def]
    """Two files delta-spark wrote (ids 0-9, 10-19), id 5 deleted by its own
    vector: two merges mark the changed rows in vectors (the old vector's row
    stays deleted), add each touched file again at its own path with its row
    ids, write only the changed rows, and rewrite no unchanged row. delta-spark
    reads the expected rows, its change feed shows each change once (no
    preimage of the row deleted before), untouched rows keep their row ids and
    versions, updated ones their ids; nothing staged is left."""
    spark = interpreted
    uri = tmp_path / "t"
    t = f"delta.`{uri}`"
    spark.sql(f"CREATE TABLE {t} (id BIGINT, w BIGINT) USING delta TBLPROPERTIES ({PROPS})")
    spark.sql(f"INSERT INTO {t} SELECT /*+ COALESCE(1) */ id, id FROM range(10)")
    spark.sql(f"INSERT INTO {t} SELECT /*+ COALESCE(1) */ id, id FROM range(10, 20)")
    spark.sql(f"DELETE FROM {t} WHERE id = 5")
    ids_before = {
        r[0]: (r[1], r[2])
        for r in _rows(spark, uri, "id, _metadata.row_id, _metadata.row_commit_version")
    }
    first = DeltaTable(str(uri)).version() + 2  # after the claim
    batches = [
        [
            {"id": 1, "w": 100, "op": "U"},
            {"id": 3, "op": "D"},
            {"id": 5, "op": "D"},  # deleted by delta-spark already: no change
            {"id": 30, "w": 30, "op": "U"},
        ],
        [{"id": 1, "w": 101, "op": "U"}, {"id": 12, "op": "D"}],
    ]
    sink = DeltaSink(uri, key=["id"], delete_when=("op", "D"))
    assert write_batches(
        spark, tmp_path, sink, batches, "id long, w long, op string", "k"
    ).committed
    m1, m2 = first, first + 1
    assert DeltaTable(str(uri)).version() == m2
    model = {i: i for i in range(20) if i not in (3, 5, 12)} | {1: 101, 30: 30}
    assert _rows(spark, uri) == sorted(model.items())
    for v, cards, rows_written in ((m1, [3], 2), (m2, [1, 1], 1)):
        before = {a["add"]["path"] for x in range(v) for a in _log(uri, x) if "add" in a}
        actions = _log(uri, v)
        readded = [a["add"] for a in actions if "add" in a and a["add"]["path"] in before]
        removed = [a["remove"] for a in actions if "remove" in a]
        new = [a["add"] for a in actions if "add" in a and a["add"]["path"] not in before]
        assert {a["path"] for a in removed} == {a["path"] for a in readded}, actions
        assert all(a["dataChange"] and a.get("baseRowId") is not None for a in readded)
        # the vectors: m1 adds ids 1 and 3 to id 5's; m2 marks 1 (in m1's file) and 12
        assert sorted(a["deletionVector"]["cardinality"] for a in readded) == cards, actions
        # only the changed rows are written: no unchanged row is copied
        assert sum(json.loads(a["stats"])["numRecords"] for a in new) == rows_written
    assert _feed(spark, uri, m1) == sorted(
        [
            (1, "update_preimage", m1, 1),
            (1, "update_postimage", m1, 100),
            (3, "delete", m1, 3),
            (30, "insert", m1, 30),
            (1, "update_preimage", m2, 100),
            (1, "update_postimage", m2, 101),
            (12, "delete", m2, 12),
        ]
    )
    after = {
        r[0]: (r[1], r[2])
        for r in _rows(spark, uri, "id, _metadata.row_id, _metadata.row_commit_version")
    }
    assert len({rid for rid, _ in after.values()}) == len(after)
    for i in set(model) - {1, 30}:  # untouched: same id, same version
        assert after[i] == ids_before[i], i
    assert after[1] == (ids_before[1][0], m2)
    assert after[30][0] not in {rid for rid, _ in ids_before.values()}
    assert not list((uri / STAGING_DIR).glob("*"))
    verify.assert_nothing_left_delta(uri)


def test_planned_files_are_found_in_delta_sparks_snapshot_by_stored_path(interpreted, tmp_path):  # type: ignore[no-untyped-def]
    """A merge names the files it planned by their paths as deltalake reads
    them; delta-spark's log stores them URI-encoded. Partition values with a
    space, a plus, a percent sign, a colon and an equals sign are all found, in
    one job over the snapshot, and a path the snapshot lacks is a conflict."""
    from sinks.delta.spark_txn import DeltaSparkConflict, SparkTxn

    spark = interpreted
    uri = tmp_path / "t"
    spark.sql(
        f"CREATE TABLE delta.`{uri}` (id BIGINT, part STRING) USING delta PARTITIONED BY (part) "
        f"TBLPROPERTIES ({PROPS})"
    )
    parts = ["a b", "x+y", "50%", "k=v:w", "plain"]
    rows = ", ".join(f"({i}, '{p}')" for i, p in enumerate(parts))
    spark.sql(f"INSERT INTO delta.`{uri}` VALUES {rows}")
    paths = DeltaTable(str(uri)).file_uris()
    stored = [p.removeprefix(f"{uri}/") for p in paths]
    assert len(stored) == len(parts)
    txn = SparkTxn.open(str(uri), "t")
    found = txn.live_files(stored)
    assert sorted(str(f.partitionValues().get("part").get()) for f in found) == sorted(parts)
    with pytest.raises(DeltaSparkConflict):
        txn.live_files([*stored[:2], "part=gone/x.parquet"])


def test_a_retried_merge_commit_on_read_is_a_no_op(interpreted, tmp_path):  # type: ignore[no-untyped-def]
    """The merge's version lands, then the commit raises (as a post-commit
    hook may): the checkpoint's retry finds the app transaction and commits
    nothing again; each change is in the table and the feed once."""
    spark = interpreted
    uri = tmp_path / "t"
    t = f"delta.`{uri}`"
    spark.sql(f"CREATE TABLE {t} (id BIGINT, w BIGINT) USING delta TBLPROPERTIES ({PROPS})")
    spark.sql(f"INSERT INTO {t} SELECT /*+ COALESCE(1) */ id, id FROM range(10)")
    raised = []

    def after_landing() -> None:
        if not raised:
            raised.append(1)
            raise OSError("the store went away after the version landed")

    _faults.register("driver.merge_landed", after_landing)
    try:
        sink = DeltaSink(uri, key=["id"], delete_when=("op", "D"))
        batch = [{"id": 2, "w": 20, "op": "U"}, {"id": 4, "op": "D"}]
        assert write_batches(
            spark, tmp_path, sink, [batch], "id long, w long, op string", "r"
        ).committed
    finally:
        _faults.clear()
    assert raised
    v = DeltaTable(str(uri)).version()
    merges = [
        x
        for x in range(v + 1)
        if any("add" in a and a["add"].get("deletionVector") for a in _log(uri, x))
    ]
    assert len(merges) == 1
    assert _rows(spark, uri) == sorted(({i: i for i in range(10) if i != 4} | {2: 20}).items())
    assert _feed(spark, uri, merges[0]) == [
        (2, "update_postimage", merges[0], 20),
        (2, "update_preimage", merges[0], 2),
        (4, "delete", merges[0], 4),
    ]
    verify.assert_nothing_left_delta(uri)


@pytest.mark.crash
@tiers.SLOW  # 1.5 min; CI's 50-minute budget: the default run keeps the vectors, feed and retry
def test_a_driver_killed_between_the_vectors_and_the_commit_restarts_exact(interpreted, tmp_path):  # type: ignore[no-untyped-def]
    """A table with deletion vectors, the change data feed and row tracking,
    made by delta-spark; a keyed job (``tests/jobs/delta_store_job.py``, a
    commit per batch) whose driver is SIGKILLed in the last merge once its
    vector file and its changed rows are written, before its version: nothing
    of it is visible, its markers name what it left. The restart sweeps it
    (no vector file, data file or marker of it is left) and commits the merge
    again: delta-spark reads each key's last write once, and the change feed
    holds each change exactly once."""
    uri = tmp_path / "t"
    interpreted.sql(
        f"CREATE TABLE delta.`{uri}` (id BIGINT, name STRING, amount DOUBLE) USING delta "
        f"TBLPROPERTIES ({PROPS})"
    )
    write_inputs(tmp_path / "in")
    args = [
        "--input",
        str(tmp_path / "in"),
        "--state",
        str(tmp_path / "state"),
        "--table",
        str(uri),
    ]
    args += ["--keyed", "--versions", ""]
    killed = run_job(
        "delta_store_job.py",
        [*args, "--no-read-back"],
        tmp_path / "job.log",
        fault="driver.merge_staged@2=kill",
        timeout=400,
    )
    assert killed.proc.returncode == -9, killed.tail()
    markers = list((uri / STAGING_DIR).glob("*"))
    named = {m.read_text() for m in markers}
    vectors = {p.name for p in uri.glob("deletion_vector_*.bin")}
    assert any(n.startswith("deletion_vector_") for n in named) and named & vectors, named
    assert any(n.startswith("part-") for n in named) and all((uri / n).exists() for n in named)
    interpreted._jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()
    seen = _rows(interpreted, uri, "id, name")  # batch 0, maybe batch 1: the last merge not
    assert seen and {n for _, n in seen} <= {"v0", "v1"} and (0, "v0") in seen, seen
    again = run_job(
        "delta_store_job.py", [*args, "--changes-from", "0"], tmp_path / "job.log", timeout=400
    )
    assert again.proc.returncode == 0, again.tail()
    read = json.loads(again.output().rsplit("READ ", 1)[1].splitlines()[0])
    assert read["latest"] == expected()
    assert all(not (uri / n).exists() for n in named), "the killed attempt's files are left"
    referenced = {
        a["add"]["deletionVector"]["pathOrInlineDv"]
        for v in range(DeltaTable(str(uri)).version() + 1)
        for a in _log(uri, v)
        if "add" in a and a["add"].get("deletionVector")
    }
    assert len({p.name for p in uri.glob("deletion_vector_*.bin")}) == len(referenced)
    # each change once (a checkpoint covering batches 1 and 2 merges them as one
    # version), and the feed replayed version by version ends at the table
    assert len({tuple(c) for c in read["changes"]}) == len(read["changes"])
    interpreted._jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()
    deltacheck.assert_change_feed_replays_to_the_table(interpreted, uri)
    assert sum(c[1] == "delete" for c in read["changes"]) == 10
    verify.assert_nothing_left_delta(uri)
    assert not list((uri / STAGING_DIR).glob("*"))
