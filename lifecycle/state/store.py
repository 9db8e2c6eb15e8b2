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

The interface every store implements, and the rules of names, are in
:mod:`lifecycle.state.store_interface` (the Hadoop store imports them from
there, so this module alone knows both stores).

Besides the store only the file ledger (a local directory: it needs ``fsync``
and ``flock``) opens a state file itself.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle.state.files import atomic_write, create_exclusive, fsync_dir
from lifecycle.state.store_interface import TMP, StateStore, check_rel, scheme_of

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


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

    def create(self, rel: str, data: bytes) -> None:
        create_exclusive(self.path(rel), data)

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
