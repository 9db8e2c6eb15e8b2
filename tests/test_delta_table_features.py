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
from urllib.parse import unquote

import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from lifecycle import CheckpointCommitError, Job, TaskFailedError
from lifecycle.cli import main as twophase
from lifecycle.testing import jars, verify
from sinks import DeltaSink, PreflightError, _faults
from sinks.delta import spark_features, table
from sinks.delta.layout import DeltaSchemaError
from tests import deltacheck
from tests.test_delta_merge import write_batches


def _delta_spark(spark):  # type: ignore[no-untyped-def]
    jars.require("delta")
    return spark


@pytest.fixture
def interpreted(spark):  # type: ignore[no-untyped-def]
    """The session without code generation while a test runs: delta-spark's DML
    on a table of a few rows spends most of its time compiling generated code
    (a MERGE here: about 6 s with it, 2 s without)."""
    key = "spark.sql.codegen.factoryMode"
    before = spark.conf.get(key, "FALLBACK")
    spark.conf.set(key, "NO_CODEGEN")
    yield spark
    spark.conf.set(key, before)


def _job(spark, tmp_path: Path, sink: DeltaSink, rows: list[dict[str, Any]], name: str):  # type: ignore[no-untyped-def]
    src = tmp_path / f"in-{name}"
    src.mkdir()
    (src / "part-0.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = spark.readStream.schema("id long, part long, v long").json(str(src))
    job = Job(spark, name, tmp_path / f"state-{name}", checkpoint_interval=0)
    job.add_pipeline("p", df, [sink], bounded=True)
    return job


def test_append_only_tables_refuse_keyed_and_replace_sinks(spark, tmp_path):  # type: ignore[no-untyped-def]
    """Delta forbids removing files from an append-only table: a keyed sink and a
    replace are refused before anything is written."""
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


def test_rewrites_of_feature_tables_need_delta_spark(tmp_path):  # type: ignore[no-untyped-def]
    """Without a way to commit through delta-spark (no delta-spark in the
    driver's session, or an S3 table shared with other writers), a keyed merge
    or a replace on a table with the change data feed or deletion vectors is
    refused, naming the feature and what to do; appends are not."""
    import pyarrow as pa

    uri = tmp_path / "t"
    write_deltalake(
        str(uri),
        pa.table({"id": [1, 2], "v": [0, 0]}),
        configuration={"delta.enableChangeDataFeed": "true"},
    )
    dt = DeltaTable(str(uri))
    for blocked, said in [
        ("a job whose Spark session has delta-spark: ...", "Spark session has delta-spark"),
        (spark_features.route("s3://bucket/t").blocked(), "other_writers='none'"),
    ]:
        with pytest.raises(DeltaSchemaError, match=rf"\['changeDataFeed'\].*{said}.*Or append"):
            table.check_writable(dt, "t", removes=True, spark_blocked=blocked)
        table.check_writable(dt, "t", removes=False, spark_blocked=blocked)
    table.check_writable(dt, "t", removes=True, spark_blocked=None)


def test_delta_spark_reaches_local_hdfs_and_s3_tables_on_s3_only_with_no_other_writer(
    tmp_path: Path,
) -> None:
    """The URI delta-spark opens a table by: a local table's ``file:`` URI,
    HDFS's own, S3's as ``s3a://`` when nothing else commits while the job
    runs (other_writers='none'); no route elsewhere, or on S3 otherwise."""
    route = spark_features.route
    assert route(str(tmp_path / "t")).uri == (tmp_path / "t").resolve().as_uri()
    assert route(f"file://{tmp_path}/t").uri == (tmp_path / "t").resolve().as_uri()
    assert route("hdfs://nn:9000/w/t/").uri == "hdfs://nn:9000/w/t"
    assert route("s3://b/w/t", "none").uri == route("s3a://b/w/t", "none").uri == "s3a://b/w/t"
    for other in ("check", "stopped"):
        refused = route("s3://b/w/t", other)
        assert refused.uri is None and "other_writers='none'" in refused.refused
        assert refused.blocked() == refused.refused
    gcs = route("gs://b/t", "none")
    assert gcs.uri is None and "gs://" in gcs.refused


def test_delta_spark_finding_another_table_than_deltalake_is_refused(spark, tmp_path):  # type: ignore[no-untyped-def]
    """Preflight's check that delta-spark reaches the table deltalake reads (a
    session whose S3A points at another endpoint finds another table, or
    none): refused, naming both ids and what to configure."""
    import pyarrow as pa

    from sinks.delta import spark_txn
    from sinks.errors import CommitRefusedError

    _delta_spark(spark)
    a, b = tmp_path / "a", tmp_path / "b"
    for uri in (a, b):
        write_deltalake(str(uri), pa.table({"id": [1]}))
    dt = DeltaTable(str(a))
    spark_txn.check_reaches(dt, a.as_uri(), "t")
    with pytest.raises(CommitRefusedError, match=r"finds as the table .*, not the table .*fs.s3a"):
        spark_txn.check_reaches(dt, b.as_uri(), "t")
    with pytest.raises(CommitRefusedError, match="finds no table there"):
        spark_txn.check_reaches(dt, (tmp_path / "none").as_uri(), "t")


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


# -- tables delta-spark made, with the features its users turn on: appends ----------------

EVERY_FEATURE = (
    "delta.enableRowTracking = true, delta.enableInCommitTimestamps = true, "
    "delta.checkpointPolicy = 'v2', delta.checkpointInterval = 2, "
    "delta.enableChangeDataFeed = true, delta.enableDeletionVectors = true, "
    "delta.enableTypeWidening = true"
)
"""every feature whose appends the sink honours, in one table (with liquid
clustering and a TIMESTAMP_NTZ column): the features delta-rs cannot write
make the driver commit through delta-spark (sinks/delta/spark_txn.py)"""


def _made_by_delta_spark(spark, uri: Path, props: str) -> list[Any]:  # type: ignore[no-untyped-def]
    """A table delta-spark creates clustered by id with ``props``, then changes
    with its DML (INSERT, a MERGE that updates two rows and deletes one, a
    widening of ``v`` from INT to BIGINT); returns the rows delta-spark reads
    afterwards."""
    t = f"delta.`{uri}`"
    spark.sql(
        f"CREATE TABLE {t} (id BIGINT, part BIGINT, v INT, at TIMESTAMP_NTZ) USING delta "
        f"CLUSTER BY (id) TBLPROPERTIES ({props})"
    )
    spark.sql(f"INSERT INTO {t} SELECT id, id % 2, id, NULL FROM range(8)")
    spark.sql(  # an update and a delete: deletion vectors, change data, row ids kept
        f"MERGE INTO {t} AS d USING (SELECT id, CAST(id * 11 AS INT) AS v FROM "
        "VALUES (1L), (2L), (3L) AS s(id)) AS s ON d.id = s.id "
        "WHEN MATCHED AND s.id = 2 THEN DELETE WHEN MATCHED THEN UPDATE SET d.v = s.v"
    )
    spark.sql(f"ALTER TABLE {t} ALTER COLUMN v TYPE BIGINT")
    return _delta_spark_rows(spark, uri)


def _delta_spark_rows(spark, uri: Path, columns: str = "id, part, v, at") -> list[Any]:  # type: ignore[no-untyped-def]
    query = f"SELECT {columns} FROM delta.`{uri}` ORDER BY id"
    return [tuple(r) for r in spark.sql(query).collect()]


def _log_actions(uri: Path, version: int) -> list[dict[str, Any]]:
    lines = (uri / "_delta_log" / f"{version:020d}.json").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def _sink_adds(uri: Path) -> list[tuple[int, dict[str, Any]]]:
    """(version, add action) of every file the sink added (named after a transaction)."""
    return [
        (v, a["add"])
        for v in range(DeltaTable(str(uri)).version() + 1)
        for a in _log_actions(uri, v)
        if "add" in a and a["add"]["path"].split("/")[-1].startswith("tp2.")
    ]


def _commit_info(uri: Path, version: int) -> dict[str, Any]:
    return next(a["commitInfo"] for a in _log_actions(uri, version) if "commitInfo" in a)


def test_a_table_with_the_features_delta_spark_users_turn_on_takes_appends(interpreted, tmp_path):  # type: ignore[no-untyped-def]
    """delta-rs refuses to commit to this table (row tracking, in-commit
    timestamps, clustering, type widening); the sink's driver commits through
    delta-spark's own transaction. A job appends two checkpoints; delta-spark reads the rows
    its DML left (the deleted row stays deleted) plus every appended row once,
    and what each feature promises holds: fresh unique row ids and old rows
    keeping theirs, monotonic in-commit timestamps, the clustering kept and
    OPTIMIZE clustering the new files, v2 checkpoints read back, values past
    INT's range in the widened column, wall-clock TIMESTAMP_NTZ values, and
    the change feed showing each appended row once, as an insert."""
    from datetime import datetime

    spark = _delta_spark(interpreted)
    uri = tmp_path / "t"
    before = _made_by_delta_spark(spark, uri, EVERY_FEATURE)
    assert [r[:3] for r in before] == [(0, 0, 0), (1, 1, 11), (3, 1, 33)] + [
        (i, i % 2, i) for i in range(4, 8)
    ]
    row_ids = dict(_delta_spark_rows(spark, uri, "id, _metadata.row_id"))
    schema = "id long, part long, v long, at timestamp_ntz"
    src = tmp_path / "in"
    src.mkdir()
    appended = []
    for n, ids in enumerate((range(100, 110), range(110, 120))):
        rows = [
            {"id": i, "part": i % 2, "v": 2**31 + i, "at": f"2026-03-29T02:{i % 60:02d}:00"}
            for i in ids
        ]
        (src / f"p{n}.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
        appended += [
            (r["id"], r["part"], r["v"], datetime(2026, 3, 29, 2, r["id"] % 60)) for r in rows
        ]
    job = Job(spark, "append", tmp_path / "state", checkpoint_interval=0)
    df = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).json(str(src))
    job.add_pipeline("p", df, [DeltaSink(uri)], bounded=True)
    assert job.run().committed
    latest = int(spark.sql(f"DESCRIBE HISTORY delta.`{uri}` LIMIT 1").first()[0])
    versions = [latest - 1, latest]  # a checkpoint per batch, after the claim
    expected = sorted(before + appended)
    assert _delta_spark_rows(spark, uri) == expected
    verify.assert_nothing_left_delta(uri)
    for v in versions:
        info = _commit_info(uri, v)
        assert info["operation"] == "STREAMING UPDATE"
        assert info["operationMetrics"]["numOutputRows"] == "10"
        assert info["operationParameters"]["queryId"].startswith("tp2.")
    # row tracking: unique ids, old rows keep theirs, new rows carry their version
    tracked = _delta_spark_rows(spark, uri, "id, _metadata.row_id, _metadata.row_commit_version")
    assert len({r[1] for r in tracked}) == len(tracked)
    assert all(row_ids[r[0]] == r[1] for r in tracked if r[0] < 100)
    assert {r[2] for r in tracked if r[0] >= 100} == set(versions)
    # in-commit timestamps
    stamps = [_commit_info(uri, v).get("inCommitTimestamp") for v in range(versions[-1] + 1)]
    assert None not in stamps and stamps == sorted(stamps)
    # the change feed: each appended row once, as an insert of its version
    changes = spark.sql(
        f"SELECT id, _change_type, _commit_version FROM table_changes_by_path("
        f"'{uri}', {versions[0]}) ORDER BY id"
    ).collect()
    assert [(r[0], r[1]) for r in changes] == [(r[0], "insert") for r in appended]
    by_version: dict[int, set[int]] = {}
    for r in changes:
        by_version.setdefault(r[2], set()).add(r[0])
    assert sorted(by_version) == versions  # one version per checkpoint, a file each
    assert sorted(map(min, by_version.values())) == [100, 110]
    assert all(len(ids) == 10 and max(ids) - min(ids) == 9 for ids in by_version.values())
    # v2 checkpoints (every second version), one of the sink's versions among them,
    # read back by a fresh delta-spark log
    made = {int(p.name[:20]) for p in (uri / "_delta_log").glob("0*.checkpoint.*.*")}
    assert made & set(versions), f"no v2 checkpoint at the sink's versions {versions}: {made}"
    spark._jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()
    assert _delta_spark_rows(spark, uri) == expected
    # clustering kept; delta-spark's OPTIMIZE clusters the appended files
    detail = spark.sql(f"DESCRIBE DETAIL delta.`{uri}`").first()
    assert list(detail["clusteringColumns"]) == ["id"]
    ours = {a["add"]["path"] for v in versions for a in _log_actions(uri, v) if "add" in a}
    spark.sql(f"OPTIMIZE delta.`{uri}`")
    assert _delta_spark_rows(spark, uri) == expected
    optimized = _log_actions(
        uri, int(spark.sql(f"DESCRIBE HISTORY delta.`{uri}` LIMIT 1").first()[0])
    )
    assert ours <= {a["remove"]["path"] for a in optimized if "remove" in a}
    assert {a["add"].get("clusteringProvider") for a in optimized if "add" in a} == {"liquid"}


def test_identity_columns_are_refused_before_anything_is_written(spark, tmp_path):  # type: ignore[no-untyped-def]
    """Identity values come from a high-water mark each writer's commit
    advances: rows staged before their commit cannot hold them. Appends and
    merges are refused before anything is written, naming the column."""
    spark = _delta_spark(spark)
    uri = tmp_path / "t"
    spark.sql(
        f"CREATE TABLE delta.`{uri}` (id BIGINT, part BIGINT, v BIGINT, "
        "n BIGINT GENERATED ALWAYS AS IDENTITY) USING delta PARTITIONED BY (part)"
    )
    version = DeltaTable(str(uri)).version()
    for name, sink in (("a", DeltaSink(uri)), ("k", DeltaSink(uri, key=["id"]))):
        with pytest.raises(PreflightError, match="'n' is an identity column"):
            _job(spark, tmp_path, sink, [{"id": 1, "part": 1, "v": 1}], name).run()
    assert DeltaTable(str(uri)).version() == version


@pytest.mark.parametrize("mode", ["name", "id"])
def test_a_column_mapped_table_takes_appends_by_physical_names(interpreted, tmp_path, mode):  # type: ignore[no-untyped-def]
    """A table delta-spark made with column mapping, a nested struct and a
    partition column, then changed: a column renamed (its files keep the old
    physical name), one dropped (its data stays in the old files), a row
    updated. The sink's files carry the physical names and field ids at every
    level, its stats and partition values the physical names: delta-spark
    reads the old rows and the appended ones, filters by the renamed column,
    and streams each row once."""
    spark = _delta_spark(interpreted)
    uri = tmp_path / "t"
    spark.sql(
        f"CREATE TABLE delta.`{uri}` (id BIGINT, part STRING, s STRUCT<a: INT, b: STRING>, "
        "v BIGINT, gone STRING) USING delta PARTITIONED BY (part) "
        f"TBLPROPERTIES (delta.columnMapping.mode = '{mode}')"
    )
    spark.sql(
        f"INSERT INTO delta.`{uri}` VALUES (1, 'a b', named_struct('a', 1, 'b', 'x'), 10, 'g'), "
        "(2, NULL, NULL, 20, 'g')"
    )
    spark.sql(f"ALTER TABLE delta.`{uri}` RENAME COLUMN v TO w")
    spark.sql(f"ALTER TABLE delta.`{uri}` DROP COLUMN gone")
    spark.sql(f"UPDATE delta.`{uri}` SET w = 21 WHERE id = 2")
    parts = ["a b", None, "x:/y"]
    rows = [
        {"id": i, "part": parts[i % 3], "s": {"a": i, "b": f"s{i}"} if i % 4 else None, "w": i}
        for i in range(10, 22)
    ]
    src = tmp_path / "in"
    src.mkdir()
    (src / "p.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    schema = "id long, part string, s struct<a: int, b: string>, w long"
    job = Job(spark, "cm", tmp_path / "state", checkpoint_interval=0)
    job.add_pipeline(
        "p", spark.readStream.schema(schema).json(str(src)), [DeltaSink(uri)], bounded=True
    )
    job.run()

    def as_tuple(r: dict[str, Any]) -> tuple[Any, ...]:
        s = r["s"]
        return (r["id"], r["part"], (s["a"], s["b"]) if s else None, r["w"])

    want = [(1, "a b", (1, "x"), 10), (2, None, None, 21), *map(as_tuple, rows)]
    got = [
        (r.id, r.part, tuple(r.s) if r.s else None, r.w)
        for r in spark.sql(f"SELECT * FROM delta.`{uri}` ORDER BY id").collect()
    ]
    assert got == want
    assert [r.id for r in spark.sql(f"SELECT id FROM delta.`{uri}` WHERE w = 15").collect()] == [15]
    schema_json = json.loads(DeltaTable(str(uri)).schema().to_json())
    physical = {
        f["name"]: f["metadata"]["delta.columnMapping.physicalName"] for f in schema_json["fields"]
    }
    ours = _sink_adds(uri)
    assert ours
    for _, add in ours:
        assert set(add["partitionValues"]) == {physical["part"]}
        stats = json.loads(add["stats"])
        assert set(stats["minValues"]) <= {physical["id"], physical["s"], physical["w"]}
        footer = pq.read_schema(uri / unquote(add["path"]))
        assert footer.names == [physical["id"], physical["s"], physical["w"]]
        assert all(f.metadata and b"PARQUET:field_id" in f.metadata for f in footer)
        nested = footer.field(physical["s"]).type
        assert all(nested.field(i).name.startswith("col-") for i in range(nested.num_fields))
    # from the sink's first version: a stream across the rename needs delta-spark's schema log
    first = min(v for v, _ in ours)
    seen = deltacheck.assert_streaming_read_sees_each_row_once(
        spark, uri, tmp_path / "stream", starting_version=first
    )
    assert sorted(r[0] for r in seen) == [r["id"] for r in rows]
    with pytest.raises(AssertionError, match=r"uses column mapping.*check it with delta-spark"):
        verify.assert_exactly_once_delta(uri, [1, 2, *(r["id"] for r in rows)])  # would see nulls


def test_a_partitioned_table_committed_through_delta_spark(spark, tmp_path):  # type: ignore[no-untyped-def]
    """Row tracking on a partitioned table delta-spark made: partition values
    with a space, a colon and a slash, and null, go through delta-spark's
    commit and read back alike; a commit that landed before the job failed is
    recognised at the restart, not made twice; schema_mode="merge" adds a column
    through delta-spark."""
    spark = _delta_spark(spark)
    uri = tmp_path / "t"
    spark.sql(
        f"CREATE TABLE delta.`{uri}` (id BIGINT, part STRING, v BIGINT) USING delta "
        "PARTITIONED BY (part) TBLPROPERTIES (delta.enableRowTracking = true)"
    )
    parts = ["a b", "x:/y", None, "plain"]
    src = tmp_path / "in"
    src.mkdir()
    (src / "p.json").write_text(
        "".join(json.dumps({"id": i, "part": parts[i % 4], "v": i}) + "\n" for i in range(12))
    )

    def job(name: str, source: Path, schema: str, sink: DeltaSink) -> Job:
        j = Job(spark, name, tmp_path / f"state-{name}", checkpoint_interval=0)
        df = spark.readStream.schema(schema).json(str(source))
        j.add_pipeline("p", df, [sink], bounded=True)
        return j

    def fail_once() -> None:
        _faults.clear()
        raise RuntimeError("injected after the commit landed")

    _faults.register("driver.mid_commit", fail_once)
    try:
        with pytest.raises(CheckpointCommitError):
            job("parts", src, "id long, part string, v long", DeltaSink(uri)).run()
    finally:
        _faults.clear()
    job("parts", src, "id long, part string, v long", DeltaSink(uri)).run()  # recovers
    rows = _delta_spark_rows(spark, uri, "id, part, v")
    assert rows == [(i, parts[i % 4], i) for i in range(12)]
    history = spark.sql(f"DESCRIBE HISTORY delta.`{uri}`").collect()
    assert sum(1 for h in history if h["operation"] == "STREAMING UPDATE") == 1
    verify.assert_nothing_left_delta(uri)

    more = tmp_path / "more"
    more.mkdir()
    (more / "q.json").write_text(json.dumps({"id": 12, "part": "a b", "v": 12, "note": "n"}) + "\n")
    wider = "id long, part string, v long, note string"
    job("wider", more, wider, DeltaSink(uri, schema_mode="merge")).run()
    assert _delta_spark_rows(spark, uri, "id, note") == [(i, None) for i in range(12)] + [(12, "n")]


def test_keyed_and_replace_sinks_rewrite_the_files_delta_spark_wrote(interpreted, tmp_path):  # type: ignore[no-untyped-def]
    """A partitioned table delta-spark made and changed (partition values with
    a space, a colon, a slash, a percent sign, and null; its UPDATE rewrote a
    file): a keyed sink rewrites delta-spark's files in every partition, a
    replace empties one and fills it again. The sink's removes name the files
    as delta-spark's log does, so delta-spark reads every version as deltalake
    does, no removed row comes back and none is read twice."""
    spark = _delta_spark(interpreted)
    uri = tmp_path / "t"
    parts = ["a b", "x:/y", None, "50%"]
    spark.createDataFrame(
        [(i, parts[i % 4], 0) for i in range(16)], "id long, part string, v long"
    ).write.format("delta").partitionBy("part").save(str(uri))
    spark.sql(f"UPDATE delta.`{uri}` SET v = 1 WHERE id = 5").collect()

    def run(name: str, rows: list[dict[str, Any]], sink: DeltaSink) -> None:
        src = tmp_path / f"in-{name}"
        src.mkdir()
        (src / "p.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
        job = Job(spark, name, tmp_path / f"state-{name}", checkpoint_interval=0)
        job.add_pipeline(
            "p",
            spark.readStream.schema("id long, part string, v long").json(str(src)),
            [sink],
            bounded=True,
        )
        job.run()

    model = {i: (parts[i % 4], 1 if i == 5 else 0) for i in range(16)}
    upserts = [{"id": i, "part": parts[i % 4], "v": 10 + i} for i in (0, 1, 2, 3, 5)] + [
        {"id": 20, "part": "50%", "v": 20}
    ]
    run("keyed", upserts, DeltaSink(uri, key=["id"]))
    model.update({r["id"]: (r["part"], r["v"]) for r in upserts})
    refill = [{"id": 30, "part": "a b", "v": 30}]
    run("replace", refill, DeltaSink(uri, replace_where="part = 'a b'"))
    model = {i: pv for i, pv in model.items() if pv[0] != "a b"} | {30: ("a b", 30)}
    want = sorted((i, p, v) for i, (p, v) in model.items())
    assert _delta_spark_rows(spark, uri, "id, part, v") == want
    got = DeltaTable(str(uri)).to_pyarrow_table().to_pylist()
    assert sorted((r["id"], r["part"], r["v"]) for r in got) == want
    deltacheck.assert_delta_spark_reads_every_version(spark, uri)
    deltacheck.assert_streaming_read_sees_each_row_once(
        spark, uri, tmp_path / "stream", skip_change_commits=True
    )
    verify.assert_nothing_left_delta(uri)


# -- rewrites (keyed merges, replaces) of tables with the features ---------------------


def _changes(
    spark, uri: Path, since: int, columns: str = "id, _change_type, _commit_version, w"
) -> list[tuple[Any, ...]]:  # type: ignore[no-untyped-def]
    return sorted(
        tuple(r)
        for r in spark.sql(
            f"SELECT {columns} FROM table_changes_by_path('{uri}', {since})"
        ).collect()
    )


def _dv_removes(uri: Path, versions: list[int]) -> tuple[set[str], set[str]]:
    """(paths of files that had a deletion vector before ``versions``, paths of
    the removes in ``versions`` that name one)."""
    had = {
        a["add"]["path"]
        for v in range(min(versions))
        for a in _log_actions(uri, v)
        if "add" in a and a["add"].get("deletionVector")
    }
    named = {
        a["remove"]["path"]
        for v in versions
        for a in _log_actions(uri, v)
        if "remove" in a and a["remove"].get("deletionVector")
    }
    return had, named


def test_keyed_merges_honour_every_feature_of_a_delta_spark_table(interpreted, tmp_path, capsys):  # type: ignore[no-untyped-def]
    """A table delta-spark made with every feature its users turn on, column
    mapping too (a column renamed), whose MERGE left deletion vectors: a keyed
    sink merges two checkpoints into it through delta-spark's transaction.
    Deleted rows stay deleted, files with deletion vectors are removed with
    them, the change feed shows each change once (an update as its pre- and
    post-image, a delete of an absent key as nothing), unchanged rows keep their
    row ids and versions, updated ones their ids, new ones get fresh ids, and
    the in-commit timestamps, the clustering and the widened type hold."""
    spark = _delta_spark(interpreted)
    uri = tmp_path / "t"
    t = f"delta.`{uri}`"
    before = _made_by_delta_spark(spark, uri, EVERY_FEATURE + ", delta.columnMapping.mode = 'name'")
    spark.sql(f"ALTER TABLE {t} RENAME COLUMN v TO w")
    ids_before = {
        r[0]: (r[1], r[2])
        for r in _delta_spark_rows(spark, uri, "id, _metadata.row_id, _metadata.row_commit_version")
    }
    first = DeltaTable(str(uri)).version() + 2  # after the claim
    batches = [
        [
            {"id": 1, "part": 1, "w": 100, "op": "U"},
            {"id": 3, "op": "D"},
            {"id": 9, "part": 1, "w": 9, "op": "U"},
            {"id": 2, "op": "D"},  # deleted by delta-spark already: no change
            {"id": 4, "part": 0, "w": 40, "op": "U"},
            {"id": 0, "part": 0, "w": 1000, "op": "U"},  # the file with a deletion vector
        ],
        [
            {"id": 4, "part": 0, "w": 2**31 + 4, "op": "U"},
            {"id": 10, "part": 0, "w": 10, "op": "U"},
            {"id": 9, "op": "D"},
        ],
    ]
    schema = "id long, part long, w long, at timestamp_ntz, op string"
    sink = DeltaSink(uri, key=["id"], delete_when=("op", "D"))
    assert write_batches(spark, tmp_path, sink, batches, schema, "keyed").committed
    m1, m2 = first, first + 1
    assert DeltaTable(str(uri)).version() == m2
    model = {r[0]: r[:4] for r in before}
    for batch in batches:
        for r in batch:
            if r["op"] == "D":
                model.pop(r["id"], None)
            else:
                model[r["id"]] = (r["id"], r["part"], r["w"], None)
    assert _delta_spark_rows(spark, uri, "id, part, w, at") == sorted(model.values())
    # the change feed of the two merges: each change once
    assert _changes(spark, uri, m1) == sorted(
        [
            (1, "update_preimage", m1, 11),
            (1, "update_postimage", m1, 100),
            (3, "delete", m1, 33),
            (9, "insert", m1, 9),
            (4, "update_preimage", m1, 4),
            (4, "update_postimage", m1, 40),
            (0, "update_preimage", m1, 0),
            (0, "update_postimage", m1, 1000),
            (4, "update_preimage", m2, 40),
            (4, "update_postimage", m2, 2**31 + 4),
            (10, "insert", m2, 10),
            (9, "delete", m2, 9),
        ]
    )
    # row tracking
    after = {
        r[0]: (r[1], r[2])
        for r in _delta_spark_rows(spark, uri, "id, _metadata.row_id, _metadata.row_commit_version")
    }
    assert len({rid for rid, _ in after.values()}) == len(after)
    for i in (5, 6, 7):  # copied unchanged
        assert after[i] == ids_before[i], i
    assert after[0] == (ids_before[0][0], m1) and after[1] == (ids_before[1][0], m1)
    assert after[4] == (ids_before[4][0], m2)
    assert after[10][0] not in {rid for rid, _ in ids_before.values()} and after[10][1] == m2
    # files with deletion vectors removed with them
    had, named = _dv_removes(uri, [m1, m2])
    assert had and had & named, (had, named)
    for v in (m1, m2):
        info = _commit_info(uri, v)
        assert info["operation"] == "STREAMING UPDATE"
        assert info["operationParameters"]["queryId"].startswith("tp2.")
        assert int(info["operationMetrics"]["numRemovedFiles"]) >= 1
    stamps = [_commit_info(uri, v).get("inCommitTimestamp") for v in range(m2 + 1)]
    assert None not in stamps and stamps == sorted(stamps)
    assert list(spark.sql(f"DESCRIBE DETAIL {t}").first()["clusteringColumns"]) == ["id"]
    spark._jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()  # v2 checkpoints, read afresh
    assert _delta_spark_rows(spark, uri, "id, part, w, at") == sorted(model.values())
    verify.assert_nothing_left_delta(uri)
    # the merges record their change rows (commitInfo.tags) for twophase audit
    assert twophase(["audit", str(tmp_path / "state-keyed")]) == 0
    assert "mismatch" not in capsys.readouterr().out.lower()


def test_a_replace_and_a_merge_honour_a_partitioned_delta_spark_table(interpreted, tmp_path):  # type: ignore[no-untyped-def]
    """A partitioned table with deletion vectors, the change data feed, row
    tracking and column mapping by id, a row deleted by delta-spark: a replace
    of one partition removes its files with their deletion vectors, and the
    change feed shows the partition's live rows deleted (not the row deleted
    before) and the new rows inserted; a keyed merge then rewrites another
    partition by physical names. Row ids stay unique and old rows keep theirs."""
    spark = _delta_spark(interpreted)
    uri = tmp_path / "t"
    t = f"delta.`{uri}`"
    spark.sql(
        f"CREATE TABLE {t} (id BIGINT, part STRING, w BIGINT) USING delta PARTITIONED BY (part) "
        "TBLPROPERTIES (delta.enableDeletionVectors = true, delta.enableChangeDataFeed = true, "
        "delta.enableRowTracking = true, delta.columnMapping.mode = 'id')"
    )
    spark.sql(
        f"INSERT INTO {t} SELECT id, element_at(array('a', 'b', 'c'), CAST(id % 3 + 1 AS INT)), "
        "id FROM range(12)"
    )
    spark.sql(f"DELETE FROM {t} WHERE id = 4")
    ids_before = dict(_delta_spark_rows(spark, uri, "id, _metadata.row_id"))
    start = DeltaTable(str(uri)).version()
    schema = "id long, part string, w long"
    refill = [{"id": 20, "part": "b", "w": 20}, {"id": 21, "part": "b", "w": 21}]
    assert write_batches(
        spark, tmp_path, DeltaSink(uri, replace_where="part = 'b'"), [refill], schema, "replace"
    ).committed
    replaced = DeltaTable(str(uri)).version()
    assert _changes(spark, uri, replaced, "id, _change_type, w") == sorted(
        [(i, "delete", i) for i in (1, 7, 10)] + [(20, "insert", 20), (21, "insert", 21)]
    )
    had, named = _dv_removes(uri, [replaced])
    assert had and had <= named, (had, named)
    upserts = [{"id": 0, "part": "a", "w": 100}, {"id": 30, "part": "a", "w": 30}]
    assert write_batches(
        spark, tmp_path, DeltaSink(uri, key=["id"]), [upserts], schema, "keyed"
    ).committed
    merged = DeltaTable(str(uri)).version()
    assert _changes(spark, uri, merged, "id, _change_type, w") == sorted(
        [(0, "update_preimage", 0), (0, "update_postimage", 100), (30, "insert", 30)]
    )
    model = {i: (i, "abc"[i % 3], i) for i in range(12) if i != 4 and i % 3 != 1}
    model |= {20: (20, "b", 20), 21: (21, "b", 21), 0: (0, "a", 100), 30: (30, "a", 30)}
    assert _delta_spark_rows(spark, uri, "id, part, w") == sorted(model.values())
    after = dict(_delta_spark_rows(spark, uri, "id, _metadata.row_id"))
    assert len(set(after.values())) == len(after)
    assert all(after[i] == ids_before[i] for i in after if i < 12)
    assert start < replaced < merged
    verify.assert_nothing_left_delta(uri)


def test_merges_rewrite_only_the_files_that_hold_a_changed_key(interpreted, tmp_path):  # type: ignore[no-untyped-def]
    """On a table with the change feed and row tracking (ids 1 and 5 in one
    file, 3 in another), whose statistics make both files candidates for any
    of these keys: a merge of only a delete of an absent key commits no file
    and no change; an update of 3 rewrites only the file holding 3 (the other,
    rewritten whole, would read to a change-feed reader as its rows deleted and
    inserted again); new keys beyond every file read nothing and get fresh row
    ids. Old rows keep theirs throughout."""
    spark = _delta_spark(interpreted)
    uri = tmp_path / "t"
    t = f"delta.`{uri}`"
    spark.sql(
        f"CREATE TABLE {t} (id BIGINT, w BIGINT) USING delta TBLPROPERTIES "
        "(delta.enableRowTracking = true, delta.enableChangeDataFeed = true)"
    )
    spark.sql(f"INSERT INTO {t} SELECT /*+ COALESCE(1) */ * FROM VALUES (1L, 1L), (5L, 5L)")
    spark.sql(f"INSERT INTO {t} VALUES (3, 3)")
    assert len(DeltaTable(str(uri)).file_uris()) == 2
    ids_before = dict(_delta_spark_rows(spark, uri, "id, _metadata.row_id"))
    schema = "id long, w long, op string"

    def merge(name: str, rows: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
        sink = DeltaSink(uri, key=["id"], delete_when=("op", "D"))
        assert write_batches(spark, tmp_path, sink, [rows], schema, name).committed
        v = DeltaTable(str(uri)).version()
        return v, _log_actions(uri, v)

    v, actions = merge("absent", [{"id": 2, "op": "D"}])
    assert not [a for a in actions if "add" in a or "remove" in a or "cdc" in a]
    assert _changes(spark, uri, v, "id, _change_type, w") == []
    v, actions = merge("update", [{"id": 3, "w": 30, "op": "U"}])
    removed = [a["remove"] for a in actions if "remove" in a]
    assert len(removed) == 1 and json.loads(removed[0]["stats"])["numRecords"] == 1
    assert _changes(spark, uri, v, "id, _change_type, w") == [
        (3, "update_postimage", 30),
        (3, "update_preimage", 3),
    ]
    v, actions = merge("new", [{"id": 100, "w": 1, "op": "I"}, {"id": 101, "w": 2, "op": "I"}])
    assert not [a for a in actions if "remove" in a]  # nothing read, nothing rewritten
    assert _changes(spark, uri, v, "id, _change_type, w") == [
        (100, "insert", 1),
        (101, "insert", 2),
    ]
    assert _delta_spark_rows(spark, uri, "id, w") == [(1, 1), (3, 30), (5, 5), (100, 1), (101, 2)]
    after = dict(_delta_spark_rows(spark, uri, "id, _metadata.row_id"))
    assert len(set(after.values())) == len(after)
    assert all(after[i] == ids_before[i] for i in (1, 3, 5))
    deltacheck.assert_change_feed_replays_to_the_table(spark, uri)


def test_a_merge_prunes_by_the_key_s_physical_statistics(interpreted, tmp_path):  # type: ignore[no-untyped-def]
    """Column mapping turned on for an existing table keeps its columns'
    physical names: after ``id`` is renamed ``legacy_id`` and a new ``id`` is
    added, the statistics keyed ``id`` are ``legacy_id``'s. A keyed merge on the
    new ``id`` must prune by its own statistics: read by ``legacy_id``'s, the
    file holding id 500 (legacy_id 1) looked out of range, and the upsert added
    id 500 a second time."""
    spark = _delta_spark(interpreted)
    uri = tmp_path / "t"
    t = f"delta.`{uri}`"
    spark.sql(f"CREATE TABLE {t} (id BIGINT, v BIGINT) USING delta")
    spark.sql(
        f"ALTER TABLE {t} SET TBLPROPERTIES (delta.minReaderVersion = 2, "
        "delta.minWriterVersion = 5, delta.columnMapping.mode = 'name')"
    )
    spark.sql(f"ALTER TABLE {t} RENAME COLUMN id TO legacy_id")
    spark.sql(f"ALTER TABLE {t} ADD COLUMN id BIGINT")
    spark.sql(f"INSERT INTO {t} (legacy_id, v, id) VALUES (1, 0, 500)")
    rows = [{"legacy_id": 1, "v": 1, "id": 500}]
    schema = "legacy_id long, v long, id long"
    assert write_batches(spark, tmp_path, DeltaSink(uri, key=["id"]), [rows], schema, "k").committed
    assert _delta_spark_rows(spark, uri, "id, legacy_id, v") == [(500, 1, 1)]


_RULED = "id long, v long, ts timestamp"


def test_check_constraints_and_generated_columns_hold_as_delta_spark_holds_them(  # type: ignore[no-untyped-def]
    interpreted, tmp_path
):
    """A table delta-spark made with a CHECK constraint and two generated
    columns, one of them the partition column (``day``, the date of ``ts``).
    The sink computes the generated columns a DataFrame lacks exactly as
    delta-spark's INSERT computes them in a twin table, and checks those a
    DataFrame gives; a row delta-spark refuses (the CHECK false or null, a
    given generated value that differs) fails its batch, naming the rule,
    with nothing committed; a keyed sink's delete row is not checked. A
    constraint added while a checkpoint's rows wait for their commit keeps
    them out until the run writes them again, checked against it."""
    spark = _delta_spark(interpreted)
    uri, twin = tmp_path / "t", tmp_path / "twin"
    for t in (uri, twin):
        spark.sql(
            f"CREATE TABLE delta.`{t}` (id BIGINT, v BIGINT, ts TIMESTAMP, "
            "day DATE GENERATED ALWAYS AS (CAST(ts AS DATE)), "
            "g BIGINT GENERATED ALWAYS AS (v * 2)) USING delta PARTITIONED BY (day)"
        )
        spark.sql(f"ALTER TABLE delta.`{t}` ADD CONSTRAINT positive CHECK (v > 0)")
    rows = [{"id": i, "v": i + 1, "ts": f"2026-0{1 + i % 3}-1{i}T23:30:00Z"} for i in range(6)]

    def run(name: str, batch: list[dict[str, Any]], sink: DeltaSink, schema: str = _RULED) -> None:
        src = tmp_path / f"in-{name}"
        src.mkdir()
        (src / "p.json").write_text("".join(json.dumps(r) + "\n" for r in batch))
        job = Job(spark, name, tmp_path / f"state-{name}", checkpoint_interval=0)
        job.add_pipeline("p", spark.readStream.schema(schema).json(str(src)), [sink], bounded=True)
        job.run()

    run("append", rows, DeltaSink(uri))
    values = ", ".join(f"({r['id']}, {r['v']}, TIMESTAMP'{r['ts']}')" for r in rows)
    spark.sql(f"INSERT INTO delta.`{twin}` (id, v, ts) VALUES {values}")
    both = "id, v, ts, day, g"
    assert _delta_spark_rows(spark, uri, both) == _delta_spark_rows(spark, twin, both)
    assert {r[3] for r in _delta_spark_rows(spark, uri, both)} == {
        r[2].date() for r in _delta_spark_rows(spark, uri, both)
    }

    before = _delta_spark_rows(spark, uri, both)
    refused = [
        ("null", [{"id": 9, "v": None, "ts": rows[0]["ts"]}], _RULED, r"positive \(v > 0\)"),
        (
            "given",
            [{"id": 9, "v": 1, "ts": rows[0]["ts"], "g": 3}],
            _RULED + ", g long",
            r"Generated Column \(g <=> \(v \* 2\)\)",
        ),
    ]
    for name, batch, schema, rule in refused:
        with pytest.raises(TaskFailedError, match=rule):
            run(name, [*rows[:2], *batch], DeltaSink(uri, key=["id"]), schema)
        assert _delta_spark_rows(spark, uri, both) == before, name
        verify.assert_nothing_left_delta(uri)

    keyed = DeltaSink(uri, key=["id"], delete_when="gone")
    changes = [
        {"id": 0, "v": 50, "ts": rows[0]["ts"], "g": 100, "gone": False},  # given, and right
        {"id": 1, "v": None, "ts": None, "g": None, "gone": True},  # a delete: not checked
    ]
    run("keyed", changes, keyed, _RULED + ", g long, gone boolean")
    got = {r[0]: r for r in _delta_spark_rows(spark, uri, both)}
    assert sorted(got) == [0, 2, 3, 4, 5] and got[0][1:2] + got[0][4:] == (50, 100)

    def tighten() -> None:
        spark.sql(f"ALTER TABLE delta.`{uri}` ADD CONSTRAINT small CHECK (v < 1000)")

    late = [{"id": 20, "v": 7, "ts": rows[0]["ts"]}]
    _faults.register("driver.before_commit", tighten)
    try:
        # the commit finds the rows unchecked against the new rule and commits none;
        # the run writes them again from the source, checked against both constraints
        run("late", late, DeltaSink(uri))
    finally:
        _faults.clear()
    assert got[0] and 20 in {r[0] for r in _delta_spark_rows(spark, uri, both)}
    with pytest.raises(TaskFailedError, match=r"small \(v < 1000\)"):
        run("later", [{"id": 21, "v": 2000, "ts": rows[0]["ts"]}], DeltaSink(uri))
    deltacheck.assert_delta_spark_reads_every_version(spark, uri)
    verify.assert_nothing_left_delta(uri)
