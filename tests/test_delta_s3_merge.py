"""Keyed merges on S3: ``DeltaSink("s3://...", key=["id"])`` on S3Proxy.

A bounded job (``tests/jobs/delta_store_job.py --keyed``) reads three files,
one micro-batch each, that insert, update and delete keys: batch 0 writes
ids 0-99, batch 1 rewrites ids 50-149, batch 2 rewrites ids 100-199 and
deletes ids 0-9 (a negative amount). Every checkpoint commits one merge
version (of one batch, or of two when a checkpoint covers both), read and
staged by Spark's tasks through the sink's own store
(``sinks/delta/task_io.py``): no S3A in the merge, no rename. This process
then checks, from the store itself, that deltalake reads each key once with
its last write and no deleted key, that each merge version records its
change rows (``twophaseMerge``), that nothing is left under ``_twophase/``
and no data file no version added; and the job's own session, through S3A,
that delta-spark reads the same rows, and version 2 (the first checkpoint)
as it was; unpartitioned, and partitioned by ``name`` (the batch's ``v0``,
``v1``, ``v2``) so the merge plans by partition too (both in the slow tier).

The crash test SIGKILLs the driver once the last merge's files are staged on
S3, before its version is written, and starts the job again. A partition
replace (``replace_where``) on S3 is here too, in the slow tier.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from lifecycle.testing import verify
from tests.procs import run_job
from tests.test_delta_s3 import job_args, nothing_left, rows_of, s3_jars  # noqa: F401
from tests.tiers import SLOW

BATCHES = [
    [(i, "v0", float(i)) for i in range(100)],
    [(i, "v1", float(i)) for i in range(50, 150)],
    [(i, "v2", float(i)) for i in range(100, 200)] + [(i, "v2", -1.0) for i in range(10)],
]


def expected() -> list[list[Any]]:
    last: dict[int, tuple[int, str, float]] = {}
    for batch in BATCHES:
        for row in batch:
            if row[2] < 0:
                last.pop(row[0], None)
            else:
                last[row[0]] = row
    return sorted([list(r) for r in last.values()])


def write_batches(directory: Path) -> None:
    directory.mkdir(parents=True)
    for n, batch in enumerate(BATCHES):
        lines = [json.dumps({"id": i, "name": v, "amount": a}) for i, v, a in batch]
        (directory / f"part-{n:05d}.json").write_text("\n".join(lines) + "\n")


@pytest.mark.usefixtures("s3_jars")
@pytest.mark.parametrize(
    "partition_by",
    [
        # the default run's merges on S3 are the crash test's below (rows exact after it)
        pytest.param(None, id="unpartitioned", marks=SLOW),
        pytest.param("name", id="partitioned", marks=SLOW),
    ],
)
def test_keyed_merges_on_s3_are_exact_and_delta_spark_reads_them(
    twophase_s3: Any, twophase_s3_bucket: str, tmp_path: Path, partition_by: str | None
) -> None:
    server, bucket = twophase_s3, twophase_s3_bucket
    write_batches(tmp_path / "in")
    args = [
        *job_args(server, bucket, tmp_path),
        "--keyed",
    ]
    if partition_by:
        args += ["--partition-by", partition_by]
    job = run_job("delta_store_job.py", args, tmp_path / "job.log", timeout=400)
    assert job.proc.returncode == 0, job.tail()
    result = job.result()
    assert result["committed"] and result["rows"] == {"load/orders": 310}, result
    read = json.loads(job.output().rsplit("READ ", 1)[1].splitlines()[0])

    uri = f"s3://{bucket}/orders"
    want = expected()
    assert len(want) == 190
    assert rows_of(server, uri) == want
    assert read["latest"] == want, "delta-spark reads other rows than deltalake"
    assert read["versions"]["2"] == sorted([list(r) for r in BATCHES[0]])
    history = sorted(
        DeltaTable(uri, storage_options=server.storage_options()).history(),
        key=lambda h: h["version"],
    )
    merges = [h for h in history if "twophaseMerge" in h]
    # one merge per checkpoint, of the batches it covers (a checkpoint may cover two)
    batches = [h["twophaseBatch"] for h in merges]
    assert batches[0] == 0 and batches[-1] == 2 and batches == sorted(set(batches)), history
    changed = [sum(json.loads(h["twophaseMerge"])["changes"].values()) for h in merges]
    assert changed[0] == 100 and sum(changed) == 310, merges
    rewritten = [json.loads(h["twophaseMerge"])["filesRemoved"] for h in merges]
    assert all(n > 0 for n in rewritten[1:]), f"a later merge rewrote no file: {merges}"
    nothing_left(server, bucket)


@pytest.mark.crash
@pytest.mark.usefixtures("s3_jars")
def test_a_driver_killed_with_a_merge_staged_on_s3_restarts_exact_and_sweeps_it(
    twophase_s3: Any, twophase_s3_bucket: str, tmp_path: Path
) -> None:
    """The driver is SIGKILLed after the last merge's tasks staged its files on
    S3, before its version is written. The restart plans and commits the merge
    again; the killed attempt's files, found by their markers with listing
    alone, are deleted: nothing staged is left, no data file no version added,
    and the table holds each key's last write once."""
    server, bucket = twophase_s3, twophase_s3_bucket
    write_batches(tmp_path / "in")
    args = [
        *job_args(server, bucket, tmp_path),
        "--keyed",
        "--no-read-back",
    ]
    killed = run_job(
        "delta_store_job.py", args, tmp_path / "job.log", fault="driver.merge_staged@2=kill"
    )
    assert killed.proc.returncode == -9, killed.tail()
    staged = verify.staged_delta(f"s3://{bucket}/orders", storage_options=server.storage_options())
    assert staged, "the killed driver left nothing staged: the test shows nothing"
    again = run_job("delta_store_job.py", args, tmp_path / "job.log", timeout=400)
    assert again.proc.returncode == 0, again.tail()
    assert rows_of(server, f"s3://{bucket}/orders") == expected()
    nothing_left(server, bucket)


@SLOW  # two jobs (50 s); the replace's commit is the driver's deltalake work, as on a local table
@pytest.mark.usefixtures("s3_jars")
def test_a_partition_replace_on_s3_replaces_its_slice_alone(
    twophase_s3: Any, twophase_s3_bucket: str, tmp_path: Path
) -> None:
    """A job appends partitions ``v0`` and ``v1``; a second job (a backfill
    with ``replace_where="name = 'v1'"``) replaces ``v1`` with half its ids
    and new amounts, in one version; ``v0`` is untouched, delta-spark reads
    the same, and nothing is left staged."""
    server, bucket = twophase_s3, twophase_s3_bucket
    first = [(i, "v0" if i < 100 else "v1", float(i)) for i in range(200)]
    second = [(i, "v1", i + 0.25) for i in range(100, 150)]
    for name, rows in (("first", first), ("second", second)):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"id": i, "name": v, "amount": a}) for i, v, a in rows]
        (tmp_path / name / "part-00000.json").write_text("\n".join(lines) + "\n")

    def run(name: str, *extra: str) -> dict[str, Any]:
        args = [
            *job_args(server, bucket, tmp_path, source=name, state=str(tmp_path / f"state-{name}")),
            "--partition-by",
            "name",
            *extra,
        ]
        job = run_job("delta_store_job.py", args, tmp_path / f"{name}.log", timeout=400)
        assert job.proc.returncode == 0, job.tail()
        out = job.output()
        return dict(json.loads(out.rsplit("READ ", 1)[1].splitlines()[0])) if "READ " in out else {}

    run("first", "--no-read-back")
    read = run("second", "--replace-where", "name = 'v1'", "--versions", "", "--sink-id", "v1")
    uri = f"s3://{bucket}/orders"
    want = sorted([list(r) for r in first if r[1] == "v0"] + [list(r) for r in second])
    assert rows_of(server, uri) == want
    assert read["latest"] == want, "delta-spark reads other rows than deltalake"
    history = DeltaTable(uri, storage_options=server.storage_options()).history(1)
    assert history[0]["operation"] == "WRITE" and history[0].get("twophaseBatch") == 0, history
    nothing_left(server, bucket)
