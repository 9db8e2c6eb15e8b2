"""A keyed merge's rewrite through delta-spark, for tables whose files only
delta-spark reads and writes faithfully.

A keyed sink's merge (:mod:`sinks.delta.merge`) reads the files it plans to
replace and writes them again with the changes applied. On a table with
deletion vectors, the change data feed, column mapping, or a feature only
delta-spark's commit honours (:func:`sinks.delta.spark_features.needed` with
``rewrites``), that read and that write go through the commit's own delta-spark
transaction (:class:`~sinks.delta.spark_txn.SparkTxn`), as delta-spark's MERGE
makes them. The rules:

1. **Read as delta-spark reads.** The planned files are read from the
   transaction's snapshot by logical column names, without the rows their
   deletion vectors delete (they stay deleted), and the whole table counts as
   read: a commit since that removes any file, or adds one other than by a
   blind append, fails this one as a conflict and the merge is planned again.
2. **Remove what was read, as it was.** Each planned file is removed with its
   deletion vector and row ids (:meth:`SparkTxn.commit`), so no file stays live
   beside its rewrite.
3. **Rows keep their identity.** With row tracking, a row copied unchanged
   keeps its row id and commit version; a row updated by key keeps its row id
   and takes the new commit version; an inserted row gets a fresh id.
4. **The change feed sees each change once.** Only the planned files that
   hold a changed key are rewritten and removed (:func:`touched`), so every
   removed file has a change of its own. With the change data feed on, the
   rewrite writes change-data files: ``update_preimage`` and
   ``update_postimage`` for a key that was there and is written, ``delete`` for
   a key that was there and is deleted, ``insert`` for a new key. Copied rows
   are no change. A delete of a key the table lacks is no change either: a
   merge of nothing but such deletes commits the app transaction alone.
5. **The writer is delta-spark's.** Files are written by the transaction's own
   writer (physical names, field ids, statistics, the table's constraints), in
   the table's data directories under delta-spark's names. A crash between the
   write and the commit leaves them unreferenced for VACUUM, as delta-spark's
   own MERGE does; a commit that did not land deletes them.
6. **With deletion vectors, on read.** On a table with
   ``delta.enableDeletionVectors`` the planned files are not rewritten: the
   changed rows are marked deleted in new vectors and only the changed rows
   are written (:mod:`sinks.delta.spark_dv`, :func:`changed_on_read` and
   ``merged(..., on_read=)``); rules 1, 3 and 4 hold as they are, rule 2
   becomes: each file with a changed row is removed with its old vector and
   added again with the new one. Its files get staging markers
   (:mod:`sinks.delta.spark_staged`), so the sweep finds them after a crash.

Replaces commit through the same transaction
(:mod:`sinks.delta.committer`): the staged appends, and the removes of the
slice's files with their deletion vectors. A change-feed reader infers a
replace's changes from them: every row of the slice deleted, every staged row
inserted.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from sinks.delta.changes import DELETE_COLUMN
from sinks.delta.layout import Layout, quoted
from sinks.delta.spark_dv import Changed, changed_rows
from sinks.delta.spark_features import CHANGE_DATA_FEED, ROW_TRACKING, property_on
from sinks.delta.spark_txn import SparkTxn
from sinks.delta.storage import TableStorage

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

CHANGE_TYPE = "_change_type"
"""delta-spark's column of a change-data row's kind"""
ROW_ID_KEY = "delta.rowTracking.materializedRowIdColumnName"
ROW_VERSION_KEY = "delta.rowTracking.materializedRowCommitVersionColumnName"
_WAS = "_twophase_was"
_FILE = "_twophase_file"
_OLD_ID = "_twophase_old_id"


def touched(
    txn: SparkTxn, key: Sequence[str], files: Sequence[Any], winners: DataFrame
) -> list[Any]:
    """The files of ``files`` (``AddFile`` actions of ``txn``'s snapshot) that hold
    a key of ``winners``: only those are rewritten and removed (rule 4: a file
    rewritten whole without a change of its own would read, to a change-feed
    reader of a version without change data, as every row deleted and
    inserted again). One Spark job, as delta-spark's MERGE finds its files."""
    from pyspark.sql import functions as F

    if not files:
        return []
    jvm = txn.spark._jvm
    assert jvm is not None  # a live session's gateway
    ops = jvm.org.apache.spark.sql.delta.util.DeltaFileOperations
    base = str(txn.jvm_txn.deltaLog().dataPath().toString())
    by_path = {str(ops.absolutePath(base, str(f.path())).toString()): f for f in files}
    keys = winners.select(*[F.col(quoted(k)).alias(f"_k{i}") for i, k in enumerate(key)])
    targets = txn.read(files).withColumn(_FILE, F.input_file_name())
    names = (
        targets.join(keys, _matching(targets, keys, key), "left_semi")
        .select(_FILE)
        .distinct()
        .collect()
    )
    found = []
    for (name,) in names:
        path = str(ops.absolutePath(base, name).toString())
        if path not in by_path:
            raise RuntimeError(f"delta-spark read a file the merge did not plan: {name}")
        found.append(by_path[path])
    return found


def merged(
    txn: SparkTxn,
    layout: Layout,
    key: Sequence[str],
    files: Sequence[Any],
    winners: DataFrame,
    config: dict[str, str],
    on_read: Changed | None = None,
) -> DataFrame:
    """The rows to write for ``winners`` (the changes, one row per key, with
    :data:`~sinks.delta.changes.DELETE_COLUMN`) merged into ``files``
    (``AddFile`` actions of ``txn``'s snapshot), and with the change data feed
    on (``config``: the table's properties) the change-data rows (rules 3, 4).
    ``on_read``: a merge on read's changed rows (:func:`changed_on_read`); then
    ``files`` are not read again and only the changed rows are written."""
    from pyspark.sql import functions as F

    names = list(layout.schema.names)
    cdf = property_on(config, CHANGE_DATA_FEED)
    if on_read is not None:
        targets: DataFrame | None = on_read.rows
    else:
        targets = txn.read(files) if files else None
    row_id, row_version = _row_tracking(config, targets) if targets is not None else (None, None)
    columns = names + ([row_id, row_version] if row_id and row_version else [])

    def project(df: DataFrame, change: Column | None) -> DataFrame:
        picked = [F.col(quoted(c)) for c in columns]
        if cdf:
            picked.append((change if change is not None else _null("string")).alias(CHANGE_TYPE))
        return df.select(*picked)

    upserts = winners.where(~F.col(DELETE_COLUMN)).drop(DELETE_COLUMN)
    if targets is None:  # only new rows: fresh row ids, the commit's version
        parts = [project(upserts, None)]
        if cdf:
            parts.append(project(upserts, F.lit("insert")))
        return _union(parts)
    if on_read is not None:  # the rows are the changed ones, already joined to the keys
        before, kept = targets, None
    else:
        keys = _keys(winners, key)
        on_keys = _matching(targets, keys, key)
        before, kept = (
            targets.join(keys, on_keys, "inner"),
            targets.join(keys, on_keys, "left_anti"),
        )
    old = targets.select(
        *[F.col(quoted(k)).alias(f"_k{i}") for i, k in enumerate(key)],
        F.lit(True).alias(_WAS),
        *([F.col(quoted(row_id)).alias(_OLD_ID)] if row_id else []),
    )
    written = upserts.join(old, _matching(upserts, old, key), "left")
    if row_id and row_version:
        # an updated row keeps its id and takes the commit's version; a new one gets both
        written = written.withColumn(row_id, F.col(_OLD_ID)).withColumn(row_version, _null("long"))
    parts = [project(written, None)] + ([project(kept, None)] if kept is not None else [])
    if cdf:
        parts += [
            project(before.where(~F.col(_WAS)), F.lit("update_preimage")),
            project(before.where(F.col(_WAS)), F.lit("delete")),
            project(
                written,
                F.when(F.col(_WAS).isNull(), F.lit("insert")).otherwise(F.lit("update_postimage")),
            ),
        ]
    out = _union(parts)
    for c in (row_id, row_version):
        if c:  # what marks the columns as materialized row tracking to the writer
            out = out.withMetadata(c, targets.schema[c].metadata)
    if layout.partition_by:
        out = out.repartition(*[F.col(quoted(p)) for p in layout.partition_by])
    return out


def changed_on_read(
    txn: SparkTxn, key: Sequence[str], files: Sequence[Any], winners: DataFrame
) -> Changed:
    """The live rows of ``files`` whose key ``winners`` changes, with their
    files and row indexes (:func:`sinks.delta.spark_dv.changed_rows`): one scan
    of ``files`` (not empty)."""
    keys = _keys(winners, key)
    targets = txn.read(files)
    return changed_rows(txn, files, keys, _matching(targets, keys, key), targets)


def _keys(winners: DataFrame, key: Sequence[str]) -> DataFrame:
    """The changed keys as ``_k<i>``, with whether the change deletes (``_WAS``)."""
    from pyspark.sql import functions as F

    return winners.select(
        *[F.col(quoted(k)).alias(f"_k{i}") for i, k in enumerate(key)],
        F.col(DELETE_COLUMN).alias(_WAS),
    )


def _row_tracking(
    config: dict[str, str], targets: DataFrame
) -> tuple[str, str] | tuple[None, None]:
    """The materialized row id and row commit version columns ``targets`` were
    read with (row tracking on), else ``(None, None)``. Only columns delta-spark
    added when it read the files carry the metadata its writer needs to take
    them as row tracking, not as data."""
    row_id, row_version = config.get(ROW_ID_KEY), config.get(ROW_VERSION_KEY)
    if not property_on(config, ROW_TRACKING) or row_id is None or row_version is None:
        return None, None
    if not {row_id, row_version} <= set(targets.columns):
        return None, None  # delta-spark read none: row tracking is suspended
    return row_id, row_version


def _matching(left: DataFrame, right: DataFrame, key: Sequence[str]) -> Column:
    """``left``'s key columns equal ``right``'s ``_k<i>`` null-safely (a partition
    key column's "" is stored, and staged, as null)."""
    return functools.reduce(
        lambda a, b: a & b,
        [left[quoted(k)].eqNullSafe(right[f"_k{i}"]) for i, k in enumerate(key)],
    )


def _null(type_name: str) -> Column:
    from pyspark.sql import functions as F

    return F.lit(None).cast(type_name)


def _union(parts: Sequence[DataFrame]) -> DataFrame:
    return functools.reduce(lambda a, b: a.unionByName(b), parts)


def written_paths(written: Sequence[Any]) -> list[str]:
    """The table-relative paths (as stored) of file actions ``written``."""
    return [unquote(str(w.path())) for w in written]


def delete_written(storage: TableStorage, written: Sequence[Any]) -> None:
    """Delete the files of a rewrite whose commit did not land."""
    for path in written_paths(written):
        storage.delete(path)
