"""The state store: the one face through which the driver reads and writes the
files of a ``state_dir`` (Spark checkpoint locations, end-of-input flags,
control files), whatever storage holds them.

Which store a ``state_dir`` gets (:func:`open_store`):

* a plain path (``/var/lib/job``, ``state``) -> :class:`LocalStore`: ``os`` and
  ``fsync`` on the driver's disk, the embedded default;
* a URI with a scheme (``file://``, ``viewfs://``, ``hdfs://``, ``s3a://``,
  ``abfss://``, ...) -> :class:`~lifecycle.state.hadoop_store.HadoopStore`:
  Spark's Hadoop FileSystem in the driver JVM, so every scheme Spark can open
  the state can live on. ``file://`` too: it names a path on a mount every host
  of a cluster sees the same way (NFS), and it runs the cluster's code path on
  one machine.

Names given to a store are relative, ``/``-separated, without ``.`` or ``..``
(``pipelines/load/ending_input.json``). A store is used by one writer per file
at a time (the job writes its files, ``twophase`` writes its requests, each
deletes what it consumed).

Besides the store only the file ledger (a local directory: it needs ``fsync``
and ``flock``) opens a state file itself.
"""

from __future__ import annotations

import abc
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle.state.files import atomic_write, fsync_dir
from sinks.errors import ConfigError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TMP = ".tmp"
"""suffix of a store's own temporary file next to the file it replaces"""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


class StateStore(abc.ABC):
    """Files of one ``state_dir``, by relative name (module docstring)."""

    is_local: bool
    """whether the state is a directory of the driver's own file system (plain ``os``)"""

    @abc.abstractmethod
    def read(self, rel: str) -> bytes | None:
        """The content of file ``rel``, or None when there is none."""

    @abc.abstractmethod
    def write_atomic(self, rel: str, data: bytes) -> None:
        """Create or replace file ``rel`` with ``data`` (parents created): once it
        returns, ``data`` is durable; after a crash at any instant :meth:`read`
        returns the old or the new content, never a mix."""

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


def open_store(state_dir: str | os.PathLike[str], spark: SparkSession | None) -> StateStore:
    """The store of ``state_dir``: a plain path is a :class:`LocalStore`, a URI
    with a scheme a Hadoop store in ``spark``'s driver JVM. Without ``spark``
    (the ``twophase`` command), a URI is opened in a JVM of its own, with the
    Hadoop configuration a job's session would get
    (:func:`~lifecycle.state.hadoop_store.standalone`)."""
    if scheme_of(state_dir) is None:
        return LocalStore(state_dir)
    from lifecycle.state.hadoop_store import HadoopStore, standalone

    uri = os.fspath(state_dir)
    if spark is None:
        return standalone(uri)
    return HadoopStore.from_spark(uri, spark)


class LocalStore(StateStore):
    """A directory of the driver's own disk: write, ``fsync``, rename, ``fsync``
    the directory (:func:`lifecycle.state.files.atomic_write`)."""

    is_local = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, rel: str) -> Path:
        """The local path of ``rel``."""
        return self.root / check_rel(rel) if rel else self.root

    def read(self, rel: str) -> bytes | None:
        try:
            return self.path(rel).read_bytes()
        except FileNotFoundError:
            return None

    def write_atomic(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)

    def list(self, rel_dir: str) -> list[str]:
        try:
            names = os.listdir(self.path(rel_dir))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if not n.endswith(TMP))

    def delete(self, rel: str) -> None:
        path = self.path(rel)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        path.with_name(path.name + TMP).unlink(missing_ok=True)
        if path.parent.is_dir():
            fsync_dir(path.parent)

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def copy(self, rel: str, to: str) -> None:
        src, dst = self.path(rel), self.path(to)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)

    def uri(self, rel: str = "") -> str:
        return str(self.path(rel))
