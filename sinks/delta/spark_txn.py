"""Commits through delta-spark's own transaction, for tables whose features
delta-rs cannot write.

The sink commits with delta-rs (:mod:`sinks.delta.committer`), which refuses
any commit to a table whose protocol lists a writer feature it does not
implement. Tables made by delta-spark often list such features
(:mod:`sinks.delta.spark_features` says which tables, and whether the driver has
delta-spark). For those the driver commits through delta-spark's
``OptimisticTransaction`` instead (the JVM of the job's own Spark session, over
py4j), so the commit is the one delta-spark itself would make:

* **row tracking**: fresh row ids (``baseRowId``) and
  ``defaultRowCommitVersion`` on every added file, and the table's high-water
  mark (``delta.rowTracking`` domain) moved on;
* **in-commit timestamps**: ``inCommitTimestamp`` in the commit, monotonic;
* **liquid clustering**, **domain metadata**: kept as they are (added files are
  unclustered until delta-spark's OPTIMIZE clusters them, as with any append);
* **v2 checkpoints**, checksums and log cleanup: delta-spark's post-commit hooks;
* **type widening**: files are written with the table's current (widened) types;
* **rewrites** (a keyed merge, a replace) of tables with deletion vectors, the
  change data feed or column mapping
  (:data:`~sinks.delta.spark_features.REWRITE_FEATURES`): the files are
  read, removed and written through the transaction
  (:mod:`sinks.delta.spark_rewrite`).

The rules the sink's protocol needs from it:

1. **What was read is what is checked.** The app-transaction versions the
   commit's checks read (owner, previous, the incarnation's progress) are read
   through the same transaction (``txnVersion``), which records them: a
   concurrent commit that sets any of them fails this one with delta-spark's
   ``ConcurrentTransactionException``. Every conflict delta-spark reports is
   raised as :class:`DeltaSparkConflict` (a ``CommitFailedError``), so the
   caller runs its checks again on the new snapshot, exactly as after a failed
   delta-rs commit. A blind append by another writer is no conflict: delta-spark
   commits on top of it. The deltalake snapshot the other checks read (the
   table's features and schema, the files already committed) is moved to the
   transaction's read version (:func:`open_if_needed`), so no check is made on
   another version than the one committed on: a metadata or protocol change
   since is delta-spark's conflict too.
2. **One version, the app transaction inside.** A data commit carries
   ``txn(app id, highest batch)`` beside its files, as the delta-rs path does.
   It is recorded as delta-spark's streaming sink records its own: operation
   ``STREAMING UPDATE`` with ``queryId`` the app id and ``epochId`` the batch,
   and the metrics ``DESCRIBE HISTORY`` shows for it (files and rows added).
3. **Refusals are final, I/O is not.** A Java I/O error is raised as
   ``OSError`` (retried until the sink's ``commit_timeout``, as delta-rs's
   are); anything else delta-spark refuses (a protocol it does not support,
   an invalid action) as :class:`~sinks.errors.CommitRefusedError`: retrying
   cannot pass it.
4. **A commit that landed is not a failure.** When the commit raises after
   its version was written (a post-commit hook that throws), the table's app
   transactions show it, and it counts as done.
5. **Only what commits needs Spark.** A claim reads through deltalake and
   opens a transaction only when it has a claim to commit, so ``twophase
   recover`` (no Spark) reads such tables; committing to them needs the job.

Only tables the job's Spark reaches (:func:`~sinks.delta.spark_features.route`:
local and shared-filesystem, HDFS, and S3 when nothing else commits while the
job runs), and only a driver whose Spark session has delta-spark's jars.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pyarrow as pa
from deltalake import DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction

from sinks.delta import progress
from sinks.delta.spark_features import (
    DeltaSparkMissingError,
    SparkRoute,
    missing_advice,
    needed,
    session,
)
from sinks.errors import CommitRefusedError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_CONFLICT_CLASS = "java.util.ConcurrentModificationException"


class DeltaSparkConflict(CommitFailedError):
    """Another writer's commit conflicts with this one (delta-spark's
    ``Concurrent...Exception``): check again on the new snapshot."""


def data_files(written: Sequence[Any]) -> list[Any]:
    """The data files (``AddFile``) among file actions ``written`` (:meth:`SparkTxn.write`),
    without the change-data files (``AddCDCFile``)."""
    return [w for w in written if str(w.getClass().getSimpleName()) == "AddFile"]


def open_if_needed(
    dt: DeltaTable, spark_route: SparkRoute, where: str, *, rewrites: bool = False
) -> SparkTxn | None:
    """A delta-spark transaction when the table ``dt`` needs one
    (:func:`~sinks.delta.spark_features.needed`,
    ``rewrites``: the commit removes files), else ``None`` (delta-rs commits).
    ``spark_route``: how delta-spark reaches the table
    (:func:`~sinks.delta.spark_features.route`). ``dt`` is moved to the
    transaction's snapshot, so that every check made on it (features, schema,
    the files committed) is of the version the commit builds on: a change after
    it is delta-spark's conflict, never unchecked (rule 1)."""
    features = needed(dt, rewrites=rewrites)
    if not features:
        return None
    if spark_route.uri is None:
        raise CommitRefusedError(
            f"{where} has the table feature(s) {features}, which only delta-spark's commit "
            f"honours, and that needs {spark_route.refused}"
        )
    txn = SparkTxn.open(spark_route.uri, where)  # refuses a session without delta-spark
    _check_same_table(dt, txn.table_id, spark_route.uri, where)
    if dt.version() != txn.read_version:
        dt.load_as_version(txn.read_version)
    return txn


def check_reaches(dt: DeltaTable, uri: str, where: str) -> None:
    """Refuse when delta-spark, at ``uri``, reads another table than ``dt`` (a
    session whose S3A points at another endpoint, say); preflight's check, on
    the latest version (a transaction never committed)."""
    _check_same_table(dt, SparkTxn.open(uri, where).table_id, uri, where)


def _table_id(snapshot: Any) -> str | None:
    """The table id of a delta-spark snapshot, ``None`` when it has no version."""
    return None if int(snapshot.version()) < 0 else str(snapshot.metadata().id())


def _check_same_table(dt: DeltaTable, spark_id: str | None, uri: str, where: str) -> None:
    ours = str(dt.metadata().id)
    if spark_id == ours:
        return
    seen = f"as the table {spark_id}" if spark_id is not None else "no table there"
    raise CommitRefusedError(
        f"{where}: delta-spark reaches {uri} and finds {seen}, not the table {ours} "
        "deltalake reads: configure the job's Spark session for the same store as the "
        "sink's storage_options (on S3: spark.hadoop.fs.s3a.endpoint, its credentials "
        "and path-style access, or per bucket: spark.hadoop.fs.s3a.bucket.<bucket>.*)"
    )


@dataclass
class SparkTxn:
    """One delta-spark transaction on a table, started on its latest version."""

    _spark: Any
    _txn: Any

    @classmethod
    def open(cls, uri: str, where: str) -> SparkTxn:
        """A transaction on the table delta-spark reaches at ``uri``
        (:attr:`~sinks.delta.spark_features.SparkRoute.uri`)."""
        spark = session()
        if spark is None:
            raise DeltaSparkMissingError(
                f"{where} has table features that only delta-spark's commit honours; "
                + missing_advice()
            )
        jvm = spark._jvm
        assert jvm is not None  # a live session's gateway
        delta_log = jvm.org.apache.spark.sql.delta.DeltaLog
        txn = _guarded(
            spark, lambda: delta_log.forTable(spark._jsparkSession, uri).startTransaction()
        )
        return cls(spark, txn)

    @property
    def read_version(self) -> int:
        return int(self._txn.readVersion())

    @property
    def table_id(self) -> str | None:
        """The id of the table read, ``None`` when it has no version."""
        return _table_id(self._txn.snapshot())

    def transaction_version(self, app: str) -> int | None:
        """The app's version in this transaction's snapshot (recorded as read)."""
        v = int(_guarded(self._spark, lambda: self._txn.txnVersion(app)))
        return None if v < 0 else v

    @property
    def spark(self) -> SparkSession:
        return self._spark

    @property
    def jvm_txn(self) -> Any:
        """delta-spark's ``OptimisticTransaction`` (a py4j object)."""
        return self._txn

    def live_files(self, paths: Collection[str]) -> list[Any]:
        """The snapshot's ``AddFile`` actions (JVM) of the table-relative paths
        ``paths`` (as stored, not URI-encoded), marking the whole table as read
        by this transaction: any commit since that removes a file, or adds one
        other than by a blind append, is a conflict (rule 1). Raises
        :class:`DeltaSparkConflict` when a path is not in the snapshot."""
        from pyspark.sql import functions as F

        self._txn.readWholeTable()
        wanted = set(paths)
        if not wanted:
            return []
        files = self._txn.snapshot().allFiles()
        # one job over the snapshot's files: paths are stored URI-encoded, and
        # url_decode also reads "+" as a space, which a stored path never means
        decoded = F.expr("url_decode(replace(path, '+', '%2B'))")
        found = files.where(decoded.isin(sorted(wanted))._jc).collectAsList()
        actions = [found.get(i) for i in range(found.size())]
        if len(actions) != len(wanted):
            raise DeltaSparkConflict(
                f"{len(wanted) - len(actions)} planned file(s) are not in version "
                f"{self.read_version}: plan again"
            )
        return actions

    def read(self, files: Sequence[Any]) -> DataFrame:
        """The rows of ``files`` (``AddFile`` actions of this snapshot) as delta-spark
        reads them: logical column names, the rows their deletion vectors delete
        left out, and with row tracking the columns that keep each row's id and
        commit version when it is written again (delta-spark's MERGE does the same)."""
        from pyspark.sql import DataFrame

        jvm = self._spark._jvm
        snapshot = self._txn.snapshot()
        seq = _seq(jvm, files)
        jdf = self._txn.deltaLog().createDataFrame(snapshot, seq, False, jvm.scala.Option.empty())
        row_tracking = jvm.org.apache.spark.sql.delta.RowTracking
        return DataFrame(row_tracking.preserveRowTrackingColumns(jdf, snapshot), self._spark)

    def write(self, df: DataFrame) -> list[Any]:
        """Write ``df`` through delta-spark's transactional writer: physical names
        and field ids, statistics, constraints, the materialized row-tracking
        columns, and rows with a ``_change_type`` into change-data files. Returns
        the file actions (JVM ``AddFile`` and ``AddCDCFile``) to commit."""
        written = self._txn.writeFiles(df._jdf).iterator()
        actions = []
        while written.hasNext():
            actions.append(written.next())
        return actions

    def commit(
        self,
        adds: Sequence[AddAction],
        txns: Sequence[Transaction],
        *,
        epoch: tuple[str, int] | None = None,
        removed: Sequence[Any] = (),
        written: Sequence[Any] = (),
        marked: Sequence[Any] = (),
        tags: dict[str, str] | None = None,
    ) -> int:
        """Commit ``adds``, ``txns``, the removes of ``removed`` (``AddFile``
        actions of this snapshot, removed with their deletion vectors and row
        ids), the file actions ``written`` (:meth:`write`) and ``marked`` (files
        added again with a new deletion vector and the removes of their old one,
        :func:`sinks.delta.spark_dv.mark_deleted`) as one version; returns it.

        ``epoch``: ``(query id, batch)`` of a data commit, recorded as a
        ``STREAMING UPDATE`` (output mode ``Update`` when it removes files);
        ``None``: a commit without data (a claim). ``tags``: written into the
        version's ``commitInfo.tags``."""
        jvm = self._spark._jvm
        actions = [_add_json(a) for a in adds] + [_txn_json(t) for t in txns]
        now = int(time.time() * 1000)

        def commit() -> int:
            parsed = jvm.java.util.ArrayList()
            for a in actions:
                parsed.add(jvm.org.apache.spark.sql.delta.actions.Action.fromJson(json.dumps(a)))
            for w in [*written, *marked]:
                parsed.add(w)
            for f in removed:
                parsed.add(f.removeWithTimestamp(now, True))
            seq = jvm.scala.jdk.javaapi.CollectionConverters.asScala(parsed).toSeq()
            ops = jvm.org.apache.spark.sql.delta
            if epoch is None:
                op = getattr(getattr(ops, "DeltaOperations$ManualUpdate$"), "MODULE$")
            else:
                modes = jvm.org.apache.spark.sql.streaming.OutputMode
                op = getattr(ops, "DeltaOperations$StreamingUpdate")(
                    modes.Update() if removed or marked else modes.Append(),
                    epoch[0],
                    epoch[1],
                    jvm.scala.Option.apply(progress.user_metadata(*epoch)),
                )
                self._register_metrics(adds, written, removed, marked)
            if tags:
                return int(self._txn.commit(seq, op, _scala_map(jvm, tags)))
            return int(self._txn.commit(seq, op))

        try:
            return int(_guarded(self._spark, commit))
        except DeltaSparkConflict:
            raise
        except Exception:
            # A commit can land and still raise (a post-commit hook that throws):
            # the app transactions it carried say so.
            if txns and self._landed(txns):
                return -1
            raise

    def _landed(self, txns: Sequence[Transaction]) -> bool:
        """Whether the table's latest version holds every app transaction of
        ``txns`` (a driver's commits of one app id follow one another)."""
        try:
            fresh = self._txn.deltaLog().startTransaction()
            return all(int(fresh.txnVersion(t.app_id)) == int(t.version) for t in txns)
        except Exception:
            return False

    def _register_metrics(
        self,
        adds: Sequence[AddAction],
        written: Sequence[Any],
        removed: Sequence[Any],
        marked: Sequence[Any] = (),
    ) -> None:
        """What ``DESCRIBE HISTORY`` shows for a streaming update (data files
        only: change-data files are neither rows nor files of the table; a file
        added again with a new deletion vector counts as a vector, not a file)."""
        jvm = self._spark._jvm
        rows, size = progress.added_totals(adds)
        data = data_files(written)
        for w in data:
            rows += int(json.loads(w.stats() or "{}").get("numRecords", 0))
            size += int(w.size())
        values = {
            "numAddedFiles": len(adds) + len(data),
            "numRemovedFiles": len(removed) + len(marked) - len(data_files(marked)),
            "numDeletionVectorsAdded": len(data_files(marked)),
            "numOutputRows": rows,
            "numOutputBytes": size,
        }
        metrics = {}
        sc = self._spark.sparkContext._jsc.sc()
        for name, value in values.items():
            m = jvm.org.apache.spark.sql.execution.metric.SQLMetrics.createMetric(sc, name)
            m.set(int(value))
            metrics[name] = m
        self._txn.registerSQLMetrics(self._spark._jsparkSession, _scala_map(jvm, metrics))


def add_columns(uri: str, fields: Sequence[pa.Field], where: str) -> None:
    """Add nullable columns in one version through delta-spark's ``ALTER TABLE
    ... ADD COLUMNS`` (schema evolution of a table delta-rs cannot commit to)."""
    from pyspark.sql.pandas.types import from_arrow_type

    spark = session()
    if spark is None:
        raise DeltaSparkMissingError(f"{where}: adding columns needs delta-spark's session")
    columns = ", ".join(
        "`" + f.name.replace("`", "``") + "` " + from_arrow_type(f.type).simpleString()
        for f in fields
    )
    path = uri.replace("`", "``")
    _guarded(spark, lambda: spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS ({columns})"))


def _scala_map(jvm: Any, items: dict[str, Any]) -> Any:
    """A Scala immutable ``Map`` of ``items``."""
    listed = jvm.java.util.HashMap()
    for k, v in items.items():
        listed.put(k, v)
    scala_map = getattr(getattr(jvm.scala.collection.immutable, "Map$"), "MODULE$")
    return getattr(scala_map, "from")(jvm.scala.jdk.javaapi.CollectionConverters.asScala(listed))


def _seq(jvm: Any, items: Sequence[Any]) -> Any:
    """A Scala ``Seq`` of the JVM objects ``items``."""
    listed = jvm.java.util.ArrayList()
    for item in items:
        listed.add(item)
    return jvm.scala.jdk.javaapi.CollectionConverters.asScala(listed).toSeq()


def _guarded(spark: Any, call: Callable[[], Any]) -> Any:
    """``call()`` with delta-spark's Java exceptions classified: a conflict as
    :class:`DeltaSparkConflict`, an I/O error as ``OSError`` (transient, as
    delta-rs's are), anything else as :class:`~sinks.errors.CommitRefusedError`
    (rule 3). PySpark converts some Java exceptions (``AnalysisException``,
    ``IllegalArgumentException``, ...) itself; those are classified alike."""
    try:
        return call()
    except Exception as e:
        java = getattr(e, "java_exception", None) or getattr(e, "_origin", None)
        if java is None:
            raise
        text = f"{java.getClass().getName()}: {java.getMessage()}"

        def is_a(name: str) -> bool:
            cls = spark._jvm.py4j.reflection.ReflectionUtil.classForName(name)
            return bool(cls.isInstance(java))

        if is_a(_CONFLICT_CLASS):
            raise DeltaSparkConflict(text) from None
        if is_a("java.io.IOException"):
            raise OSError(f"delta-spark: {text}") from None
        raise CommitRefusedError(f"delta-spark refused the commit: {text}") from None


def _add_json(a: AddAction) -> dict[str, Any]:
    """Delta's ``add`` action (its path a relative URI, as the protocol has it)."""
    return {
        "add": {
            "path": quote(a.path, safe="/="),
            "partitionValues": dict(a.partition_values),
            "size": int(a.size),
            "modificationTime": int(a.modification_time),
            "dataChange": bool(a.data_change),
            "stats": a.stats,
        }
    }


def _txn_json(t: Transaction) -> dict[str, Any]:
    last = t.last_updated if t.last_updated is not None else int(time.time() * 1000)
    return {"txn": {"appId": t.app_id, "version": int(t.version), "lastUpdated": int(last)}}
