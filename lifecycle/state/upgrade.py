"""Ledgers of the previous format (1): one JSON document, ``ledger.json``.

A format-1 directory is converted when a :class:`~lifecycle.state.file_ledger.FileLedger`
opens it: the new snapshot (generation 0, with a fresh incarnation) is written
atomically first, then ``ledger.json`` is renamed to ``ledger.json.v1`` (kept
as a backup). A crash before the snapshot is in place leaves the old document,
converted again at the next open (the incarnation drawn then was never used);
a crash after it leaves the snapshot, which wins, and the next open renames the
old document. Format 1 had no incarnation, no digests, no Spark progress and
no abandonments; the committed cut of each pipeline is taken from its history.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lifecycle.state.files import fsync_dir
from lifecycle.state.model import LedgerState
from sinks.errors import ConfigError

LEGACY = "ledger.json"


def read_v1(path: Path) -> dict[str, Any]:
    """The document of a format-1 ledger."""
    doc: dict[str, Any] = json.loads(path.read_text())
    if doc.get("format") != 1:
        raise ConfigError(f"{path}: unknown ledger format {doc.get('format')!r}")
    return doc


def state_from_v1(
    doc: dict[str, Any], incarnation: str | None, *, history: int, digest_window: int
) -> LedgerState:
    """The state of a format-1 document."""
    state = LedgerState(doc["job"], incarnation, history=history, digest_window=digest_window)
    state.run = int(doc["run"])
    state.next_checkpoint = int(doc["next_checkpoint"])
    for p, batches in doc["pending"].items():
        for b, committables in batches.items():
            state.apply({"op": "batch", "p": p, "b": int(b), "c": committables, "d": None})
    state.decided = doc["decided"]
    state.history = list(doc["history"])
    state.finished = list(doc["finished"])
    state.totals = dict(doc["totals"])
    for cp in state.history:
        for p, last in cp["cut"].items():
            state.committed_cut[p] = max(state.committed_cut.get(p, -1), int(last))
    state.apply({"op": "limits", "history": history, "digests": digest_window})
    return state


def retire_v1(path: Path) -> None:
    """Move the converted format-1 document aside (``ledger.json.v1``)."""
    os.replace(path, path.with_name(path.name + ".v1"))
    fsync_dir(path.parent)
