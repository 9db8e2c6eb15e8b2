"""Audit of the Delta sink: each checkpoint's commit, found again in the table's log.

A checkpoint commits a sink's staged files as one Delta version whose
``commitInfo`` names the sink's application id and the highest batch id
(``twophaseApp``, ``twophaseBatch``) and which carries the app transaction
``txn(appId, version)``. The audit finds that version in the table's history,
reads its commit file, and checks that it adds exactly the files the ledger
kept for each transaction, with ``numRecords`` (the add action's statistics)
summing to the transaction's rows.

Verdicts (:class:`sinks.audit.Verdict`): ``ok``; ``expired`` when no version
names the commit and the log no longer reaches back to the checkpoint's time
(log cleanup after a Delta checkpoint removed it); ``mismatch`` otherwise (no
such version, a file missing from it, rows that differ). Later versions that
remove the files (OPTIMIZE, VACUUM, a delete) do not matter: the commit's own
version is the evidence.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote

from deltalake import DeltaTable

from sinks.audit import CheckpointEvidence, Finding, Verdict
from sinks.delta import progress
from sinks.delta.storage import TableStorage
from sinks.naming import TxnName


def evidence(c: Mapping[str, Any]) -> dict[str, Any]:
    """What the ledger keeps of a committed Delta committable for an audit (a
    keyed sink's: that it was merged, and its rows of changes)."""
    if c.get("changes"):
        return {"txn": c["txn"], "rows": int(c.get("rows", 0)), "merge": True}
    return {
        "txn": c["txn"],
        "rows": int(c.get("rows", 0)),
        "files": [a["path"] for a in c.get("adds", ())],
    }


def audit(
    storage: TableStorage,
    dt: DeltaTable | None,
    app: str,
    checkpoints: Sequence[CheckpointEvidence],
) -> list[Finding]:
    """Check every committable of ``checkpoints`` against the table's log (module
    docstring); ``dt``: the table (None: it does not exist)."""
    if dt is None:
        return [
            Finding(
                cp.checkpoint,
                str(c["txn"]),
                Verdict.MISMATCH,
                "the table does not exist",
                int(c.get("rows", 0)),
            )
            for cp in checkpoints
            for c in cp.committed
        ]
    history = dt.history()
    versions = {
        batch: int(h["version"])
        for h in history
        for (app_of, batch) in [_app_batch(h)]
        if app_of == app
    }
    oldest_ms = min((int(h.get("timestamp", 0)) for h in history), default=None)
    starts_at_zero = any(int(h.get("version", -1)) == 0 for h in history)
    found: list[Finding] = []
    for cp in checkpoints:
        batches = [TxnName.require(str(c["txn"])).batch_id for c in cp.committed]
        if not batches:
            continue
        batch = max(batches)
        version = versions.get(batch)
        if version is None:
            gone = not starts_at_zero and (oldest_ms is None or oldest_ms > cp.committed_at * 1000)
            verdict = Verdict.EXPIRED if gone else Verdict.MISMATCH
            detail = (
                f"the log no longer reaches back to it (its oldest version is newer than "
                f"checkpoint {cp.checkpoint})"
                if gone
                else f"no version of the table carries app transaction {app} v{batch}"
            )
            found.extend(
                Finding(cp.checkpoint, str(c["txn"]), verdict, detail, int(c.get("rows", 0)))
                for c in cp.committed
            )
            continue
        adds = _adds(storage, version)
        merged = _merged(storage, version)
        for c in cp.committed:
            if c.get("merge"):
                found.append(_check_merge(cp.checkpoint, c, version, merged))
            else:
                found.append(_check(cp.checkpoint, c, version, adds))
    return found


def _merged(storage: TableStorage, version: int) -> dict[str, int] | None:
    """The change rows per transaction a merge version records in its
    ``commitInfo`` (``twophaseMerge``, or ``tags.twophaseMerge`` through
    delta-spark); None when the commit file is gone or
    records no merge."""
    data = storage.read(f"_delta_log/{version:020d}.json")
    if data is None:
        return None
    for line in data.decode().splitlines():
        info = json.loads(line).get("commitInfo") if line.strip() else None
        # delta-rs's commits carry it at the top, delta-spark's among the tags
        summary = info and (
            info.get("twophaseMerge") or (info.get("tags") or {}).get("twophaseMerge")
        )
        if summary:
            summary = json.loads(summary) if isinstance(summary, str) else summary
            return {str(k): int(v) for k, v in summary.get("changes", {}).items()}
    return {}


def _check_merge(
    checkpoint: int, c: Mapping[str, Any], version: int, merged: dict[str, int] | None
) -> Finding:
    """A keyed sink's committable: the merge version records its change rows."""
    txn, rows = str(c["txn"]), int(c.get("rows", 0))
    if merged is None:
        return Finding(
            checkpoint, txn, Verdict.EXPIRED, f"the commit file of version {version} is gone", rows
        )
    if txn not in merged:
        return Finding(
            checkpoint, txn, Verdict.MISMATCH, f"version {version} does not merge {txn}", rows
        )
    if merged[txn] != rows:
        return Finding(
            checkpoint,
            txn,
            Verdict.MISMATCH,
            f"version {version} merges {merged[txn]} change(s) of it, the ledger says {rows}",
            rows,
        )
    return Finding(checkpoint, txn, Verdict.OK, f"version {version} (a merge)", rows)


def _adds(storage: TableStorage, version: int) -> dict[str, int | None] | None:
    """The files version ``version`` adds, with their ``numRecords`` (None when
    the add carries no statistics); None when its commit file is gone."""
    data = storage.read(f"_delta_log/{version:020d}.json")
    if data is None:
        return None
    adds: dict[str, int | None] = {}
    for line in data.decode().splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        add = action.get("add")
        if add is None:
            continue
        stats = json.loads(add["stats"]) if add.get("stats") else {}
        n = stats.get("numRecords")
        adds[unquote(add["path"])] = None if n is None else int(n)  # the log URL-encodes
    return adds


def _check(
    checkpoint: int, c: Mapping[str, Any], version: int, adds: dict[str, int | None] | None
) -> Finding:
    txn, rows = str(c["txn"]), int(c.get("rows", 0))
    if adds is None:
        return Finding(
            checkpoint, txn, Verdict.EXPIRED, f"the commit file of version {version} is gone", rows
        )
    files = [str(f) for f in c.get("files", ())]  # as on disk, like the log's paths decoded
    missing = [f for f in files if f not in adds]
    if missing:
        return Finding(
            checkpoint,
            txn,
            Verdict.MISMATCH,
            f"version {version} does not add {len(missing)} of its {len(files)} file(s), "
            f"e.g. {missing[0]}",
            rows,
        )
    counts = [adds[f] for f in files]
    if any(n is None for n in counts):
        return Finding(
            checkpoint, txn, Verdict.UNVERIFIABLE, f"version {version} has no numRecords", rows
        )
    total = sum(n for n in counts if n is not None)
    if total != rows:
        return Finding(
            checkpoint,
            txn,
            Verdict.MISMATCH,
            f"version {version} adds {total} record(s) in its files, the ledger says {rows}",
            rows,
        )
    return Finding(checkpoint, txn, Verdict.OK, f"version {version}", rows)


def _app_batch(commit: dict[str, Any]) -> tuple[str | None, int]:
    """The app transaction a commit records: delta-rs commits carry
    ``twophaseApp``/``twophaseBatch``, delta-spark's only ``userMetadata``."""
    if commit.get("twophaseApp") is not None and commit.get("twophaseBatch") is not None:
        return str(commit["twophaseApp"]), int(commit["twophaseBatch"])
    found = progress.parse_user_metadata(commit.get("userMetadata"))
    return found if found is not None else (None, -1)
