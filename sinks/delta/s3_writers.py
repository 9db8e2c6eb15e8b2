"""Who else commits to a Delta table on S3, and whether the sink may share it.

A Delta commit creates ``_delta_log/<version>.json``, and it must fail when
another writer created that version first. S3 has no rename that refuses an
existing name, so each writer needs one of two things:

* **a conditional PUT** (``If-None-Match: *``): the store itself refuses the
  second writer of a version. deltalake 1.x (delta-rs, the sink's committer)
  commits this way on S3 and needs no lock (``AWS_S3_LOCKING_PROVIDER`` and the
  DynamoDB lock were removed in 1.0);
* **a lock every writer of the table shares.** delta-spark has no conditional
  PUT on S3: ``S3SingleDriverLogStore`` (its default) checks that the version is
  free and then PUTs it unconditionally, which is safe only among the writers
  of one driver JVM, and ``S3DynamoDBLogStore`` serialises its writers through
  a DynamoDB table that deltalake no longer reads.

So on S3 a delta-spark job (OPTIMIZE, DELETE, MERGE, appends) that commits
while the sink commits can overwrite the sink's version, or the sink's
conditional PUT can land between delta-spark's check and its PUT and be
overwritten: either way a commit that reported success is lost. Other stores
make every engine's commit atomic (a local disk, HDFS: rename without
overwrite; GCS and Azure: their own create-if-absent) and need no check here.

:func:`check` runs at the sink's preflight on ``s3://`` and ``s3a://`` tables :
it reads the last :data:`HISTORY` versions' ``commitInfo`` and refuses the
table when one was committed by an engine not known to commit by conditional
PUT (anything but deltalake 1.x), naming the version and the engine and what
to configure. A team that runs such an engine only while the sink's job is
stopped (a nightly OPTIMIZE between runs) says so with
``DeltaSink(..., other_writers="stopped")``, and the check is skipped.

The sink itself is such an engine when it commits through delta-spark (tables
with features delta-rs cannot write, rewrites of tables with deletion vectors,
the change data feed or column mapping: :mod:`sinks.delta.spark_features`).
On S3 it does so only with ``other_writers="none"``: nothing else commits to
the table while the job runs, not even another deltalake writer, whose
conditional PUT delta-spark's unconditional one could overwrite.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

from deltalake import DeltaTable

log = logging.getLogger("sinks.delta")

HISTORY = 100
"""How many of the table's latest versions :func:`check` reads."""

OTHER_WRITERS = ("check", "stopped", "none")
"""``DeltaSink(other_writers=...)``: ``"check"`` (default) refuses an S3 table
that an engine without conditional PUTs wrote recently; ``"stopped"`` says no
such engine commits while the job runs; ``"none"`` says no other writer at all
commits while the job runs (the sink may then commit through delta-spark)."""

_S3_SCHEMES = ("s3://", "s3a://", "s3n://")
_DELTA_RS_PY = re.compile(r"^delta-rs[:.]py-(\d+)\.")


def needs_check(table_uri: str) -> bool:
    """Whether ``table_uri`` is on S3, where writers must commit by conditional PUT."""
    return table_uri.lower().startswith(_S3_SCHEMES)


def engine_of(commit: Mapping[str, Any]) -> str:
    """The engine a ``commitInfo`` names (``engineInfo``, else ``clientVersion``),
    ``""`` when it names none."""
    return str(commit.get("engineInfo") or commit.get("clientVersion") or "")


def commits_by_conditional_put(engine: str) -> bool:
    """Whether ``engine`` (an ``engineInfo``) commits to S3 by conditional PUT:
    deltalake (delta-rs' Python package) from 1.0 on."""
    found = _DELTA_RS_PY.match(engine)
    return found is not None and int(found.group(1)) >= 1


def unsafe_commits(history: Iterable[Mapping[str, Any]]) -> list[tuple[int, str]]:
    """``(version, engine)`` of each commit in ``history`` (deltalake's
    ``DeltaTable.history()``) by an engine without conditional PUTs, newest first."""
    found = [
        (int(h.get("version", -1)), engine_of(h))
        for h in history
        if not commits_by_conditional_put(engine_of(h))
    ]
    return sorted(found, reverse=True)


def check(dt: DeltaTable, where: str, other_writers: str) -> str | None:
    """Why ``dt`` cannot be shared with the writers its recent history shows,
    or ``None`` when it can, is not on S3, or ``other_writers`` says they are
    stopped."""
    if not needs_check(dt.table_uri) or other_writers in ("stopped", "none"):
        return None
    unsafe = unsafe_commits(dt.history(HISTORY))
    if not unsafe:
        return None
    version, engine = unsafe[0]
    others = f" and {len(unsafe) - 1} more of the last {HISTORY} versions" if unsafe[1:] else ""
    return (
        f"{where}: version {version}{others} was committed by "
        f"{engine or 'an engine that names none'}, which commits to S3 without a "
        "conditional PUT (delta-spark's S3SingleDriverLogStore checks, then overwrites; "
        "its S3DynamoDBLogStore locks in DynamoDB, which deltalake does not read). If it "
        "commits while this sink commits, one of the two versions can overwrite the "
        "other and a commit is lost. Run that engine's writes (OPTIMIZE, DELETE, MERGE, "
        "appends) only while this job is stopped and pass "
        "DeltaSink(..., other_writers='stopped'), or write the table with deltalake "
        "(1.0 or later) alone (docs: 'Concurrent writers on S3')"
    )
