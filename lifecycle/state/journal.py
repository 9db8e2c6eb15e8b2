"""An append-only journal: a file of frames (:mod:`lifecycle.state.frames`).

:meth:`Journal.append` writes one frame and fsyncs the file before it returns:
once it returns, the record survives any crash. When an append fails (disk
full, an I/O error), the file is cut back to its size before the append, so
the failed record never becomes durable and later records never follow a
partial one; when even that fails, the journal refuses further appends.

Opening a journal drops a torn last record (what a crash mid-append leaves)
by truncating the file; a damaged record before the last is an error.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from lifecycle.state.files import fsync_dir
from lifecycle.state.frames import encode, scan

log = logging.getLogger("lifecycle.ledger")

Record = tuple[int, bytes]
"""(offset in the file, payload)"""


def read_records(path: Path) -> list[Record]:
    """The records of the journal at ``path`` without changing it (a torn last
    record is ignored; a missing file has none)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return scan(data, path).records


class Journal:
    """An open journal file, appended to by one process."""

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self.path = path
        self._fd: int | None = fd
        self.size = size
        self._broken: OSError | None = None

    @classmethod
    def create(cls, path: Path) -> Journal:
        """A new, empty journal (``path`` must not exist)."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fsync_dir(path.parent)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, 0)

    @classmethod
    def open(cls, path: Path) -> tuple[Journal, list[Record]]:
        """Open the journal at ``path`` for appending (created when missing) and
        return its records; a torn last record is truncated away."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls.create(path), []
        found = scan(data, path)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            if found.end < len(data):
                log.warning(
                    "%s: dropping a torn last record (%d byte(s) at offset %d) left by a "
                    "crash in the middle of a write",
                    path,
                    len(data) - found.end,
                    found.end,
                )
                os.ftruncate(fd, found.end)
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, found.end), found.records

    def append(self, payload: bytes) -> None:
        """Append one record durably (written and fsynced) or not at all."""
        if self._fd is None:
            raise RuntimeError(f"{self.path}: the journal is closed")
        if self._broken is not None:
            raise RuntimeError(
                f"{self.path}: a failed write could not be undone ({self._broken}); "
                "reopen the ledger (it drops the partial record)"
            )
        frame = encode(payload)
        start = self.size
        try:
            left = memoryview(frame)
            while left:
                left = left[os.write(self._fd, left) :]
            os.fsync(self._fd)
        except BaseException:
            self._undo(start)
            raise
        self.size = start + len(frame)

    def _undo(self, size: int) -> None:
        """Cut the file back to ``size`` after a failed append."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        except OSError as e:
            self._broken = e
            log.error("%s: could not undo a failed write: %s", self.path, e)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
