"""The ledger: durable, crash-atomic record of committables and checkpoints.

What it holds (one JSON document, ``<state_dir>/ledger/ledger.json``):

* ``run``: incremented at every start (part of transaction names, so a zombie
  task of an earlier run can never collide with a task of this run);
* ``pending``: committables of every pre-committed batch not yet committed,
  by pipeline, batch and sink;
* ``decided``: the checkpoint whose commit is under way, if any. Once written,
  the decision is final: a restart finishes it before anything else;
* ``history``: the last checkpoints that committed (id, kind, cut per pipeline,
  finished pipelines, rows per sink, times), and ``finished`` pipelines;
* ``totals``: rows committed per sink over the job's life.

Every change rewrites the document to a temporary file, fsyncs it, renames it
over the old one and fsyncs the directory: after a crash at any instant the
ledger is either the old or the new document. Committed batches leave
``pending`` when their checkpoint completes and history is trimmed, so the
ledger stays small however long the job runs. A lock file keeps a second job
from opening the same ledger.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sinks.base import Committable
from sinks.errors import ConfigError

FORMAT = 1
HISTORY = 50
KINDS = ("periodic", "final", "savepoint", "recovery")

# pending: pipeline -> batch id -> sink id -> committables
Pending = dict[str, dict[int, dict[str, list[Committable]]]]


@dataclass
class Checkpoint:
    """A cut across pipelines: every pending batch at or below ``cut[p]`` commits.
    ``finished``: every pipeline finished as of this checkpoint (cumulative)."""

    id: int
    kind: str
    cut: dict[str, int]
    finished: list[str] = field(default_factory=list)
    decided_at: float = 0.0
    committed_at: float | None = None
    rows: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Checkpoint:
        return cls(**d)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new content."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class LedgerLockedError(ConfigError):
    """Another process holds the ledger (a second run of the same job?)."""


class FileLedger:
    """The embedded ledger in a local directory. Thread-safe within one process."""

    def __init__(self, directory: str | os.PathLike[str], job: str, *, lock: bool = True) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "ledger.json"
        self._mutex = threading.RLock()
        self._lock_fd: int | None = None
        if lock:
            self._acquire_lock()
        self._doc = self._load(job)

    # -- file handling ------------------------------------------------------------

    def _acquire_lock(self) -> None:
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LedgerLockedError(
                f"the ledger in {self.dir} is in use by another process: is the job already "
                "running with this state_dir?"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _load(self, job: str) -> dict[str, Any]:
        if not self.path.exists():
            return {
                "format": FORMAT,
                "job": job,
                "run": 0,
                "next_checkpoint": 1,
                "pending": {},
                "decided": None,
                "history": [],
                "finished": [],
                "totals": {},
                "incarnation": secrets.token_hex(6),
                "committed_cut": {},
                "digests": {},
            }
        doc = json.loads(self.path.read_text())
        if doc.get("format") != FORMAT:
            raise ConfigError(f"{self.path}: unknown ledger format {doc.get('format')!r}")
        if doc["job"] != job:
            raise ConfigError(
                f"{self.path} belongs to job {doc['job']!r}, not {job!r}: use another state_dir"
            )
        doc.setdefault("incarnation", secrets.token_hex(6))
        doc.setdefault("committed_cut", {})
        doc.setdefault("digests", {})
        doc["pending"] = {
            p: {int(b): sinks for b, sinks in batches.items()}
            for p, batches in doc["pending"].items()
        }
        return doc

    def _save(self) -> None:
        atomic_write(self.path, json.dumps(self._doc, sort_keys=True).encode())

    @contextlib.contextmanager
    def _change(self) -> Iterator[dict[str, Any]]:
        """Apply a change to the document and persist it, or leave it untouched."""
        with self._mutex:
            before = copy.deepcopy(self._doc)
            try:
                yield self._doc
                self._save()
            except BaseException:
                self._doc = before
                raise

    # -- reading --------------------------------------------------------------------

    @property
    def job(self) -> str:
        return str(self._doc["job"])

    @property
    def incarnation(self) -> str:
        return str(self._doc["incarnation"])

    def committed_cut(self, pipeline: str) -> int:
        with self._mutex:
            return int(self._doc["committed_cut"].get(pipeline, -1))

    def committed_digest(self, pipeline: str, batch_id: int) -> str | None:
        with self._mutex:
            return self._doc["digests"].get(pipeline, {}).get(str(batch_id))

    @property
    def run(self) -> int:
        return int(self._doc["run"])

    def pending(self) -> Pending:
        """A copy of the pending committables."""
        with self._mutex:
            return copy.deepcopy(self._doc["pending"])

    def decided(self) -> Checkpoint | None:
        with self._mutex:
            d = self._doc["decided"]
            return Checkpoint.from_json(copy.deepcopy(d)) if d else None

    def history(self) -> list[Checkpoint]:
        with self._mutex:
            return [Checkpoint.from_json(copy.deepcopy(c)) for c in self._doc["history"]]

    def finished(self) -> set[str]:
        with self._mutex:
            return set(self._doc["finished"])

    def totals(self) -> dict[str, int]:
        with self._mutex:
            return dict(self._doc["totals"])

    def owned_txns(self) -> set[str]:
        """Names of every transaction a pending entry owns."""
        with self._mutex:
            return {
                c["txn"]
                for batches in self._doc["pending"].values()
                for sinks in batches.values()
                for cs in sinks.values()
                for c in cs
            }

    # -- changes --------------------------------------------------------------------

    def begin_run(self) -> int:
        with self._change() as doc:
            doc["run"] += 1
        return self.run

    def record_batch(
        self,
        pipeline: str,
        batch_id: int,
        committables: dict[str, list[Committable]],
        digest: str | None = None,
    ) -> None:
        with self._change() as doc:
            doc["pending"].setdefault(pipeline, {})[batch_id] = committables
            if digest is not None:
                doc["digests"].setdefault(pipeline, {})[str(batch_id)] = digest

    def drop_batches(self, pipeline: str, batch_ids: list[int]) -> None:
        with self._change() as doc:
            batches = doc["pending"].get(pipeline, {})
            for b in batch_ids:
                batches.pop(b, None)
            if not batches:
                doc["pending"].pop(pipeline, None)

    def decide(self, kind: str, cut: dict[str, int], finished: list[str]) -> Checkpoint:
        """Record a checkpoint decision. From here on it commits, whatever happens."""
        if kind not in KINDS:
            raise ValueError(f"unknown checkpoint kind {kind!r}")
        with self._change() as doc:
            if doc["decided"] is not None:
                raise RuntimeError("a checkpoint is already being committed")
            cp = Checkpoint(
                id=doc["next_checkpoint"],
                kind=kind,
                cut=dict(cut),
                finished=sorted(set(doc["finished"]) | set(finished)),
                decided_at=time.time(),
            )
            doc["next_checkpoint"] += 1
            doc["decided"] = asdict(cp)
        return cp

    def complete(self, cp: Checkpoint, rows: dict[str, int]) -> Checkpoint:
        """Record that ``cp`` committed: its batches leave ``pending``."""
        with self._change() as doc:
            decided = doc["decided"]
            if decided is None or decided["id"] != cp.id:
                raise RuntimeError(f"checkpoint {cp.id} is not the decided one")
            for p, last in cp.cut.items():
                doc["committed_cut"][p] = max(last, doc["committed_cut"].get(p, -1))
                batches = doc["pending"].get(p, {})
                for b in [b for b in batches if b <= last]:
                    del batches[b]
                if not batches:
                    doc["pending"].pop(p, None)
            done = Checkpoint(**{**decided, "committed_at": time.time(), "rows": dict(rows)})
            doc["history"] = [*doc["history"], asdict(done)][-HISTORY:]
            doc["finished"] = sorted(set(doc["finished"]) | set(cp.finished))
            for sink, n in rows.items():
                doc["totals"][sink] = doc["totals"].get(sink, 0) + n
            doc["decided"] = None
        return done


def is_locked(state_dir: str | os.PathLike[str]) -> bool:
    """Whether a job currently holds the ledger of ``state_dir`` (is running)."""
    path = Path(state_dir) / "ledger" / "lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock we may have taken
    return False


def read_ledger(state_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ledger document of ``state_dir`` for display, without taking the lock."""
    path = Path(state_dir) / "ledger" / "ledger.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())
