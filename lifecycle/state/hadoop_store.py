"""The state store on a Hadoop-compatible URI, through Spark's Hadoop
FileSystem in the driver JVM (``Path(uri).getFileSystem(hadoopConfiguration)``).

Only the driver calls it (py4j into its own JVM); executors never see it.
Which schemes work is whatever Spark's classpath holds: PySpark's bundled Hadoop
client has ``file``, ``viewfs``, ``har``, ``http(s)``, ``webhdfs`` and the HDFS
client; ``s3a`` and ``abfss`` need the user's jars (``hadoop-aws``,
``hadoop-azure`` of the same Hadoop version), and a scheme without a client is
refused at :func:`open_store <lifecycle.state.store.open_store>` with a
:class:`~sinks.errors.ConfigError` saying so.

**Atomic replace.** ``FileSystem.rename`` does not overwrite on several file
systems (HDFS, and Hadoop's ``LocalFileSystem`` behind ``file://`` and
``viewfs://`` here: it returns false), and an object store has no atomic rename
at all. So :meth:`HadoopStore.write_atomic` takes the same steps everywhere:

1. write ``NAME.part`` (created with overwrite: a crashed writer's is garbage),
   ``hsync``, close;
2. no ``NAME`` yet: rename ``NAME.part`` -> ``NAME``; done;
3. else rename ``NAME.part`` -> ``NAME.tmp`` (now complete), delete ``NAME``,
   rename ``NAME.tmp`` -> ``NAME``.

A crash in step 1 leaves ``NAME`` as it was; between the delete and the last
rename, only ``NAME.tmp`` holds the content and it is complete, so
:meth:`~HadoopStore.read` (and :meth:`~HadoopStore.exists`) fall back to
``NAME.tmp`` when ``NAME`` is missing, and the next write or delete of the file
tidies it. ``NAME.part`` is never read. A reader concurrent with a writer looks
for ``NAME``, ``NAME.tmp``, then ``NAME`` again, so it finds one of them while
one write is under way.

Durability is the file system's: ``hsync`` then close (HDFS: on the
datanodes' disks; an object store: the upload completes at close).

**Exclusive create.** :meth:`HadoopStore.create` makes a file only if its
name is free, atomically, for the ledger's records
(:mod:`lifecycle.state.store_ledger`). On ``s3a://`` it is S3's conditional
PUT (``If-None-Match: *``, Hadoop 3.5's ``createFile()`` option
``fs.option.create.conditional.overwrite``): the upload happens at close, and
the store refuses it with 412 when the name exists. On HDFS it writes a
temporary file of the try's own (``NAME.<random>.part``) and renames it to
``NAME``, a rename the NameNode refuses when ``NAME`` exists. On ``file://``
Hadoop's rename replaces an existing file (or checks, then renames), so the
local store's create runs on the path (a temporary file, then ``link(2)``);
a ``viewfs://`` mount is judged by the scheme of its target. A name found
taken is read: when it holds exactly the bytes written, a try whose answer was
lost had succeeded. Other schemes (no atomic create known here) are refused.

**Retries.** Hadoop's HDFS client does not retry every call through a
NameNode restart: the first call after one fails with ``EOFException``, and
calls while it is down with ``ConnectException``. Each operation of the store
is therefore tried again, whole, with backoff, for up to
:data:`~sinks._retry.STORE_OUTAGE` seconds when it fails with an
``IOException`` that can pass (:func:`_passes`: not a missing file, a refused
permission or a name taken). Every operation is idempotent as a whole:
:meth:`~HadoopStore.write_atomic` starts again from writing ``NAME.part``, and
the steps above find ``NAME`` or ``NAME.tmp`` in whatever state an interrupted
try left them.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

from py4j.java_gateway import is_instance_of
from py4j.protocol import Py4JJavaError

from lifecycle.state.files import create_exclusive
from lifecycle.state.store_interface import TMP, StateStore, check_rel, scheme_of
from sinks._retry import STORE_OUTAGE, retry_transient
from sinks.errors import ConfigError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PART = ".part"
"""suffix of the file being written, never read"""

T = TypeVar("T")

_REFUSALS = (
    "java.nio.file.AccessDeniedException",
    "org.apache.hadoop.security.AccessControlException",
    "org.apache.hadoop.fs.s3a.CredentialInitializationException",
)
"""the file system refused the credentials, or what they may do"""

_LASTING = (
    *_REFUSALS,
    "java.io.FileNotFoundException",
    "org.apache.hadoop.fs.FileAlreadyExistsException",
    "org.apache.hadoop.fs.s3a.RemoteFileChangedException",
    "org.apache.hadoop.fs.ParentNotDirectoryException",
    "org.apache.hadoop.fs.UnsupportedFileSystemException",
)
"""``IOException``s that a retry cannot mend"""


_TAKEN = (
    "org.apache.hadoop.fs.FileAlreadyExistsException",
    "org.apache.hadoop.fs.s3a.RemoteFileChangedException",
)
"""a create refused because the name exists (S3A: 412 to the conditional PUT)"""


class _Passing(OSError):
    """A store call failed with an ``IOException`` that can pass (a restart)."""


_CONDITIONAL = "fs.option.create.conditional.overwrite"
"""S3A's ``createFile()`` option for a PUT with ``If-None-Match: *`` (Hadoop 3.5)"""

_HINTS = {
    "s3a": "hadoop-aws (and its AWS SDK bundle)",
    "abfs": "hadoop-azure",
    "abfss": "hadoop-azure",
    "gs": "the GCS connector",
}


class HadoopStore(StateStore):
    """A ``state_dir`` URI on a Hadoop FileSystem (module docstring)."""

    is_local = False

    def __init__(self, root: str, jvm: Any, hadoop_conf: Any, gateway: Any) -> None:
        """``jvm``, ``hadoop_conf`` and ``gateway``: a py4j JVM view, a Hadoop
        ``Configuration`` in it and its gateway (:meth:`from_spark`, :func:`standalone`)."""
        self.root = root.rstrip("/")
        self._rule: str | None = None  # how create() is atomic (_create_rule)
        self._jvm = jvm
        self._conf = hadoop_conf
        self._gateway = gateway
        try:
            self._fs = jvm.org.apache.hadoop.fs.Path(self.root).getFileSystem(hadoop_conf)
        except Py4JJavaError as e:
            scheme = scheme_of(self.root) or ""
            jars = _HINTS.get(scheme, f"a Hadoop FileSystem for {scheme!r}")
            raise ConfigError(
                f"state_dir {self.root}: Spark's Hadoop client cannot open it "
                f"({_java_message(e)}). Put {jars} on the driver's classpath "
                "(spark.jars.packages or spark.jars) and configure the file system "
                "(spark.hadoop.* settings, core-site.xml)"
            ) from None

    @classmethod
    def from_spark(cls, root: str, spark: SparkSession) -> HadoopStore:
        """On ``spark``'s driver JVM with its Hadoop configuration (the one its
        queries use: ``spark.hadoop.*`` settings, ``core-site.xml``)."""
        sc = spark.sparkContext
        return cls(root, sc._jvm, sc._jsc.hadoopConfiguration(), sc._gateway)

    # -- names ----------------------------------------------------------------------

    def uri(self, rel: str = "") -> str:
        return f"{self.root}/{check_rel(rel)}" if rel else self.root

    def _path(self, rel: str, suffix: str = "") -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(self.uri(rel) + suffix)

    def _not_found(self, e: Py4JJavaError) -> bool:
        missing = is_instance_of(self._gateway, e.java_exception, "java.io.FileNotFoundException")
        return bool(missing)

    # -- the interface -----------------------------------------------------------------

    def _retried(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, tried again while it fails in a way that passes (module
        docstring); :class:`~sinks.errors.CommitError` after
        :data:`~sinks._retry.STORE_OUTAGE` seconds of that."""

        def attempt() -> T:
            try:
                return fn()
            except Py4JJavaError as e:
                if _passes(e):
                    raise _Passing(f"{what} {self.root}: {_java_message(e)}") from e
                if _named(e, _REFUSALS):
                    raise ConfigError(
                        f"state_dir {self.root}: the file system refused {what} it "
                        f"({_java_message(e)}). Check the credentials it is given (for "
                        "s3a: fs.s3a.access.key and fs.s3a.secret.key, or "
                        "fs.s3a.aws.credentials.provider, as spark.hadoop.* settings or in "
                        "core-site.xml) and what they may do there"
                    ) from None
                raise

        return retry_transient(
            attempt,
            what=f"state store: {what} {self.root}",
            transient=(_Passing,),
            deadline=STORE_OUTAGE,
        )

    def read(self, rel: str) -> bytes | None:
        return self._retried(f"reading {rel} of", lambda: self._read_any(rel))

    def _read_any(self, rel: str) -> bytes | None:
        for suffix in ("", TMP, ""):  # NAME.tmp: a replace caught by a crash (docstring)
            data = self._read(self._path(rel, suffix))
            if data is not None:
                return data
        return None

    def _read(self, path: Any) -> bytes | None:
        # exists() first: a Java exception costs several py4j round trips, and a
        # missing file is the common case (a stop request, polled by the run loop)
        if not self._fs.exists(path):
            return None
        try:
            stream = self._fs.open(path)
        except Py4JJavaError as e:
            if self._not_found(e):  # deleted since
                return None
            raise
        try:
            return bytes(self._jvm.org.apache.hadoop.io.IOUtils.readFullyToByteArray(stream))
        except Py4JJavaError as e:
            if self._not_found(e):  # S3A opens lazily: deleted before the first read
                return None
            raise
        finally:
            stream.close()

    def write_atomic(self, rel: str, data: bytes) -> None:
        self._retried(f"writing {rel} of", lambda: self._write_atomic(rel, data))

    def _write_atomic(self, rel: str, data: bytes) -> None:
        path, part, tmp = self._path(rel), self._path(rel, PART), self._path(rel, TMP)
        self._write_synced(part, data, overwrite=True)
        if self._fs.exists(path):
            self._fs.delete(tmp, False)  # a crashed replace's; NAME is readable meanwhile
            self._rename(part, tmp)
            self._fs.delete(path, False)  # from here until the rename, NAME.tmp is read
            self._rename(tmp, path)
        else:
            self._rename(part, path)
            self._fs.delete(tmp, False)  # older than NAME now, if a crash left one

    def _create_rule(self) -> str:
        """How :meth:`create` is atomic here: ``"conditional"`` (S3A's
        conditional PUT), ``"rename"`` (HDFS: the NameNode refuses a rename onto
        an existing name), ``"link"`` (a local file system: ``link(2)``), or
        ``""`` (none known). A ``viewfs://`` mount is judged by its target."""
        if self._rule is None:
            scheme = (scheme_of(self.root) or "").lower()
            if scheme == "viewfs":
                target = self._retried("resolving", self._resolved_root)
                scheme = (scheme_of(target) or "").lower()
            self._rule = {"s3a": "conditional", "hdfs": "rename", "file": "link"}.get(scheme, "")
        return self._rule

    def _resolved_root(self) -> str:
        """The URI ``root`` resolves to through a mount table (created first)."""
        root = self._path("")
        self._fs.mkdirs(root)
        return str(self._fs.resolvePath(root).toUri())

    @property
    def creates_atomically(self) -> bool:  # type: ignore[override]
        return bool(self._create_rule())

    def create(self, rel: str, data: bytes) -> None:
        rule = self._create_rule()
        if not rule:
            raise ConfigError(
                f"state_dir {self.root}: no atomic create-if-absent is known here for "
                f"{scheme_of(self.root)}:// (hdfs, s3a, file, and viewfs over them, have one)"
            )
        if rule == "link":
            self._create_local(rel, data)
            return
        taken = self._retried(f"creating {rel} in", lambda: self._create(rel, data, rule))
        if taken:
            raise FileExistsError(f"{self.uri(rel)} exists (written by another writer)")

    def _create_local(self, rel: str, data: bytes) -> None:
        """``file://`` (or a mount onto it): Hadoop's local rename replaces an
        existing file or checks and then renames, so the create is the local
        store's own (a complete temporary file, then ``link(2)``)."""
        uri = self._retried("resolving", self._resolved_root)
        create_exclusive(Path(urlparse(uri).path) / check_rel(rel), data)

    def _create(self, rel: str, data: bytes, rule: str) -> bool:
        """Create ``rel``; whether the name was taken by other bytes."""
        path = self._path(rel)
        if rule == "conditional":
            builder = self._fs.createFile(path).overwrite(False).must(_CONDITIONAL, True)
            try:
                out = builder.build()
                try:
                    out.write(bytearray(data))
                finally:
                    out.close()
                return False
            except Py4JJavaError as e:
                if not _named(e, _TAKEN):
                    raise
        else:
            # a name of this try's own: two writers never share a temporary file
            part = self._path(rel, f".{secrets.token_hex(8)}{PART}")
            try:
                self._write_synced(part, data, overwrite=False)
                if self._fs.rename(part, path):
                    return False
            finally:
                self._fs.delete(part, False)
        found = self._read(path)
        if found is None:
            raise OSError(f"state store: could not create {self.uri(rel)}")
        return found != data

    def _write_synced(self, path: Any, data: bytes, *, overwrite: bool) -> None:
        """Write the file ``path`` whole, ``hsync`` it and close it."""
        out = self._fs.create(path, overwrite)
        try:
            out.write(bytearray(data))
            out.hsync()
        finally:
            out.close()

    def _rename(self, src: Any, dst: Any) -> None:
        if not self._fs.rename(src, dst):
            raise OSError(f"state store: could not rename {src} to {dst}")

    def _list(self, rel_dir: str) -> list[str]:
        path = self._path(rel_dir)
        if not self._fs.exists(path):
            return []
        try:
            statuses = self._fs.listStatus(path)
        except Py4JJavaError as e:
            if self._not_found(e):
                return []
            raise
        names = {s.getPath().getName() for s in statuses}
        return sorted(n for n in names if not n.endswith((TMP, PART)))

    def list(self, rel_dir: str) -> list[str]:
        return self._retried(f"listing {rel_dir} of", lambda: self._list(rel_dir))

    def delete(self, rel: str) -> None:
        self._retried(f"deleting {rel} of", lambda: self._delete(rel))

    def _delete(self, rel: str) -> None:
        self._fs.delete(self._path(rel), True)
        self._fs.delete(self._path(rel, TMP), False)
        self._fs.delete(self._path(rel, PART), False)

    def copy(self, rel: str, to: str) -> None:
        self._retried(f"copying {rel} to {to} in", lambda: self._copy(rel, to))

    def _copy(self, rel: str, to: str) -> None:
        fs_util = self._jvm.org.apache.hadoop.fs.FileUtil
        if not fs_util.copy(self._fs, self._path(rel), self._fs, self._path(to), False, self._conf):
            raise OSError(f"state store: could not copy {self.uri(rel)} to {self.uri(to)}")

    def exists(self, rel: str) -> bool:
        return self._retried(
            f"looking for {rel} in",
            lambda: bool(self._fs.exists(self._path(rel)) or self._fs.exists(self._path(rel, TMP))),
        )


def standalone(root: str) -> HadoopStore:
    """A store on ``root`` for a process without a SparkSession (the ``twophase``
    command): the active SparkContext's JVM when there is one, else a JVM of its
    own (PySpark's gateway, no SparkContext: a few seconds, no executors), with
    the Hadoop configuration a job's session would get: ``core-site.xml`` from
    ``HADOOP_CONF_DIR`` and the ``spark.hadoop.*`` settings of
    ``spark-defaults.conf`` or ``PYSPARK_SUBMIT_ARGS``."""
    from pyspark import SparkContext

    active = SparkContext._active_spark_context
    if active is not None:
        return HadoopStore(root, active._jvm, active._jsc.hadoopConfiguration(), active._gateway)
    SparkContext._ensure_initialized()
    jvm, gateway = SparkContext._jvm, SparkContext._gateway
    conf = jvm.org.apache.hadoop.conf.Configuration()  # type: ignore[union-attr]
    prefix = "spark.hadoop."
    for kv in jvm.org.apache.spark.SparkConf(True).getAll():  # type: ignore[union-attr]
        key, value = kv._1(), kv._2()
        if key.startswith(prefix):
            conf.set(key[len(prefix) :], value)
    return HadoopStore(root, jvm, conf, gateway)


def _passes(e: Py4JJavaError) -> bool:
    """Whether the Java exception of ``e`` is an ``IOException`` a retry may
    mend: not one of :data:`_LASTING`."""
    return "java.io.IOException" in _classes(e) and not _named(e, _LASTING)


def _named(e: Py4JJavaError, classes: tuple[str, ...]) -> bool:
    """Whether the Java exception of ``e`` is one of ``classes``, or a
    NameNode's answer naming one (``RemoteException.getClassName``). By the
    names of its class and superclasses: a class of ``classes`` that the JVM
    does not have (S3A's, in a session without its jars) is simply not it."""
    names = _classes(e)
    if names.intersection(classes):
        return True
    if "org.apache.hadoop.ipc.RemoteException" in names:
        return str(e.java_exception.getClassName()) in classes
    return False


def _classes(e: Py4JJavaError) -> set[str]:
    """The names of the Java exception's class and its superclasses."""
    names: set[str] = set()
    cls = e.java_exception.getClass()
    while cls is not None:
        names.add(str(cls.getName()))
        cls = cls.getSuperclass()
    return names


def _java_message(e: Py4JJavaError) -> str:
    """``Class: message`` of a Java exception, without the stack trace."""
    try:
        exc = e.java_exception
        return f"{exc.getClass().getSimpleName()}: {exc.getMessage()}"
    except Exception:
        return str(e).split("\n", 1)[0]
