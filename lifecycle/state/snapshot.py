"""Numbered snapshots of the ledger and the journal that follows each.

Generation ``g`` of a ledger directory is ``snapshot.<g>.json`` (the whole
state, one frame of :mod:`lifecycle.state.frames`) and ``journal.<g>.log``
(the operations applied after it). Compacting to ``g + 1`` writes the new
snapshot atomically (temporary file, fsync, rename, directory fsync), then
creates the new journal, then removes generation ``g``. The highest snapshot
present is the state; a crash at any step leaves either generation ``g``
whole (no new snapshot yet) or the new snapshot, which already holds every
operation of ``g``'s journal, so that journal is then ignored and removed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from lifecycle.state.files import atomic_write, fsync_dir, remove_quietly
from lifecycle.state.frames import CorruptLedgerError, encode, scan

_SNAPSHOT = re.compile(r"^snapshot\.(\d+)\.json$")
_JOURNAL = re.compile(r"^journal\.(\d+)\.log$")


def snapshot_path(directory: Path, gen: int) -> Path:
    return directory / f"snapshot.{gen}.json"


def journal_path(directory: Path, gen: int) -> Path:
    return directory / f"journal.{gen}.log"


def _numbered(directory: Path, pattern: re.Pattern[str]) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((int(m[1]) for m in map(pattern.match, names) if m is not None), reverse=True)


def generations(directory: Path) -> list[int]:
    """Generations that have a snapshot, highest first."""
    return _numbered(directory, _SNAPSHOT)


def journal_generations(directory: Path) -> list[int]:
    """Generations that have a journal, highest first."""
    return _numbered(directory, _JOURNAL)


def write_snapshot(directory: Path, gen: int, doc: dict[str, Any]) -> int:
    """Write the snapshot of generation ``gen`` atomically; its size in bytes."""
    data = encode(json.dumps(doc, separators=(",", ":")).encode())
    atomic_write(snapshot_path(directory, gen), data)
    return len(data)


def read_snapshot(directory: Path, gen: int) -> dict[str, Any]:
    """The document of generation ``gen``'s snapshot."""
    path = snapshot_path(directory, gen)
    data = path.read_bytes()
    found = scan(data, path)
    if len(found.records) != 1 or found.end != len(data):
        # a snapshot is renamed into place only once complete: this is damage
        raise CorruptLedgerError(path, found.end, "incomplete snapshot")
    doc: dict[str, Any] = json.loads(found.records[0][1])
    return doc


def remove_other_generations(directory: Path, keep: int) -> None:
    """Remove every snapshot, journal and temporary file except generation ``keep``'s
    (best effort: what is left is removed at the next open)."""
    for gen in generations(directory):
        if gen != keep:
            remove_quietly(snapshot_path(directory, gen))
    for gen in journal_generations(directory):
        if gen != keep:
            remove_quietly(journal_path(directory, gen))
    for name in os.listdir(directory):
        if name.endswith(".tmp"):
            remove_quietly(directory / name)
    fsync_dir(directory)
