"""The embedded ledger: a snapshot and an append-only journal in a local directory.

Files of ``<state_dir>/ledger/``:

* ``snapshot.<g>.json``: the whole state as of generation ``g`` (one record);
* ``journal.<g>.log``: every change since, one self-checking record each
  (:mod:`lifecycle.state.frames`);
* ``lock``: held (flock) by the process that has the ledger open;
* ``ledger.json.v1``: a format-1 ledger this one was converted from, if any.

A change is validated, appended to the journal and fsynced, and only then
applied to the state in memory: a failed write leaves both untouched, and
nothing is copied to undo a change. Its cost is that of its own record,
however much the ledger holds. When the journal has grown as large as the
last snapshot (and at least ``compact_bytes``), the state is written as the
snapshot of the next generation and a fresh journal starts
(:mod:`lifecycle.state.snapshot`): the snapshot's cost is paid for by at least
as many bytes of journal records, so the amortised cost per change stays
proportional to the change. Opening replays the newest snapshot's journal and
drops a torn last record (a crash in the middle of an append).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Any

from lifecycle.state.base import StateLedger
from lifecycle.state.files import fsync_dir, remove_quietly
from lifecycle.state.frames import CorruptLedgerError
from lifecycle.state.journal import Journal, Record, read_records
from lifecycle.state.model import (
    DIGEST_WINDOW,
    FORMAT,
    HISTORY,
    READABLE_FORMATS,
    LedgerState,
    Op,
)
from lifecycle.state.protocol import LedgerLockedError, new_incarnation
from lifecycle.state.snapshot import (
    generations,
    journal_generations,
    journal_path,
    read_snapshot,
    remove_other_generations,
    snapshot_path,
    write_snapshot,
)
from lifecycle.state.upgrade import LEGACY, read_v1, retire_v1, state_from_v1
from sinks.errors import ConfigError

log = logging.getLogger("lifecycle.ledger")

COMPACT_BYTES = 1 << 20
"""The journal is never compacted below this size."""


__all__ = ["FileLedger", "LedgerLockedError", "is_locked", "read_directory", "read_ledger"]


def _check_format(path: Path, doc: dict[str, Any]) -> None:
    if doc.get("format") not in READABLE_FORMATS:
        raise ConfigError(f"{path}: unknown ledger format {doc.get('format')!r}")


def _check_job(path: Path, doc: dict[str, Any], job: str) -> None:
    if doc["job"] != job:
        raise ConfigError(
            f"{path} belongs to job {doc['job']!r}, not {job!r}: use another state_dir"
        )


def _replay(state: LedgerState, records: list[Record], path: Path) -> None:
    for offset, payload in records:
        try:
            state.apply(json.loads(payload))
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptLedgerError(path, offset, f"a record that does not apply ({e})") from e


class FileLedger(StateLedger):
    """The embedded ledger in a local directory. Thread-safe within one process.

    ``history``: how many committed checkpoints are kept; ``digest_window``:
    for how many of the last committed batches per pipeline the offsets digest
    is kept; ``compact_bytes``: the least journal size that is compacted."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        job: str,
        *,
        lock: bool = True,
        history: int = HISTORY,
        digest_window: int = DIGEST_WINDOW,
        compact_bytes: int = COMPACT_BYTES,
    ) -> None:
        if history < 0 or digest_window < 0:
            raise ValueError("history and digest_window must not be negative")
        super().__init__()
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = None
        self._compact_bytes = compact_bytes
        self._unusable: str | None = None  # why no further change may be made
        if lock:
            self._acquire_lock()
        try:
            self._open(job, history, digest_window)
        except BaseException:
            self.close()
            raise

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
        """Release the journal and the lock; the ledger cannot change afterwards."""
        journal: Journal | None = getattr(self, "_journal", None)
        if journal is not None:
            journal.close()
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _open(self, job: str, history: int, digest_window: int) -> None:
        legacy = self.dir / LEGACY
        gens = generations(self.dir)
        older = False  # a snapshot of an earlier format, written anew below
        if gens:
            gen = gens[0]
            doc = read_snapshot(self.dir, gen)
            _check_format(snapshot_path(self.dir, gen), doc)
            _check_job(snapshot_path(self.dir, gen), doc, job)
            state = LedgerState.from_doc(doc)
            older = doc.get("format") != FORMAT
            if legacy.exists():  # a crash right after the conversion
                retire_v1(legacy)
        elif legacy.exists():
            old = read_v1(legacy)
            _check_job(legacy, old, job)
            gen = 0
            state = state_from_v1(
                old, new_incarnation(), history=history, digest_window=digest_window
            )
            write_snapshot(self.dir, gen, state.to_doc())
            retire_v1(legacy)
            log.info("converted the format-1 ledger %s (kept as %s.v1)", legacy, LEGACY)
        elif journal_generations(self.dir):
            path = journal_path(self.dir, journal_generations(self.dir)[0])
            raise CorruptLedgerError(path, 0, "a journal without its snapshot")
        else:
            gen = 0
            state = LedgerState(
                job, new_incarnation(), history=history, digest_window=digest_window
            )
            write_snapshot(self.dir, gen, state.to_doc())
        self._journal, records = Journal.open(journal_path(self.dir, gen))
        _replay(state, records, self._journal.path)
        remove_other_generations(self.dir, gen)
        self._state = state
        self._gen = gen
        self._snapshot_bytes = snapshot_path(self.dir, gen).stat().st_size
        if older:
            self._compact()  # in the current format, which a version before refuses
            if self._gen == gen:
                raise ConfigError(
                    f"the ledger in {self.dir} is of format {doc.get('format')} and could not be "
                    f"written in format {FORMAT} (see the warning above); free space or fix "
                    "permissions and open it again"
                )
            log.info("ledger %s upgraded to format %d", self.dir, FORMAT)
        if (state.history_limit, state.digest_window) != (history, digest_window):
            self._change({"op": "limits", "history": history, "digests": digest_window})

    def _change(self, op: Op) -> None:
        """Append ``op`` to the journal (durably), then apply it. The caller has
        checked that it applies; a failed append changes nothing."""
        payload = json.dumps(op, separators=(",", ":")).encode()
        with self._mutex:
            if self._unusable is not None:
                raise RuntimeError(f"the ledger in {self.dir} must be reopened: {self._unusable}")
            record = json.loads(payload)  # exactly what a replay will apply
            self._journal.append(payload)
            try:
                self._state.apply(record)
            except BaseException as e:
                self._unusable = f"a recorded change did not apply in memory ({e!r})"
                raise
            if self._journal.size >= max(self._compact_bytes, self._snapshot_bytes):
                self._compact()

    def _compact(self) -> None:
        """Start generation ``g + 1``: its snapshot, then its empty journal, then
        remove generation ``g``. A failure leaves generation ``g`` in use (retried
        once the journal has doubled) and the ledger as durable as before."""
        gen = self._gen + 1
        try:
            size = write_snapshot(self.dir, gen, self._state.to_doc())
            journal = Journal.create(journal_path(self.dir, gen))
        except OSError as e:
            log.warning("could not compact the ledger in %s (kept as it is): %s", self.dir, e)
            # the new snapshot must not outlive this failure: it lacks what comes next
            gone = remove_quietly(snapshot_path(self.dir, gen))
            remove_quietly(journal_path(self.dir, gen))
            try:
                fsync_dir(self.dir)
            except OSError:
                gone = False
            if not gone:  # no further change may go to generation g
                self._unusable = f"a failed compaction left {snapshot_path(self.dir, gen)}"
                log.error("the ledger in %s must be reopened: %s", self.dir, self._unusable)
            self._snapshot_bytes = 2 * self._journal.size
            return
        old, self._journal, self._gen = self._journal, journal, gen
        old.close()
        self._snapshot_bytes = size
        try:
            remove_other_generations(self.dir, gen)
        except OSError as e:
            log.warning("could not remove the previous ledger generation: %s", e)

    @property
    def generation(self) -> int:
        """The current snapshot generation (grows at every compaction)."""
        return self._gen


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


def read_directory(directory: Path) -> dict[str, Any] | None:
    """The document of the ledger in ``directory`` (see :func:`read_ledger`)."""
    for _ in range(50):
        gens = generations(directory)
        try:
            if gens:
                doc = read_snapshot(directory, gens[0])
                _check_format(snapshot_path(directory, gens[0]), doc)
                state = LedgerState.from_doc(doc)
                path = journal_path(directory, gens[0])
                _replay(state, read_records(path), path)
            elif (directory / LEGACY).exists():
                old = read_v1(directory / LEGACY)
                limits = {"history": HISTORY, "digest_window": DIGEST_WINDOW}
                state = state_from_v1(old, None, **limits)
            else:
                return None
        except FileNotFoundError:
            continue  # a compaction (or a conversion) replaced what we were reading
        if generations(directory)[:1] == gens[:1]:
            return state.to_doc()
    raise RuntimeError(f"{directory}: the ledger changed generation under every read")


def read_ledger(state_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ledger document of ``state_dir`` for display, without taking the lock
    (the job may be running): keys ``format``, ``job``, ``incarnation``, ``run``,
    ``next_checkpoint``, ``pending`` (pipeline -> str(batch) -> sink ->
    committables), ``decided``, ``history``, ``finished``, ``totals``,
    ``abandoned``, ``sinks`` (``pipeline/sink_id`` -> recorded settings) and
    the rest of :meth:`LedgerState.to_doc`; None when there is no ledger."""
    return read_directory(Path(state_dir) / "ledger")
