"""Keyed writes to Delta (``DeltaSink(key=...)``): merges planned by the driver,
run by Spark, committed as one version per checkpoint.

Each table is compared with the dictionary model of its change feed, read by
deltalake and by Spark's own Parquet reader from the snapshot's files; nothing
may be left staged (change files, the merge's staged files, markers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from lifecycle import Job, JobResult, TaskFailedError
from lifecycle.testing import verify
from sinks import DeltaSink, _faults
from tests import deltacheck
from tests.changefeed import SCHEMA as FEED
from tests.changefeed import write_feed


def _rows(uri: Path) -> dict[int, dict[str, Any]]:
    rows = DeltaTable(str(uri)).to_pyarrow_table().to_pylist()
    got = {r["id"]: r for r in rows}
    assert len(got) == len(rows), "a key is in the table more than once"
    return got


def _spark_rows(spark, uri: Path) -> dict[int, dict[str, Any]]:  # type: ignore[no-untyped-def]
    files = DeltaTable(str(uri)).file_uris()
    if not files:
        return {}
    return {r["id"]: r.asDict() for r in spark.read.parquet(*files).collect()}


def _merge_commits(uri: Path) -> list[dict[str, Any]]:
    """The commit infos of the merge versions, oldest first."""
    history = sorted(DeltaTable(str(uri)).history(), key=lambda h: h["version"])
    return [h for h in history if h.get("twophaseMerge")]


def _merges(uri: Path) -> list[dict[str, Any]]:
    """What each merge version did, oldest first."""
    return [json.loads(h["twophaseMerge"]) for h in _merge_commits(uri)]


def _feed_job(spark, tmp_path: Path, sink: DeltaSink, interval: float, name: str = "dm"):  # type: ignore[no-untyped-def]
    df = spark.readStream.schema(FEED).option("maxFilesPerTrigger", 1).json(str(tmp_path / "in"))
    job = Job(spark, name, tmp_path / "state", checkpoint_interval=interval)
    job.add_pipeline("feed", df, [sink], bounded=True)
    return job


def test_a_change_feed_merges_into_delta_equal_to_the_model(spark, tmp_path):  # type: ignore[no-untyped-def]
    model = write_feed(tmp_path / "in", files=5, rows_per_file=80, keys=30, seed=5)
    uri = tmp_path / "t"
    sink = DeltaSink(uri, key=["id"], order_by="seq", delete_when=("op", "D"))
    _feed_job(spark, tmp_path, sink, interval=0).run()
    assert _rows(uri) == model
    assert _spark_rows(spark, uri) == model
    merges = _merges(uri)
    assert 2 <= len(merges) <= 5  # one version per checkpoint (of one or more batches)
    assert merges[0]["filesRemoved"] == 0 and merges[-1]["filesRemoved"] >= 1
    verify.assert_nothing_left_delta(uri)
    assert "op" not in DeltaTable(str(uri)).schema().to_arrow().names
    # delta-spark reads every version alike; a streaming read of the keyed table
    # runs through the merges with skipChangeCommits, which leaves out every version
    # that removes files (docs/sinks/delta.md, "Reading the sink's tables with delta-spark")
    deltacheck.assert_delta_spark_reads_every_version(spark, uri)
    seen = deltacheck.assert_streaming_read_sees_each_row_once(
        spark, uri, tmp_path / "read", skip_change_commits=True
    )
    first = DeltaTable(str(uri), version=int(_merge_commits(uri)[0]["version"]))
    assert len(seen) == first.to_pyarrow_table().num_rows  # the first merge only added


def test_several_batches_merge_as_one_version_the_last_batch_winning(spark, tmp_path):  # type: ignore[no-untyped-def]
    model = write_feed(tmp_path / "in", files=5, rows_per_file=60, keys=12, seed=9)
    uri = tmp_path / "t"
    sink = DeltaSink(uri, key=["id"], order_by="seq", delete_when=("op", "D"))
    result = _feed_job(spark, tmp_path, sink, interval=600).run()
    assert result.committed
    assert _rows(uri) == model
    merges = _merges(uri)
    assert len(merges) == 1 and len(merges[0]["changes"]) >= 5  # every batch's tasks
    verify.assert_nothing_left_delta(uri)


def write_batches(
    spark,
    tmp_path: Path,
    sink: DeltaSink,
    batches: list[list[dict[str, Any]]],
    schema: str,
    name: str,
) -> JobResult:  # type: ignore[no-untyped-def]
    """One job ``name``: a micro-batch per list of ``batches``, in order (each a
    JSON file the file source takes by its modification time), and with
    ``checkpoint_interval=0`` a commit after each."""
    src = tmp_path / f"in-{name}"
    src.mkdir()
    for i, rows in enumerate(batches):
        part = src / f"part-{i}.json"
        part.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.utime(part, (1_700_000_000 + i, 1_700_000_000 + i))
    df = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).json(str(src))
    job = Job(spark, name, tmp_path / f"state-{name}", checkpoint_interval=0)
    job.add_pipeline("p", df, [sink], bounded=True)
    return job.run()


def test_a_partition_in_the_key_prunes_the_rewrite(spark, tmp_path):  # type: ignore[no-untyped-def]
    uri = tmp_path / "t"
    sink = DeltaSink(uri, key=["region", "id"], partition_by=["region"])
    schema = "region string, id long, v long"
    first = [{"region": r, "id": i, "v": 0} for r in "abcd" for i in range(20)]
    second = [{"region": "b", "id": i, "v": 1} for i in range(5)]
    write_batches(spark, tmp_path, sink, [first, second], schema, "prune")
    merges = _merges(uri)
    files_of_b = sum(1 for u in DeltaTable(str(uri)).file_uris() if "region=b" in u)
    assert merges[-1]["filesRemoved"] >= 1
    assert merges[-1]["filesRemoved"] <= files_of_b + 1  # region b's files only
    rows = DeltaTable(str(uri)).to_pyarrow_table().to_pylist()
    assert len(rows) == 80
    assert sorted(r["id"] for r in rows if r["v"] == 1) == [0, 1, 2, 3, 4]
    assert {r["region"] for r in rows if r["v"] == 1} == {"b"}
    verify.assert_nothing_left_delta(uri)


def test_an_empty_partition_key_is_null_and_matched_as_such(spark, tmp_path):  # type: ignore[no-untyped-def]
    """Delta stores "" in a partition column as null (an append of the sink and
    delta-spark alike). A key whose partition column is "" is that null key in
    every path: an upsert replaces the row an append stored (it used to add
    another row each time), a delete removes it (it used to delete nothing),
    and a task holding "" beside other regions prepares (its sort of partition
    tuples failed on None against str, on every attempt)."""
    uri = tmp_path / "t"
    schema = "region string, id long, v long, op string"
    append = DeltaSink(uri, partition_by=["region"])
    first = [{"region": "", "id": 1, "v": 0}]
    write_batches(spark, tmp_path, append, [first], "region string, id long, v long", "a")
    sink = DeltaSink(uri, key=["region", "id"], delete_when=("op", "D"))
    mixed = [{"region": r, "id": i, "v": 1, "op": "I"} for r in ("", "a", "b") for i in range(8)]
    again = [{"region": "", "id": 1, "v": 2, "op": "I"}, {"region": "", "id": 2, "v": 0, "op": "D"}]
    write_batches(spark, tmp_path, sink, [mixed, again], schema, "k")
    want = {(r or None, i): 1 for r in ("", "a", "b") for i in range(8)}
    want[(None, 1)] = 2
    del want[(None, 2)]
    rows = DeltaTable(str(uri)).to_pyarrow_table().to_pylist()
    assert len(rows) == len(want)
    assert {(r["region"], r["id"]): r["v"] for r in rows} == want
    read = spark.read.format("delta").load(str(uri)).collect()  # delta-spark reads it alike
    assert {(r["region"], r["id"]): r["v"] for r in read} == want
    verify.assert_nothing_left_delta(uri)


def test_an_update_moves_a_row_to_another_partition(spark, tmp_path):  # type: ignore[no-untyped-def]
    """Partitioned by a column that is not part of the key: the planner cannot
    prune by partition, and the old row in the other partition goes."""
    uri = tmp_path / "t"
    sink = DeltaSink(uri, key=["id"], partition_by=["status"])
    schema = "id long, status string"
    first = [{"id": i, "status": "open"} for i in range(10)]
    second = [{"id": 3, "status": "closed"}, {"id": 4, "status": "closed"}]
    write_batches(spark, tmp_path, sink, [first, second], schema, "moves")
    rows = DeltaTable(str(uri)).to_pyarrow_table().to_pylist()
    assert sorted((r["id"], r["status"]) for r in rows) == sorted(
        [(i, "open") for i in range(10) if i not in (3, 4)] + [(3, "closed"), (4, "closed")]
    )


@pytest.mark.parametrize("other", ["append", "delete-and-append"])
def test_a_concurrent_writer_makes_the_merge_plan_again(spark, tmp_path, other):  # type: ignore[no-untyped-def]
    """Another writer commits a version between the merge's staging and its
    commit: it appends rows of key 1 (which the merge writes) and key 100, and
    maybe deletes key 5 (rewriting the file the merge rewrites too). Committed on the
    stale plan, the merge would bring key 5 back and leave two rows of key 1;
    the commit fails instead, its staged files are deleted, and the merge is
    planned again on the new version."""
    uri = tmp_path / "t"
    sink = DeltaSink(uri, key=["id"])
    schema = "id long, v long"
    write_batches(spark, tmp_path, sink, [[{"id": i, "v": 0} for i in range(10)]], schema, "a")
    fired = []

    def other_writer() -> None:
        fired.append(True)
        if other == "delete-and-append":
            DeltaTable(str(uri)).delete("id = 5")
        write_deltalake(str(uri), pa.table({"id": [1, 100], "v": [9, 7]}), mode="append")

    _faults.register("driver.merge_staged", other_writer)
    write_batches(spark, tmp_path, sink, [[{"id": 1, "v": 1}, {"id": 2, "v": 1}]], schema, "b")
    assert fired
    got = {r["id"]: r["v"] for r in DeltaTable(str(uri)).to_pyarrow_table().to_pylist()}
    assert len(got) == DeltaTable(str(uri)).count()  # one row per key
    gone = 5 if other == "delete-and-append" else None
    assert got == {**{i: 0 for i in range(10) if i != gone}, 1: 1, 2: 1, 100: 7}
    verify.assert_nothing_left_delta(uri)


def test_keyed_rules_fail_the_batch_in_delta(spark, tmp_path):  # type: ignore[no-untyped-def]
    uri = tmp_path / "t"
    sink = DeltaSink(uri, key=["id"])
    with pytest.raises(TaskFailedError, match=r"different rows of the key \(id=1\)"):
        write_batches(
            spark,
            tmp_path,
            sink,
            [[{"id": 1, "v": 1}, {"id": 1, "v": 2}]],
            "id long, v long",
            "dup",
        )
    verify.assert_nothing_left_delta(uri)


def test_the_audit_checks_each_merge_version(spark, tmp_path, capsys):  # type: ignore[no-untyped-def]
    """``twophase audit``: every batch's changes are recorded by the merge
    version that carries its checkpoint; a version rewritten to say otherwise
    is a mismatch."""
    from lifecycle.cli import main as twophase

    write_feed(tmp_path / "in", files=3, rows_per_file=30, keys=10, seed=4)
    uri = tmp_path / "t"
    sink = DeltaSink(uri, key=["id"], order_by="seq", delete_when=("op", "D"))
    _feed_job(spark, tmp_path, sink, interval=0).run()
    assert twophase(["audit", str(tmp_path / "state"), "--all"]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "MISMATCH" not in out
    last = max((uri / "_delta_log").glob("*.json"))
    lines = []
    for line in last.read_text().splitlines():
        action = json.loads(line)
        if "commitInfo" in action:
            merged = json.loads(action["commitInfo"]["twophaseMerge"])
            merged["changes"] = {k: v + 1 for k, v in merged["changes"].items()}
            action["commitInfo"]["twophaseMerge"] = json.dumps(merged)
        lines.append(json.dumps(action))
    last.write_text("\n".join(lines) + "\n")
    assert twophase(["audit", str(tmp_path / "state"), "--all"]) == 1
    assert "the ledger says" in capsys.readouterr().out


def test_a_merge_that_landed_before_a_crash_is_recognised_on_restart(spark, tmp_path):  # type: ignore[no-untyped-def]
    """The merge's version is written, then the driver fails before the ledger
    records the checkpoint (a fault right after the commit): the next start
    finishes the decided checkpoint, finds the app version in the table, and
    only cleans up (the change files go; nothing is merged twice)."""
    from sinks._faults import InjectedFault

    model = write_feed(tmp_path / "in", files=3, rows_per_file=30, keys=10, seed=8)
    uri = tmp_path / "t"

    def sink() -> DeltaSink:
        return DeltaSink(uri, key=["id"], order_by="seq", delete_when=("op", "D"))

    def fail() -> None:
        raise InjectedFault("after the merge's version, before the ledger")

    _faults.register("driver.mid_commit.delta", fail)
    with pytest.raises(Exception, match="after the merge's version"):
        _feed_job(spark, tmp_path, sink(), interval=0).run()
    versions = len(DeltaTable(str(uri)).history())
    assert (uri / "_twophase" / "changes").exists()  # left for the restart
    assert _feed_job(spark, tmp_path, sink(), interval=0).run().committed
    assert _rows(uri) == model
    verify.assert_nothing_left_delta(uri)
    assert len(DeltaTable(str(uri)).history()) >= versions


def test_an_error_after_the_merge_landed_keeps_its_files(spark, tmp_path):  # type: ignore[no-untyped-def]
    """An error between the merge's version landing and the commit returning
    (a post-commit hook, an interrupt) used to delete the staged files the new
    version adds: a committed version pointing at missing files, which no
    reader can read. The files are kept when the table shows the version, and
    the restart recognises it as committed."""
    from sinks._faults import InjectedFault

    model = write_feed(tmp_path / "in", files=2, rows_per_file=30, keys=10, seed=3)
    uri = tmp_path / "t"

    def sink() -> DeltaSink:
        return DeltaSink(uri, key=["id"], order_by="seq", delete_when=("op", "D"))

    def fail() -> None:
        raise InjectedFault("inside the commit, after the version landed")

    _faults.register("driver.merge_landed.delta", fail)
    with pytest.raises(Exception, match="after the version landed"):
        _feed_job(spark, tmp_path, sink(), interval=0).run()
    dt = DeltaTable(str(uri))
    assert all(Path(u).exists() for u in dt.file_uris())  # every file of the version is there
    dt.to_pyarrow_table()  # and the table reads
    assert _feed_job(spark, tmp_path, sink(), interval=0).run().committed
    assert _rows(uri) == model
    assert {r["id"] for r in spark.read.format("delta").load(str(uri)).collect()} == set(model)
    verify.assert_nothing_left_delta(uri)
