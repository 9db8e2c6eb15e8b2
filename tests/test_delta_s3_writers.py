"""Concurrent writers of one Delta table on S3 (``sinks/delta/s3_writers.py``).

On S3 a commit is safe only when every writer of the table creates its
version with a conditional PUT: deltalake does, delta-spark does not. So:

* a table that delta-spark wrote is refused at the sink's preflight, naming
  the version, the engine and what to configure, and accepted once the user
  says delta-spark's writes are stopped while the job runs
  (``other_writers="stopped"``): ``tests/test_delta_features_on_stores.py``,
  beside the sink's own commits through delta-spark on S3;
* two sink jobs racing for the same versions on a store whose conditional PUT
  is atomic (moto's server; S3Proxy checks before it writes, see
  docs/testing.md) lose no commit and overwrite no version: a proxy holds
  every PUT of a log entry until both writers have sent theirs, so they do
  race, and it counts the 412 answers that prove it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from lifecycle.testing import jars, verify
from sinks.delta import s3_writers
from tests.conftest import write_input
from tests.procs import JobProcess, run_job
from tests.test_delta_s3 import check_log, job_args, nothing_left, s3_jars  # noqa: F401
from tests.tiers import SLOW

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64())])


def test_engines_are_told_apart_by_their_commit_info() -> None:
    safe = "delta-rs:py-1.6.6"
    assert s3_writers.commits_by_conditional_put(safe)
    for engine in ("Apache-Spark/4.2.0 Delta-Lake/4.4.0", "delta-rs.py-0.25.5", "Trino/460", ""):
        assert not s3_writers.commits_by_conditional_put(engine), engine
    history = [
        {"version": 3, "engineInfo": safe},
        {"version": 2, "engineInfo": "Apache-Spark/4.2.0 Delta-Lake/4.4.0"},
        {"version": 1, "clientVersion": "delta-rs.py-1.6.6"},
        {"version": 0},
    ]
    assert s3_writers.unsafe_commits(history) == [
        (2, "Apache-Spark/4.2.0 Delta-Lake/4.4.0"),
        (0, ""),
    ]
    assert s3_writers.needs_check("s3://b/t") and s3_writers.needs_check("S3A://b/t")
    assert not any(s3_writers.needs_check(u) for u in ("/data/t", "hdfs://nn/t", "gs://b/t"))


@pytest.fixture
def s3a_server() -> Iterator[Any]:
    """An S3Proxy whose store keeps S3A's directory markers (``transient``:
    delta-spark writes through S3A here; the file stores list its markers
    in a way deltalake refuses, docs/testing.md), with a bucket ``tables``."""
    from lifecycle.testing.s3proxy import S3Proxy

    jars.require("s3proxy")
    with S3Proxy(provider="transient") as server:
        server.create_bucket("tables")
        yield server


@SLOW  # two jobs at once (about 45 s); the refusal of the unsafe setup is the default run's
# (test_delta_features_on_stores.py)
def test_two_sink_jobs_racing_for_each_version_on_s3_lose_no_commit(tmp_path: Path) -> None:
    """Two jobs append to one table on moto's server through a
    :class:`~lifecycle.testing.s3faults.RacingProxy`: each PUT of a log entry
    waits for the other job's PUT of the same version (or 10 s), so the table's
    creation, the claims and the checkpoints' versions are raced for. The
    loser of each race is refused (412), reads the new version and commits the
    next: both jobs finish, every row of each once, each checkpoint's version
    once and in order, none overwritten."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    from lifecycle.testing.s3faults import RacingProxy
    from tests.s3server import S3Server

    with S3Server() as server, RacingProxy(server.endpoint, wait=10.0) as proxy:
        server.create_bucket("race")
        jobs = []
        for name, start in (("a", 0), ("b", 1000)):
            write_input(tmp_path / f"in-{name}", files=3, rows_per_file=20, start=start)
            args = job_args(
                server,
                "race",
                tmp_path,
                endpoint=proxy.endpoint,
                state=str(tmp_path / f"state-{name}"),
                source=f"in-{name}",
            )
            jobs.append(
                JobProcess(
                    "delta_store_job.py",
                    [*args, "--sink-id", f"orders-{name}", "--no-read-back"],
                    tmp_path / f"job-{name}.log",
                )
            )
        for name, job in zip("ab", jobs, strict=True):
            job.wait(400)
            assert job.proc.returncode == 0, job.tail()
            assert job.result()["rows"] == {f"load/orders-{name}": 60}, job.result()
        print(f"raced for {proxy.raced} versions; answers {dict(proxy.statuses)}")
        # at least the table's creation is raced for (both jobs start together)
        assert proxy.raced >= 1 and proxy.statuses[412] >= 1, (proxy.raced, proxy.statuses)

        options = {
            "AWS_ENDPOINT_URL": server.endpoint,
            "AWS_ACCESS_KEY_ID": server.access_key,
            "AWS_SECRET_ACCESS_KEY": server.secret_key,
            "AWS_REGION": server.region,
            "AWS_ALLOW_HTTP": "true",
        }
        uri = "s3://race/orders"
        dt = DeltaTable(uri, storage_options=options)
        ids = dt.to_pyarrow_table().column("id").to_pylist()
        assert sorted(ids) == [*range(60), *range(1000, 1060)], "a commit was lost or doubled"
        history = sorted(dt.history(), key=lambda h: h["version"])
        assert [h["version"] for h in history] == list(range(len(history)))
        batches = [(str(h.get("twophaseApp")), h.get("twophaseBatch")) for h in history]
        for name in ("a", "b"):
            mine = [b for app, b in batches if f"orders-{name}" in app and b is not None]
            assert mine and mine == sorted(set(mine)), (name, batches)  # once each, in order
        assert verify.staged_delta(uri, storage_options=options) == []


@SLOW  # two jobs and delta-spark's DML through S3A (about 2 minutes)
@pytest.mark.usefixtures("s3_jars")
def test_delta_spark_deletes_merges_and_optimizes_between_the_sinks_runs_on_s3(
    s3a_server: Any, tmp_path: Path
) -> None:
    """The setup ``other_writers="stopped"`` stands for: a sink job appends to
    ``s3://``; then, with no job running, delta-spark deletes rows, merges one
    in and compacts the table through ``s3a://``; then a second sink job,
    saying so, appends again. Every row is as the three writers left it, read
    by deltalake and by delta-spark."""
    server, bucket = s3a_server, "tables"
    uri = f"s3://{bucket}/orders"
    write_input(tmp_path / "in-a", files=2, rows_per_file=50)
    write_input(tmp_path / "in-b", files=2, rows_per_file=50, start=1000)
    first = run_job(
        "delta_store_job.py",
        [
            *job_args(server, bucket, tmp_path, state=str(tmp_path / "state-a"), source="in-a"),
            *("--sink-id", "orders-a", "--no-read-back"),
        ],
        tmp_path / "a.log",
        timeout=300,
    )
    assert first.proc.returncode == 0, first.tail()
    dml = [
        "DELETE FROM {table} WHERE id < 10",
        "MERGE INTO {table} t USING (SELECT 5L AS id, 'merged' AS name, 1.0D AS amount) s "
        "ON t.id = s.id WHEN NOT MATCHED THEN INSERT *",
        "OPTIMIZE {table}",
    ]
    second = run_job(
        "delta_store_job.py",
        [
            *job_args(server, bucket, tmp_path, state=str(tmp_path / "state-b"), source="in-b"),
            *("--sink-id", "orders-b", "--other-writers", "stopped", "--versions", ""),
            *(arg for statement in dml for arg in ("--delta-spark-sql", statement)),
        ],
        tmp_path / "b.log",
        timeout=400,
    )
    assert second.proc.returncode == 0, second.tail()
    expected = sorted([5, *range(10, 100), *range(1000, 1100)])
    dt = DeltaTable(uri, storage_options=server.storage_options())
    assert sorted(dt.to_pyarrow_table().column("id").to_pylist()) == expected
    operations = [h["operation"] for h in dt.history()]
    assert {"DELETE", "MERGE", "OPTIMIZE"} <= set(operations), operations
    read = json.loads(second.output().rsplit("READ ", 1)[1].splitlines()[0])
    assert sorted(r[0] for r in read["latest"]) == expected
    nothing_left(server, bucket)
