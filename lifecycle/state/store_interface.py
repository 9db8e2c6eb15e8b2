"""What every state store answers (:class:`StateStore`), and the rules of the
names given to one.

:mod:`lifecycle.state.store` picks the store of a ``state_dir`` and holds the
local one; :mod:`lifecycle.state.hadoop_store` is the other. Both implement
this interface, which imports neither of them.
"""

from __future__ import annotations

import abc
import os
import re

from sinks.errors import ConfigError

TMP = ".tmp"
"""suffix of a store's own temporary file next to the file it replaces"""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


class StateStore(abc.ABC):
    """Files of one ``state_dir``, by relative name (module docstring)."""

    is_local: bool
    """whether the state is a directory of the driver's own file system (plain ``os``)"""

    creates_atomically: bool = True
    """whether :meth:`create` is available (an atomic create-if-absent)"""

    @abc.abstractmethod
    def read(self, rel: str) -> bytes | None:
        """The content of file ``rel``, or None when there is none."""

    @abc.abstractmethod
    def write_atomic(self, rel: str, data: bytes) -> None:
        """Create or replace file ``rel`` with ``data`` (parents created): once it
        returns, ``data`` is durable; after a crash at any instant :meth:`read`
        returns the old or the new content, never a mix."""

    @abc.abstractmethod
    def create(self, rel: str, data: bytes) -> None:
        """Create file ``rel`` with ``data`` (parents created) only if no file
        of that name exists, atomically: of two writers of one name exactly one
        succeeds, and a reader finds the whole of it or nothing. Raises
        :class:`FileExistsError` when the name is taken by other content (a
        retry that finds its own bytes there has succeeded);
        :class:`~sinks.errors.ConfigError` when the store cannot create
        atomically."""

    @abc.abstractmethod
    def list(self, rel_dir: str) -> list[str]:
        """Names of the entries of directory ``rel_dir``, sorted, without the
        stores' own temporary files; [] when there is no such directory."""

    @abc.abstractmethod
    def delete(self, rel: str) -> None:
        """Remove file or directory tree ``rel``; nothing when it is not there."""

    @abc.abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether file or directory ``rel`` exists (a file: :meth:`read` finds it)."""

    @abc.abstractmethod
    def copy(self, rel: str, to: str) -> None:
        """Copy file or directory tree ``rel`` to ``to`` (parents created; ``to``
        must not exist). Not atomic: the caller removes a partial copy."""

    @abc.abstractmethod
    def uri(self, rel: str = "") -> str:
        """Where ``rel`` is, as Spark takes it (a ``checkpointLocation``) and as
        messages show it: a URI, or a plain path for a local store."""

    def __str__(self) -> str:
        return self.uri()


def check_rel(rel: str) -> str:
    """``rel`` if it is a relative ``/``-separated name (or "" for the root)."""
    parts = rel.split("/") if rel else []
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a relative name in a state store: {rel!r}")
    return rel


def scheme_of(state_dir: str | os.PathLike[str]) -> str | None:
    """The URI scheme of ``state_dir`` (lower case), or None for a plain path.

    A ``pathlib.Path`` never carries a URI: ``Path("hdfs://nn/x")`` is the local
    path ``hdfs:/nn/x`` (``//`` collapsed), so a Path that looks like one is
    refused rather than used as a local directory."""
    text = os.fspath(state_dir)
    m = _SCHEME.match(text)
    if m is None:
        return None
    if not isinstance(state_dir, str):
        raise ConfigError(
            f"state_dir {text!r} looks like a URI but was given as a path object (which "
            "collapses '//'): pass the URI as a str"
        )
    return m.group(1).lower()
