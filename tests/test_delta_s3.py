"""End to end on S3: a bounded job writes ``DeltaSink("s3://bucket/orders")`` on
the tests' S3 server (S3Proxy, ``lifecycle/testing/s3proxy.py``), and
delta-spark reads the table back through Hadoop's S3A (``s3a://``), the way a
Spark user of the table reads it in production.

The job and the read run in one driver process of their own
(``tests/jobs/delta_store_job.py``): its session needs S3A's jars on the driver's
classpath, which the suite's session (one SparkContext per process) was started
without. This process then checks the table from the store itself: deltalake
reads every row once, the versions are the sink's (creation, claim, one per
checkpoint), delta-spark's reads of versions 0, 1 and 2 (time travel) match
deltalake's, and no staged file or marker is left in the bucket
(``lifecycle.testing.verify``'s Delta checks, given the bucket's
``storage_options``).

In the slow tier the job's ``state_dir`` is on ``s3a://`` as well (Spark's
checkpoints through S3A, and the ledger: each record a conditional PUT), on an
S3Proxy whose store keeps S3A's directory markers (``transient``: its
filesystem stores do not, see docs/testing.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from lifecycle.testing import jars, verify
from lifecycle.testing.verify import assert_keys_once
from tests.conftest import write_input
from tests.procs import ROOT, crash_delta_store_job, run_job, twophase
from tests.tiers import SLOW


def keys(server: Any, bucket: str, prefix: str) -> list[str]:
    """Every key of the bucket under ``prefix`` (relative to it)."""
    out: list[str] = []
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for page in pages:
        out += [o["Key"].removeprefix(prefix) for o in page.get("Contents", [])]
    return sorted(out)


def nothing_left(server: Any, bucket: str, table: str = "orders") -> None:
    """No staged file, marker or change file of the sink left in the table:
    the kit's verifier (:func:`lifecycle.testing.verify.staged_delta`), reading
    the bucket through deltalake's store."""
    left = verify.staged_delta(f"s3://{bucket}/{table}", storage_options=server.storage_options())
    assert left == [], left


@pytest.fixture
def s3_jars() -> None:
    jars.require("delta")
    jars.require("s3a")


def job_args(
    server: Any,
    bucket: str,
    tmp_path: Path,
    *,
    endpoint: str | None = None,
    state: str | None = None,
    source: str = "in",
) -> list[str]:
    """The arguments of ``tests/jobs/delta_store_job.py`` for a job from
    ``tmp_path/source`` into ``s3://bucket/orders`` on ``server`` (through
    ``endpoint``, a proxy's, when given), its state in ``state`` (default
    ``tmp_path/state``)."""
    return [
        "--input",
        str(tmp_path / source),
        "--state",
        state or str(tmp_path / "state"),
        "--table",
        f"s3://{bucket}/orders",
        "--endpoint",
        endpoint or server.endpoint,
        "--access-key",
        server.access_key,
        "--secret-key",
        server.secret_key,
        "--region",
        server.region,
    ]


def run(server: Any, bucket: str, tmp_path: Path, state: str, n_files: int = 3) -> dict[str, Any]:
    """Run the job (``state``: ``"local"`` or ``"s3"``); return what it printed."""
    n = write_input(tmp_path / "in", files=n_files, rows_per_file=100)
    state_args = {"state": f"s3a://{bucket}/state"} if state == "s3" else {}
    job = run_job(
        "delta_store_job.py",
        job_args(server, bucket, tmp_path, **state_args),
        tmp_path / "job.log",
        timeout=300,
    )
    assert job.proc.returncode == 0, job.tail()
    result = job.result()
    assert result["committed"] and result["rows"] == {"load/orders": n}, result
    read = json.loads(job.output().rsplit("READ ", 1)[1].splitlines()[0])
    print(f"seconds of the driver: {read['seconds']}")
    return {"n": n, "result": result, "read": read}


def rows_of(server: Any, uri: str, version: int | None = None) -> list[list[Any]]:
    """The rows deltalake reads of the table at ``uri`` (at ``version``), sorted."""
    t = DeltaTable(uri, storage_options=server.storage_options(), version=version)
    data = t.to_pyarrow_table()
    columns = (data.column(c).to_pylist() for c in ("id", "name", "amount"))
    return sorted(list(r) for r in zip(*columns, strict=True))


def check_log(server: Any, bucket: str, n: int) -> None:
    """Every row once, the sink's versions, nothing staged left (deltalake
    and the bucket's listing)."""
    uri = f"s3://{bucket}/orders"
    latest = rows_of(server, uri)
    assert_keys_once(f"Delta table {uri}", [r[0] for r in latest], range(n))
    assert latest == [[i, f"name-{i}", i * 0.5] for i in range(n)]
    # the sink's versions: creation, its claim, then one per checkpoint (a batch each)
    dt = DeltaTable(uri, storage_options=server.storage_options())
    history = sorted(dt.history(), key=lambda h: h["version"])
    assert [h["operation"] for h in history] == ["CREATE TABLE"] + ["WRITE"] * (1 + n // 100)
    assert [h.get("twophaseBatch") for h in history[2:]] == list(range(n // 100)), history
    nothing_left(server, bucket)


def check_table(server: Any, bucket: str, got: dict[str, Any]) -> None:
    """:func:`check_log`, and delta-spark's reads (latest and time travel)
    equal deltalake's."""
    n, read = got["n"], got["read"]
    uri = f"s3://{bucket}/orders"
    check_log(server, bucket, n)
    assert read["latest"] == rows_of(server, uri)
    assert read["versions"]["0"] == [] and read["versions"]["1"] == []  # creation, claim
    assert read["versions"]["2"] == rows_of(server, uri, 2)  # the first checkpoint
    assert len(read["versions"]["2"]) == 100


@SLOW  # for CI time: appends on S3 are exact in the default run's crash tests below, and
# delta-spark reads through s3a there in test_delta_features_on_stores.py
@pytest.mark.usefixtures("s3_jars")
def test_a_job_writes_s3_and_delta_spark_reads_it_through_s3a(
    twophase_s3: Any, twophase_s3_bucket: str, tmp_path: Path
) -> None:
    got = run(twophase_s3, twophase_s3_bucket, tmp_path, "local")
    check_table(twophase_s3, twophase_s3_bucket, got)


@SLOW
@pytest.mark.usefixtures("s3_jars")
def test_a_job_with_its_state_on_s3a(tmp_path: Path) -> None:
    """Spark's checkpoints and the job's control files through S3A, on a
    store that keeps S3A's directory markers."""
    from lifecycle.testing.s3proxy import S3Proxy

    jars.require("s3proxy")
    with S3Proxy(provider="transient") as server:
        server.create_bucket("jobs")
        got = run(server, "jobs", tmp_path, "s3")
        check_table(server, "jobs", got)
        state = keys(server, "jobs", "state/")
        assert "pipelines/load/spark/commits/2" in state, state


@SLOW  # rule 5's in-run replay is the default run's (tests/test_lost_work.py, PostgreSQL)
@pytest.mark.crash
def test_staged_files_a_vacuum_removed_on_s3_are_written_again_from_the_source(
    twophase_s3: Any, twophase_s3_bucket: str, tmp_path: Path
) -> None:
    """deltalake's full VACUUM with no retention, run on the S3 table while the
    driver waits before the second checkpoint's commit, deletes the files the
    sink staged for it (the log references none of them yet). The commit finds
    them gone, commits nothing of them, and the run writes the batch again from
    the source: every row once, nothing left staged, nothing owed."""
    from lifecycle.ledger import read_ledger
    from tests.procs import JobProcess, wait_for

    server, bucket = twophase_s3, twophase_s3_bucket
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    job = JobProcess(
        "delta_store_job.py",
        [*job_args(server, bucket, tmp_path), "--no-read-back"],
        tmp_path / "job.log",
        fault="driver.before_commit@1+once=stall:8",
        env={"TWOPHASE_FAULT_TOKENS": str(tokens)},
    )
    wait_for(lambda: any(tokens.iterdir()), 300, "the driver reached its commit", job)
    gone = DeltaTable(f"s3://{bucket}/orders", storage_options=server.storage_options()).vacuum(
        retention_hours=0, dry_run=False, enforce_retention_duration=False, full=True
    )
    assert any(g.endswith(".parquet") for g in gone), f"the VACUUM removed no staged file: {gone}"
    job.wait(400)
    assert job.proc.returncode == 0, job.tail()
    latest = rows_of(server, f"s3://{bucket}/orders")
    assert latest == [[i, f"name-{i}", i * 0.5] for i in range(n)]
    nothing_left(server, bucket)
    doc = read_ledger(tmp_path / "state")
    assert doc is not None and doc["owed"] == {} and doc["pending"] == {}


def _twophase(server: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """``twophase ARGS`` in a process of its own whose JVM has S3A's jars and
    settings for ``server`` (``PYSPARK_SUBMIT_ARGS``, as an operator's shell
    would give them), and the table's credentials in the environment (the
    state records neither the key id nor the secret)."""
    submit = ["--driver-class-path", os.pathsep.join(str(p) for p in jars.jars("s3a"))]
    for k, v in server.spark_conf().items():
        submit += ["--conf", f"{k}={v}"]
    env = {
        "PYSPARK_SUBMIT_ARGS": " ".join([*submit, "pyspark-shell"]),
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
    }
    return twophase(*args, env=env, cwd=ROOT)


@SLOW
@pytest.mark.crash
@pytest.mark.usefixtures("s3_jars")
@pytest.mark.parametrize("fault", ["driver.after_record@1=kill", "driver.before_commit@1=kill"])
def test_a_killed_driver_restarts_elsewhere_from_its_state_on_s3a(
    tmp_path: Path, fault: str
) -> None:
    """The job's state on ``s3a://`` (Spark's checkpoints, its control files and
    its ledger: the store ledger, each record a conditional PUT through S3A):
    the driver is SIGKILLed right after the ledger recorded batch 1, or with
    the checkpoint of batch 1 decided; ``twophase status`` reads the state from
    S3 and says DIED; ``twophase recover`` commits what was decided (or finds
    nothing to); the job started again from another working directory
    finishes exactly once, and ``twophase audit`` finds the table's records
    match the ledger's."""
    from lifecycle.testing.s3proxy import S3Proxy

    jars.require("s3proxy")
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    with S3Proxy(provider="transient") as server:
        server.create_bucket("jobs")
        args = job_args(server, "jobs", tmp_path, state="s3a://jobs/state")
        killed = run_job("delta_store_job.py", args, tmp_path / "job.log", fault=fault)
        assert killed.proc.returncode == -9, killed.tail()
        ledger = keys(server, "jobs", "state/ledger/")
        assert any(k.startswith("journal.0/") for k in ledger), ledger
        status = _twophase(server, "status", "s3a://jobs/state")
        assert status.returncode == 3, status.stdout + status.stderr
        assert "state: DIED" in status.stdout, status.stdout
        recover = _twophase(server, "recover", "s3a://jobs/state")
        assert recover.returncode == 0, recover.stdout + recover.stderr
        decided = "before_commit" in fault
        committed = re.search(r"checkpoint \d+ \(\w+\) committed", recover.stdout)
        assert (committed is not None) == decided, recover.stdout  # else: aborted
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        again = run_job("delta_store_job.py", args, tmp_path / "job.log", cwd=elsewhere)
        assert again.proc.returncode == 0, again.tail()
        latest = rows_of(server, "s3://jobs/orders")
        assert latest == [[i, f"name-{i}", i * 0.5] for i in range(n)]
        nothing_left(server, "jobs")
        audit = _twophase(server, "audit", "s3a://jobs/state")
        assert audit.returncode == 0, audit.stdout + audit.stderr
        assert " ok" in audit.stdout, audit.stdout
        out = status.stdout + status.stderr + recover.stdout + audit.stdout
        assert server.secret_key not in out


@SLOW
@pytest.mark.crash
@pytest.mark.usefixtures("s3_jars")
def test_everything_on_s3_survives_random_kills_from_fresh_hosts(tmp_path: Path) -> None:
    """The table on ``s3://``, Spark's checkpoints and the ledger on ``s3a://``:
    four kills, at random instants and at the named points, every start on a
    fresh host (``crash_test(fresh_host=True)``), then a run to the end: every
    row once, nothing staged, ``twophase audit`` ok."""
    from lifecycle.testing.s3proxy import S3Proxy

    jars.require("s3proxy")
    n = write_input(tmp_path / "in", files=12, rows_per_file=25)  # a batch a file
    with S3Proxy(provider="transient") as server:
        server.create_bucket("jobs")
        args = [*job_args(server, "jobs", tmp_path, state="s3a://jobs/state"), "--no-read-back"]
        crash_delta_store_job(args, tmp_path / "crash.log")
        latest = rows_of(server, "s3://jobs/orders")
        assert latest == [[i, f"name-{i}", i * 0.5] for i in range(n)]
        nothing_left(server, "jobs")
        audit = _twophase(server, "audit", "s3a://jobs/state")
        assert audit.returncode == 0 and " ok" in audit.stdout, audit.stdout + audit.stderr
