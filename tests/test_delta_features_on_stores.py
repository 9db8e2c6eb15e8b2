"""The delta-spark feature route on S3 and HDFS: a table delta-spark made with
deletion vectors, the change data feed, row tracking and column mapping, on
the store, takes a keyed sink's merges through delta-spark's own transaction
(``sinks/delta/spark_txn.py``), which reaches the table as ``s3a://`` or
``hdfs://`` (``sinks/delta/spark_features.py``, :func:`route`).

delta-spark makes the table in the job's own session (version 0), inserts ids
190-259 (version 1) and deletes ids 250-259 with a deletion vector (version 2);
the job then merges three batches (``tests/test_delta_s3_merge.py``'s
``BATCHES``: ids 0-199 written, ids 0-9 deleted). delta-spark reads back:

* the latest rows, the model's;
* versions 1 and 2 by time travel, as delta-spark left them;
* the change feed from the sink's claim on: replayed over version 2 it gives
  the latest rows, each change once (an update as its pre- and post-image
  with the value it replaced, a delete with the value it removed);
* row tracking: every row id once; the rows of version 1 keep their ids
  (below 70), those copied unchanged their commit version 1 too; new keys get
  fresh ids.

Nothing is left staged. On S3, delta-spark commits without a conditional PUT,
so the sink commits there through delta-spark only with
``other_writers="none"``: the same table is refused first with the default
(delta-spark's own commits in its history) and with ``"stopped"`` (the
route), naming what to pass.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from lifecycle.testing import jars, verify
from sinks import DeltaSink, PreflightError
from tests.procs import run_job
from tests.test_delta_s3 import job_args, nothing_left, s3_jars  # noqa: F401
from tests.test_delta_s3_merge import BATCHES, write_batches
from tests.test_delta_s3_writers import s3a_server  # noqa: F401
from tests.tiers import SLOW

FEATURES = (
    "'delta.enableDeletionVectors' = 'true', 'delta.enableChangeDataFeed' = 'true', "
    "'delta.enableRowTracking' = 'true', 'delta.columnMapping.mode' = 'name'"
)
MADE_BY_DELTA_SPARK = [
    "CREATE TABLE {table} (id BIGINT, name STRING, amount DOUBLE) USING delta "
    f"TBLPROPERTIES ({FEATURES})",
    "INSERT INTO {table} SELECT id, 'pre', CAST(id AS DOUBLE) FROM range(190, 260)",
    "DELETE FROM {table} WHERE id >= 250",
]
"""versions 0, 1 and 2 (a deletion vector)"""
CLAIM = 3
"""the sink's claim; its merges follow"""
INSERTED = 70
"""rows version 1 inserted: row ids 0-69"""
SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64())])

Row = tuple[str, float]


def before_the_job() -> dict[int, Row]:
    return {i: ("pre", float(i)) for i in range(190, 250)}


def model() -> dict[int, Row]:
    rows = before_the_job()
    for batch in BATCHES:
        for i, name, amount in batch:
            if amount < 0:
                rows.pop(i, None)
            else:
                rows[i] = (name, amount)
    return rows


def replay(start: dict[int, Row], changes: list[list[Any]]) -> dict[int, Row]:
    """``start`` with the change feed ``changes`` (``[id, type, version, name,
    amount]``) applied version by version, checking that each change is there
    once and that each pre-image and delete shows the row it replaced."""
    rows = dict(start)
    by_version: dict[int, list[list[Any]]] = defaultdict(list)
    for c in changes:
        by_version[c[2]].append(c)
    assert min(by_version) > CLAIM, f"changes before the sink's merges: {sorted(by_version)}"
    for version in sorted(by_version):
        kinds: dict[str, dict[int, Row]] = defaultdict(dict)
        for i, kind, _, name, amount in by_version[version]:
            assert i not in kinds[kind], f"{kind} of id {i} twice in version {version}"
            kinds[kind][i] = (name, amount)
        assert set(kinds["update_preimage"]) == set(kinds["update_postimage"]), version
        for i, was in [*kinds["update_preimage"].items(), *kinds["delete"].items()]:
            assert rows.get(i) == was, f"version {version}: id {i} was {rows.get(i)}, not {was}"
        for i in kinds["delete"]:
            del rows[i]
        for i in kinds["insert"]:
            assert i not in rows, f"version {version} inserts id {i}, which is there"
        rows.update(kinds["insert"])
        rows.update(kinds["update_postimage"])
    return rows


def check_read_back(read: dict[str, Any]) -> None:
    """What delta-spark read (``tests/jobs/delta_store_job.py``'s ``READ``)."""
    want = model()
    assert read["latest"] == sorted([i, *r] for i, r in want.items())
    assert read["versions"]["1"] == sorted([i, "pre", float(i)] for i in range(190, 260))
    assert read["versions"]["2"] == sorted([i, *r] for i, r in before_the_job().items())
    assert replay(before_the_job(), read["changes"]) == want
    ids = {i: (row_id, version) for i, row_id, version in read["row_ids"]}
    assert set(ids) == set(want)
    assert len({row_id for row_id, _ in ids.values()}) == len(ids), "a row id twice"
    for i, (row_id, version) in ids.items():
        if i in before_the_job():
            assert row_id < INSERTED, f"id {i} lost its row id {row_id}"
            if i >= 200:  # no batch wrote it: copied unchanged
                assert version == 1, f"id {i}, copied unchanged, has commit version {version}"
        else:
            assert row_id >= INSERTED, f"new id {i} took row id {row_id} of version 1"


def job_output(job: Any) -> dict[str, Any]:
    assert job.proc.returncode == 0, job.tail()
    result = job.result()
    assert result["committed"] and result["rows"] == {"load/orders": 310}, result
    return dict(json.loads(job.output().rsplit("READ ", 1)[1].splitlines()[0]))


READ_BACK = ["--keyed", "--versions", "1,2", "--changes-from", str(CLAIM)]


@pytest.mark.usefixtures("s3_jars")
def test_a_feature_table_on_s3_takes_merges_through_delta_spark_with_no_other_writer(
    s3a_server: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    server, bucket = s3a_server, "tables"
    write_batches(tmp_path / "in")
    plain = f"s3://{bucket}/plain"
    made = [
        *MADE_BY_DELTA_SPARK,
        f"CREATE TABLE delta.`s3a://{bucket}/plain` (id BIGINT, name STRING, amount DOUBLE) "
        "USING delta",
    ]
    job = run_job(
        "delta_store_job.py",
        [
            *job_args(server, bucket, tmp_path),
            *(a for sql in made for a in ("--delta-spark-sql", sql)),
            *READ_BACK,
            "--other-writers",
            "none",
        ],
        tmp_path / "job.log",
        timeout=400,
    )
    check_read_back(job_output(job))
    nothing_left(server, bucket)

    # without other_writers="none", the sink refuses before it writes: the
    # feature table for its route ("stopped" says only that other engines
    # write between runs), the plain one for delta-spark's commit in its history
    options = server.storage_options()
    uri = f"s3://{bucket}/orders"
    for other in ("check", "stopped"):
        for sink in (
            DeltaSink(uri, storage_options=options, key=["id"], other_writers=other),
            DeltaSink(uri, storage_options=options, other_writers=other),  # row tracking
        ):
            with pytest.raises(PreflightError, match=r"'rowTracking'\].*through delta-spark") as e:
                sink.preflight(SCHEMA)
            assert "which needs other_writers='none' on S3" in str(e.value)
            assert server.secret_key not in str(e.value)
    with pytest.raises(PreflightError, match="version 0 was committed by Apache-Spark/") as e:
        DeltaSink(plain, storage_options=options).preflight(SCHEMA)
    assert "Delta-Lake/" in str(e.value) and "other_writers='stopped'" in str(e.value)
    DeltaSink(plain, storage_options=options, other_writers="stopped").preflight(SCHEMA)
    DeltaSink(plain, storage_options=options, other_writers="none").preflight(SCHEMA)
    with pytest.raises(Exception, match="other_writers='sometimes'"):
        DeltaSink(plain, other_writers="sometimes")
    assert DeltaTable(plain, storage_options=options).version() == 0, "preflight committed"
    nothing_left(server, bucket, "plain")


@SLOW  # HDFS needs no declaration: delta-spark's route is the S3 test's, with HDFSLogStore
def test_a_feature_table_on_hdfs_takes_merges_through_delta_spark(
    twophase_hdfs: Any, tmp_path: Path
) -> None:
    jars.require("delta")
    uri = f"{twophase_hdfs.uri}/tables/features"
    write_batches(tmp_path / "in")
    made = [a for sql in MADE_BY_DELTA_SPARK for a in ("--delta-spark-sql", sql)]
    args = ["--input", str(tmp_path / "in"), "--state", str(tmp_path / "state"), "--table", uri]
    job = run_job(
        "delta_store_job.py", [*args, *made, *READ_BACK], tmp_path / "job.log", timeout=400
    )
    check_read_back(job_output(job))
    verify.assert_nothing_left_delta(uri)


@SLOW  # a second job on S3 (about 60 s); the route's commits are the merge test's above
@pytest.mark.usefixtures("s3_jars")
def test_a_partition_replace_of_a_feature_table_on_s3_goes_through_delta_spark(
    s3a_server: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A partitioned feature table (ids 0-99 in ``v0``, 100-199 in ``v1``, ids
    190-199 then deleted by a deletion vector): a backfill replaces ``v1``
    with ids 100-149 and new amounts in one version. ``v0`` is untouched,
    delta-spark reads the table, its earlier versions and a change feed that
    replays to it (the slice's live rows deleted once, the new rows inserted),
    every row id once, and nothing is left staged."""
    server, bucket = s3a_server, "tables"
    second = [(i, "v1", i + 0.25) for i in range(100, 150)]
    (tmp_path / "in").mkdir()
    lines = [json.dumps({"id": i, "name": v, "amount": a}) for i, v, a in second]
    (tmp_path / "in" / "part-00000.json").write_text("\n".join(lines) + "\n")
    made = [
        "CREATE TABLE {table} (id BIGINT, name STRING, amount DOUBLE) USING delta "
        f"PARTITIONED BY (name) TBLPROPERTIES ({FEATURES})",
        "INSERT INTO {table} SELECT id, IF(id < 100, 'v0', 'v1'), CAST(id AS DOUBLE) "
        "FROM range(0, 200)",
        "DELETE FROM {table} WHERE id >= 190",
    ]
    args = [
        *job_args(server, bucket, tmp_path),
        *(a for sql in made for a in ("--delta-spark-sql", sql)),
        *("--partition-by", "name", "--replace-where", "name = 'v1'", "--other-writers", "none"),
        *("--versions", "1,2", "--changes-from", str(CLAIM), "--sink-id", "v1"),
    ]
    job = run_job("delta_store_job.py", args, tmp_path / "job.log", timeout=400)
    assert job.proc.returncode == 0, job.tail()
    read = json.loads(job.output().rsplit("READ ", 1)[1].splitlines()[0])
    inserted = {i: ("v0" if i < 100 else "v1", float(i)) for i in range(200)}
    at_2 = {i: r for i, r in inserted.items() if i < 190}
    want = {i: r for i, r in at_2.items() if i < 100} | {i: (v, a) for i, v, a in second}
    assert read["latest"] == sorted([i, *r] for i, r in want.items())
    assert read["versions"]["1"] == sorted([i, *r] for i, r in inserted.items())
    assert read["versions"]["2"] == sorted([i, *r] for i, r in at_2.items())
    assert replay(at_2, read["changes"]) == want
    row_ids = [row_id for _, row_id, _ in read["row_ids"]]
    assert len(set(row_ids)) == len(row_ids) == len(want), "a row id twice"
    nothing_left(server, bucket)
