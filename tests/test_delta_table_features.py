"""Tables with Delta features, made and changed by delta-spark, written by the
sink: what it honours and what it refuses before writing anything.

A keyed sink (``key=``) and a replace (``replace_where=``) read the files they
replace and remove them; they are refused on tables whose files they cannot
remove faithfully (deletion vectors, ``delta.appendOnly``). Appends add files
only, and stay allowed there.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable, write_deltalake

from lifecycle import CheckpointCommitError, Job
from lifecycle.testing import jars, verify
from sinks import DeltaSink, PreflightError, _faults


def _delta_spark(spark):  # type: ignore[no-untyped-def]
    jars.require("delta")
    return spark


def _job(spark, tmp_path: Path, sink: DeltaSink, rows: list[dict[str, Any]], name: str):  # type: ignore[no-untyped-def]
    src = tmp_path / f"in-{name}"
    src.mkdir()
    (src / "part-0.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = spark.readStream.schema("id long, part long, v long").json(str(src))
    job = Job(spark, name, tmp_path / f"state-{name}", checkpoint_interval=0)
    job.add_pipeline("p", df, [sink], bounded=True)
    return job


def _dv_table(spark, uri: Path) -> None:  # type: ignore[no-untyped-def]
    """ids 0-9 in two partitions, row 3 deleted by delta-spark's DELETE: a
    deletion vector, not a rewrite."""
    (
        spark.range(10)
        .selectExpr("id", "id % 2 AS part", "0L AS v")
        .write.format("delta")
        .partitionBy("part")
        .option("delta.enableDeletionVectors", "true")
        .save(str(uri))
    )
    spark.sql(f"DELETE FROM delta.`{uri}` WHERE id = 3")
    log = (uri / "_delta_log" / "00000000000000000001.json").read_text()
    assert '"deletionVector"' in log  # the DELETE left a deletion vector


def test_deletion_vectors_refuse_keyed_and_replace_sinks_and_allow_appends(spark, tmp_path):  # type: ignore[no-untyped-def]
    """A keyed merge used to read a candidate file's raw Parquet (row 3 came
    back) and remove it by path alone (log replay kept the old file live: every
    key twice). Both are refused before anything is written, naming the
    feature; an append adds files and is honoured: delta-spark reads the
    deleted row as deleted and the appended rows once."""
    spark = _delta_spark(spark)
    uri = tmp_path / "t"
    _dv_table(spark, uri)
    version = DeltaTable(str(uri)).version()
    upsert = DeltaSink(uri, key=["id"])
    with pytest.raises(PreflightError, match=r"deletionVectors.*DROP FEATURE"):
        _job(spark, tmp_path, upsert, [{"id": 5, "part": 1, "v": 1}], "keyed").run()
    replace = DeltaSink(uri, replace_where="part = 1")
    with pytest.raises(PreflightError, match=r"deletionVectors"):
        _job(spark, tmp_path, replace, [{"id": 5, "part": 1, "v": 1}], "replace").run()
    assert DeltaTable(str(uri)).version() == version  # nothing written
    rows = [{"id": i, "part": i % 2, "v": 1} for i in range(10, 15)]
    assert _job(spark, tmp_path, DeltaSink(uri), rows, "append").run().committed
    read = spark.read.format("delta").load(str(uri)).collect()
    assert sorted(r["id"] for r in read) == [i for i in range(15) if i != 3]
    verify.assert_nothing_left_delta(uri)


def test_an_append_only_table_refuses_keyed_and_replace_sinks(spark, tmp_path):  # type: ignore[no-untyped-def]
    import pyarrow as pa

    uri = tmp_path / "t"
    write_deltalake(
        str(uri),
        pa.table({"id": [1, 2], "part": [1, 0], "v": [0, 0]}),
        partition_by=["part"],
        configuration={"delta.appendOnly": "true"},
    )
    for name, sink in (
        ("k", DeltaSink(uri, key=["id"])),
        ("r", DeltaSink(uri, replace_where="part = 1")),
    ):
        with pytest.raises(PreflightError, match=r"append-only \(delta.appendOnly=true\)"):
            _job(spark, tmp_path, sink, [{"id": 1, "part": 1, "v": 1}], name).run()
    assert DeltaTable(str(uri)).version() == 0


def test_a_table_made_append_only_after_preflight_fails_the_commit_at_once(spark, tmp_path):  # type: ignore[no-untyped-def]
    """delta-rs refuses the merge's removes on an append-only table. That used
    to count as a conflict: the whole merge planned and rewritten again until
    commit_timeout, then "the next start finishes it". It fails at once, with
    the reason, saying that no retry can pass it."""
    uri = tmp_path / "t"
    first = [{"id": i, "part": i % 2, "v": 0} for i in range(4)]
    assert _job(spark, tmp_path, DeltaSink(uri, key=["id"]), first, "a").run().committed

    def append_only() -> None:
        DeltaTable(str(uri)).alter.set_table_properties({"delta.appendOnly": "true"})

    _faults.register("driver.merge_staged", append_only)
    sink = DeltaSink(uri, key=["id"], commit_timeout=120)
    started = time.monotonic()
    with pytest.raises(CheckpointCommitError, match=r"append-only.*no retry can pass that"):
        _job(spark, tmp_path, sink, [{"id": 1, "part": 1, "v": 1}], "b").run()
    assert time.monotonic() - started < 60
    rows = DeltaTable(str(uri)).to_pyarrow_table().to_pylist()
    assert sorted((r["id"], r["v"]) for r in rows) == [(i, 0) for i in range(4)]
