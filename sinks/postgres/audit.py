"""Audit of the PostgreSQL sink: each committed transaction's commit-marker row.

Every transaction the sink prepares inserts a row into the marker table (its
gid, job, batch and row count) inside the transaction itself, so the row is
visible exactly when the transaction committed. The sink keeps the markers of
the checkpoints whose evidence the ledger keeps (see
:meth:`sinks.postgres.committer.PreparedCommitter.retire_evidence`); the audit reads them.

Verdicts (:class:`sinks.audit.Verdict`): ``ok`` when the marker is there with
the batch and row count the ledger says; ``mismatch`` when it is missing (the
transaction did not commit, or someone deleted the row) or says other numbers;
``unverifiable`` for a marker written by a version that did not record them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql

from sinks.audit import CheckpointEvidence, Finding, Verdict
from sinks.naming import TxnName


def evidence(c: Mapping[str, Any]) -> dict[str, Any]:
    """What the ledger keeps of a committed PostgreSQL committable for an audit."""
    return {"txn": c["txn"], "rows": int(c.get("rows", 0))}


def audit(
    conn: psycopg.Connection,
    markers: sql.Composable,
    checkpoints: Sequence[CheckpointEvidence],
    *,
    columns: bool = True,
) -> list[Finding]:
    """Check every committable of ``checkpoints`` against its marker row
    (``columns``: whether the marker table has the batch and rows columns)."""
    gids = [str(c["txn"]) for cp in checkpoints for c in cp.committed]
    query = "SELECT gid, batch, rows FROM {}" if columns else "SELECT gid, NULL, NULL FROM {}"
    rows = conn.execute(sql.SQL(query + " WHERE gid = ANY(%s)").format(markers), (gids,)).fetchall()
    marked = {gid: (batch, n) for gid, batch, n in rows}
    found: list[Finding] = []
    for cp in checkpoints:
        for c in cp.committed:
            gid, want = str(c["txn"]), int(c.get("rows", 0))
            found.append(_check(cp.checkpoint, gid, want, marked.get(gid)))
    return found


def _check(
    checkpoint: int, gid: str, want: int, marker: tuple[int | None, int | None] | None
) -> Finding:
    if marker is None:
        return Finding(
            checkpoint,
            gid,
            Verdict.MISMATCH,
            "no commit-marker row: the transaction did not commit, or its row was deleted",
            want,
        )
    batch, rows = marker
    if rows is None or batch is None:
        return Finding(
            checkpoint, gid, Verdict.UNVERIFIABLE, "a marker without batch and rows", want
        )
    expected_batch = TxnName.require(gid).batch_id
    if batch != expected_batch or rows != want:
        return Finding(
            checkpoint,
            gid,
            Verdict.MISMATCH,
            f"the marker says batch {batch} and {rows} row(s); the ledger says batch "
            f"{expected_batch} and {want} row(s)",
            want,
        )
    return Finding(checkpoint, gid, Verdict.OK, "", want)
