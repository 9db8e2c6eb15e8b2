"""The Delta sink on HDFS: ``DeltaSink("hdfs://...")`` on a real NameNode and
DataNode (Hadoop's minicluster, ``lifecycle/testing/hdfs.py``).

deltalake writes the table through its own HDFS client (``hdfs-native``),
delta-spark reads it back through the HDFS client pyspark bundles, in the job's
own session (``tests/jobs/delta_store_job.py``): appends, three checkpoints,
every row once, time travel to the first checkpoint; keyed merges (inserts,
updates, deletes), whose file work runs in Spark's tasks through the sink's
store (``sinks/delta/task_io.py``) as on S3 (slow tier). Nothing is left under
``_twophase/`` and no data file lies outside the log's adds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from deltalake import DeltaTable

from lifecycle.testing import jars, verify
from lifecycle.testing.verify import assert_keys_once
from tests.conftest import write_input
from tests.procs import run_job
from tests.test_delta_s3_merge import BATCHES, expected, write_batches
from tests.tiers import SLOW


@pytest.fixture
def table_uri(twophase_hdfs: Any, request: pytest.FixtureRequest) -> str:
    jars.require("delta")
    return f"{twophase_hdfs.uri}/tables/{request.node.name.split('[')[0][-40:]}"


def rows_of(uri: str, version: int | None = None) -> list[list[Any]]:
    t = DeltaTable(uri, version=version).to_pyarrow_table()
    columns = (t.column(c).to_pylist() for c in ("id", "name", "amount"))
    return sorted(list(r) for r in zip(*columns, strict=True))


def run(uri: str, tmp_path: Path, *extra: str) -> dict[str, Any]:
    args = ["--input", str(tmp_path / "in"), "--state", str(tmp_path / "state")]
    job = run_job(
        "delta_store_job.py", [*args, "--table", uri, *extra], tmp_path / "job.log", timeout=400
    )
    assert job.proc.returncode == 0, job.tail()
    read = json.loads(job.output().rsplit("READ ", 1)[1].splitlines()[0])
    return {"result": job.result(), "read": read}


def test_appends_on_hdfs_are_exact_and_delta_spark_reads_every_version(
    table_uri: str, tmp_path: Path
) -> None:
    assert urlparse(table_uri).scheme == "hdfs"
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    got = run(table_uri, tmp_path)
    assert got["result"]["rows"] == {"load/orders": n}
    latest = rows_of(table_uri)
    assert_keys_once(f"Delta table {table_uri}", [r[0] for r in latest], range(n))
    assert got["read"]["latest"] == latest
    assert (
        got["read"]["versions"]["2"] == rows_of(table_uri, 2) and len(rows_of(table_uri, 2)) == 100
    )
    history = sorted(DeltaTable(table_uri).history(), key=lambda h: h["version"])
    assert [h.get("twophaseBatch") for h in history[2:]] == [0, 1, 2], history
    data = verify.data_files_delta(table_uri)
    assert len(data) >= 3, f"the listing sees no data files: {data}"
    verify.assert_nothing_left_delta(table_uri)


@SLOW  # the merge's file work is sinks/delta/task_io.py's, as on S3 (tested there by default)
def test_keyed_merges_on_hdfs_are_exact_and_delta_spark_reads_them(
    table_uri: str, tmp_path: Path
) -> None:
    write_batches(tmp_path / "in")
    got = run(table_uri, tmp_path, "--keyed")
    assert rows_of(table_uri) == expected()
    assert got["read"]["latest"] == expected()
    assert got["read"]["versions"]["2"] == sorted([list(r) for r in BATCHES[0]])
    verify.assert_nothing_left_delta(table_uri)
