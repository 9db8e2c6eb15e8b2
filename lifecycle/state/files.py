"""File primitives of the local state directory: durable replace, exclusive
create and directory sync."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, removals) durable."""
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
    fsync_dir(path.parent)


def create_exclusive(path: Path, data: bytes) -> None:
    """Create ``path`` holding ``data`` only if no file of that name exists,
    atomically: a complete, synced temporary file linked to the name
    (``link(2)`` refuses a name taken), then the directories synced (a parent
    created here too). Raises :class:`FileExistsError` when the name holds
    other bytes; a retry that finds its own bytes there has succeeded."""
    made = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            if path.read_bytes() != data:
                raise
    finally:
        remove_quietly(tmp)
    fsync_dir(path.parent)
    if made:
        fsync_dir(path.parent.parent)


def remove_quietly(path: Path) -> bool:
    """Remove ``path`` if it exists; whether it is gone afterwards."""
    try:
        path.unlink()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
