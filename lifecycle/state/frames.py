"""Self-checking records: the unit the journal appends and a snapshot holds.

A record (frame) is one line::

    <length: 8 hex digits> <crc32: 8 hex digits> <payload>\\n

The payload is JSON without a raw newline. A frame is valid when its line has
exactly ``length`` payload bytes and their CRC32 matches. Appending a frame is
not atomic: a crash can leave the last frame torn (cut short, or with bytes
that never reached the disk). Only the last frame can be torn, since every
frame is fsynced before the next is written, so a bad frame anywhere else is
damage, not a crash, and :func:`scan` says where it is.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path

from sinks.errors import ConfigError

HEADER = 18  # "%08x %08x "


class CorruptLedgerError(ConfigError):
    """A ledger file is damaged (not by a crash mid-write): it names the file and offset."""

    def __init__(self, path: Path | str, offset: int, what: str) -> None:
        super().__init__(
            f"{path}: {what} at byte offset {offset}; the ledger is damaged (this is not "
            "what a crash leaves behind): restore the state directory from a backup"
        )
        self.path = path
        self.offset = offset


def encode(payload: bytes) -> bytes:
    """The frame of ``payload``."""
    if b"\n" in payload:
        raise ValueError("a record's payload must not contain a newline")
    if len(payload) >= 1 << 32:
        raise ValueError("a record's payload must be smaller than 4 GiB")
    return b"%08x %08x " % (len(payload), zlib.crc32(payload)) + payload + b"\n"


def _payload(line: bytes) -> bytes | None:
    """The payload of a frame's line (without its newline), or None if it is not valid."""
    if len(line) < HEADER or line[8:9] != b" " or line[17:18] != b" ":
        return None
    try:
        length = int(line[0:8], 16)
        crc = int(line[9:17], 16)
    except ValueError:
        return None
    payload = line[HEADER:]
    if len(payload) != length or zlib.crc32(payload) != crc:
        return None
    return payload


@dataclass
class Scan:
    """What a file of frames holds."""

    records: list[tuple[int, bytes]] = field(default_factory=list)
    """(offset, payload) of every valid frame, in order"""
    end: int = 0
    """offset just past the last valid frame: where the torn tail, if any, begins"""


def scan(data: bytes, path: Path | str) -> Scan:
    """The valid frames of ``data`` (the content of ``path``).

    A torn last frame is left out (``end`` stops before it); a bad frame
    followed by more data raises :class:`CorruptLedgerError`."""
    out = Scan()
    pos = 0
    size = len(data)
    while pos < size:
        nl = data.find(b"\n", pos)
        if nl == -1:
            break  # the last frame, cut short
        payload = _payload(data[pos:nl])
        if payload is None:
            if nl == size - 1:
                break  # the last frame, with bytes that never reached the disk
            raise CorruptLedgerError(path, pos, "invalid record (bad length or checksum)")
        out.records.append((pos, payload))
        pos = nl + 1
        out.end = pos
    return out
