"""Files of a Delta table's directory, local or in an object store, and the names
of staged files.

A task stages each data file as ``<partition dirs>/<txn>-<seq>.snappy.parquet``
(``<txn>`` is its transaction name, ``<seq>`` counts the task's files). Before
creating a data file it writes a small **staging marker**,
``_twophase/staged/<txn>-<seq>``, holding the data file's relative path. Readers
never see either: Delta readers read only files named in ``_delta_log``, and
directories starting with ``_`` are hidden from Spark, Hive and VACUUM.

Markers make lingering work cheap and safe to find: a sweep lists one small
directory (not the whole table) and learns exactly which data files a lost task
staged. A marker lives until its transaction is committed (the commit deletes
it) or aborted, so a sweep never even looks at a committed file, not even one a
later OPTIMIZE removed from the snapshot but that time travel still reads.

Local tables are written with the local file system and fsync'ed (files and the
directories that name them); object stores go through deltalake's own store
(``deltalake.fs.DeltaStorageHandler``), configured by the same
``storage_options`` as the table. (Its output stream takes ``bytes`` only and
always reports position 0, which breaks pyarrow's Parquet writer; writes go
through :class:`_ObjectOutput`, which fixes both.)

**Outages.** On an object store or HDFS, the reads of :class:`TableStorage`
(a file's info, a small file, a footer, a listing) are tried again while the
store is unreachable or restarting (refused connections, resets, timeouts,
``503``, a NameNode in safe mode: :func:`_unreachable`), with backoff, for up
to :data:`~sinks._retry.STORE_OUTAGE` seconds. A read changes nothing, so
trying it again is safe. So is the creation of a staging marker, a task's
first write (:meth:`TableStorage.put`): a try whose answer was lost is found
by the marker holding exactly its bytes. A data file that fails in the middle
fails its task, whose next attempt writes under names of its own (and waits
out the outage at its marker).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sinks._retry import STORE_OUTAGE, retry_transient
from sinks.delta.exclusive import S3Exclusive

T = TypeVar("T")

STAGING_DIR = "_twophase/staged"
SPARK_STAGING_DIR = "_twophase/spark"
"""Where Spark's Parquet writer stages a batch, one directory per transaction
(named after it), before its files move to their places (see
:mod:`sinks.delta.spark_stage`)."""
DATA_SUFFIX = ".snappy.parquet"
_STEM = re.compile(r"^(?P<txn>tp[12]\..+\.a\d+)-(?P<seq>\d+)$")


def file_stem(txn: str, seq: int) -> str:
    """The name shared by a staged data file (plus suffix) and its marker."""
    return f"{txn}-{seq:05d}"


def split_stem(stem: str) -> tuple[str, int] | None:
    """``(txn, seq)`` of a staged file stem, ``None`` when it is not one."""
    m = _STEM.match(stem)
    return (m["txn"], int(m["seq"])) if m else None


def marker_path(data_path: str) -> str:
    """The marker of a staged data file (given by its path relative to the table)."""
    name = data_path.rsplit("/", 1)[-1]
    return f"{STAGING_DIR}/{name.removesuffix(DATA_SUFFIX)}"


def local_root(table_uri: str) -> str | None:
    """The absolute local directory of ``table_uri``, ``None`` for an object store."""
    if table_uri.startswith("file://"):
        return os.path.abspath(table_uri[len("file://") :])
    if "://" in table_uri:
        return None
    return os.path.abspath(os.path.expanduser(table_uri))


_UNREACHABLE = re.compile(
    r"connection refused|connection reset|broken pipe|timed out|timeout|"
    r"safe ?mode|service unavailable|slow ?down|\b503\b|temporarily unavailable",
    re.IGNORECASE,
)


class _Unreachable(OSError):
    """A store read failed because the store is unreachable or restarting."""


def _unreachable(e: BaseException) -> bool:
    """Whether ``e`` says the store is unreachable or restarting (module doc)."""
    return not isinstance(e, FileNotFoundError) and _UNREACHABLE.search(str(e)) is not None


def parent_dir(rel: str) -> str:
    """The directory of the table-relative path ``rel`` (``""``: the table's root)."""
    return rel.rsplit("/", 1)[0] if "/" in rel else ""


class TableStorage:
    """Reads, writes, lists and deletes files by path relative to the table root.

    Picklable: the file system is opened lazily in each process."""

    def __init__(self, table_uri: str, storage_options: dict[str, str] | None = None) -> None:
        self.table_uri = table_uri
        self.storage_options = dict(storage_options or {})
        self.root = local_root(table_uri)
        self._fs: pafs.FileSystem | None = None
        self._store: Any = None  # deltalake's object-store handler (object stores only)
        self._s3 = (
            S3Exclusive(table_uri, self.storage_options)
            if table_uri.startswith(("s3://", "s3a://"))
            else None
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"] = state["_store"] = None
        return state

    @property
    def fs(self) -> pafs.FileSystem:
        """The pyarrow file system of the table (opened on first use)."""
        if self._fs is None:
            if self.root is not None:
                self._fs = pafs.LocalFileSystem()
            else:
                from deltalake.fs import DeltaStorageHandler

                handler = DeltaStorageHandler(self.table_uri, self.storage_options or None)
                self._store = handler._handler  # the raw store, for writes (see module doc)
                self._fs = pafs.PyFileSystem(handler)
        return self._fs

    def path(self, rel: str) -> str:
        """What ``self.fs`` calls the file at ``rel``."""
        return f"{self.root}/{rel}" if self.root is not None else rel

    # -- writing ---------------------------------------------------------------

    def open_output(self, rel: str) -> pa.NativeFile:
        """Create ``rel`` for streaming writes, exclusively: when a file of that
        name exists, raise :class:`FileExistsError` (never truncate it). Names
        carry the job's incarnation, run and task attempt, so a collision means
        something reused a name, which must never overwrite a committed file.

        Local disks: ``O_CREAT | O_EXCL``. Object stores: the name is checked
        before the upload starts. That check suffices because a data file is
        only created after its staging marker was, exclusively (:meth:`put`):
        of two writers of one name only the marker's creator gets here."""
        if self.root is not None:
            path = self.path(rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)  # ours now; the stream below only truncates our empty file
            return self.fs.open_output_stream(path)
        if self._store is None:
            _ = self.fs
        if self.info(rel) is not None:
            raise FileExistsError(f"{self.table_uri}/{rel} exists already; not overwriting it")
        return pa.PythonFile(_ObjectOutput(self._store.open_output_stream(rel, None)), mode="w")

    def put(self, rel: str, data: bytes) -> None:
        """Create a small file durably (fsync'ed on local disks), exclusively:
        :class:`FileExistsError` when a file of that name exists (on S3 a
        conditional PUT, see :mod:`sinks.delta.exclusive`)."""
        if self._s3 is not None:
            self._s3.create(rel, data)
            return
        if self.root is not None:
            with self.open_output(rel) as out:
                out.write(data)
            self.sync(rel)
            return
        unsure = False  # an earlier try may have created it and lost the answer

        def create() -> None:
            nonlocal unsure
            try:
                with self.open_output(rel) as out:
                    out.write(data)
            except FileExistsError:
                if unsure and self.read(rel) == data:
                    return
                raise
            except Exception as e:
                if not _unreachable(e):
                    raise
                unsure = True
                raise _Unreachable(f"creating {rel} of {self.table_uri}: {e}") from e

        retry_transient(
            create,
            what=f"creating {rel} of {self.table_uri}",
            transient=(_Unreachable,),
            deadline=STORE_OUTAGE,
        )

    def sync(self, rel: str) -> None:
        """Make ``rel`` and the directory entries leading to it durable (local only;
        an object store's PUT is durable when it returns)."""
        if self.root is None:
            return
        _fsync(self.path(rel))
        self.sync_dirs({parent_dir(rel)})

    # -- reading ---------------------------------------------------------------

    def _read_through(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, a read, tried again through an outage of a remote store
        (module docstring)."""
        if self.root is not None:
            return fn()

        def attempt() -> T:
            try:
                return fn()
            except Exception as e:
                if _unreachable(e):
                    raise _Unreachable(f"{what} of {self.table_uri}: {e}") from e
                raise

        return retry_transient(
            attempt,
            what=f"{what} of {self.table_uri}",
            transient=(_Unreachable,),
            deadline=STORE_OUTAGE,
        )

    def info(self, rel: str) -> tuple[int, int] | None:
        """``(size in bytes, modification time in ms)`` of ``rel``, ``None`` if missing."""
        fi = self._read_through(f"looking up {rel}", lambda: self.fs.get_file_info(self.path(rel)))
        if fi.type != pafs.FileType.File:
            return None
        mtime = fi.mtime_ns // 1_000_000 if fi.mtime_ns is not None else 0
        return fi.size, mtime

    def read(self, rel: str) -> bytes | None:
        """The content of a small file, ``None`` if it is missing."""

        def read() -> bytes | None:
            try:
                with self.fs.open_input_stream(self.path(rel)) as f:
                    return bytes(f.read())
            except FileNotFoundError:
                return None

        return self._read_through(f"reading {rel}", read)

    def parquet_metadata(self, rel: str) -> pq.FileMetaData:
        """The footer of the Parquet file ``rel`` (schema, row groups, statistics)."""

        def footer() -> pq.FileMetaData:
            with self.fs.open_input_file(self.path(rel)) as f:
                return pq.ParquetFile(f).metadata

        return self._read_through(f"reading the footer of {rel}", footer)

    def _listing(self, rel_dir: str) -> list[pafs.FileInfo]:
        sel = pafs.FileSelector(self.path(rel_dir), allow_not_found=True, recursive=False)
        return self._read_through(f"listing {rel_dir}", lambda: self.fs.get_file_info(sel))

    def list_files(self, rel_dir: str) -> list[str]:
        """Names of the files directly in ``rel_dir`` (empty when it does not exist)."""
        return [fi.base_name for fi in self._listing(rel_dir) if fi.type == pafs.FileType.File]

    def list_dirs(self, rel_dir: str) -> list[str]:
        """Names of the directories directly in ``rel_dir`` (empty when it does not exist)."""
        return [fi.base_name for fi in self._listing(rel_dir) if fi.type == pafs.FileType.Directory]

    # -- moving (local tables) ---------------------------------------------------

    def move_new(self, src: str, dst: str) -> None:
        """Move the local file ``src`` to ``dst`` (both relative to the table),
        exclusively: :class:`FileExistsError` when ``dst`` exists (a hard link,
        then the old name removed; never overwrites). Not durable until
        :meth:`sync_dirs` of the directories involved."""
        if self.root is None:
            raise NotImplementedError(f"{self.table_uri}: moving files needs a local table")
        target = self.path(dst)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.link(self.path(src), target)
        os.unlink(self.path(src))

    def sync_dirs(self, rel_dirs: set[str]) -> None:
        """fsync each of ``rel_dirs`` (relative directories, ``""`` the root) and
        the directories above them (local tables; a no-op on object stores)."""
        if self.root is None:
            return
        todo: set[str] = set()
        for d in rel_dirs:
            d = d.strip("/")
            while True:
                todo.add(d)
                if not d:
                    break
                d = parent_dir(d)
        for d in sorted(todo, key=lambda x: -x.count("/")):
            _fsync(self.path(d) if d else self.root)

    # -- deleting --------------------------------------------------------------

    def delete_tree(self, rel_dir: str) -> None:
        """Delete the directory ``rel_dir`` and everything in it; missing is fine."""
        if not rel_dir.strip("/") or ".." in rel_dir.split("/"):
            raise ValueError(f"refusing to delete {rel_dir!r} of {self.table_uri}")
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_dir(self.path(rel_dir))

    def delete_staged(self, rel: str) -> None:
        """Delete the staged data file ``rel`` and, on HDFS, what its writer's
        client left of it: deltalake's HDFS client writes ``.<name>.tmp.<n>``
        beside the file and renames it at the end, so a write cut short (a
        NameNode restart, a killed task) leaves that behind."""
        self.delete(rel)
        if not self.table_uri.startswith("hdfs://"):
            return
        parent, name = parent_dir(rel), rel.rsplit("/", 1)[-1]
        partial = re.compile(rf"^\.{re.escape(name)}\.tmp\.\d+$")
        for left in self.list_files(parent):
            if partial.match(left):
                self.delete(f"{parent}/{left}" if parent else left)

    def delete(self, rel: str) -> None:
        """Delete ``rel``; a missing file is fine."""
        try:
            self.fs.delete_file(self.path(rel))
        except FileNotFoundError:
            pass
        except OSError:
            if self.info(rel) is not None:  # object stores may not say "not found"
                raise


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _ObjectOutput:
    """File-like adapter of deltalake's object-store output stream (a multipart
    upload): accepts any buffer, and counts the position, which the Parquet writer
    needs for the offsets it records in the footer."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._pos = 0
        self.closed = False

    def write(self, data: Any) -> int:
        b = bytes(data)
        self._raw.write(b)
        self._pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self._pos

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._raw.close()
