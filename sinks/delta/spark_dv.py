"""Merge-on-read: a keyed merge into a table with deletion vectors marks the
changed rows deleted in the files that hold them, instead of rewriting the
files.

On a table with ``delta.enableDeletionVectors`` a keyed sink's merge through
delta-spark's transaction (:mod:`sinks.delta.spark_rewrite`) leaves every
planned file in place and, as delta-spark's own MERGE does:

1. **finds the changed rows** (:func:`changed_rows`): one scan of the planned
   files as delta-spark reads them (the rows their current vectors delete are
   not read: they are no live row, and have no change-feed preimage), joined
   to the changed keys (updated or deleted), with each row's file and its
   physical index in it (``_metadata.row_index``). The joined rows are kept
   for the rest of the merge (old row ids, change-feed preimages), so the
   table is scanned once;
2. **marks them deleted** (:func:`mark_deleted`): per file that holds one,
   the new vector is its old vector (read by delta-spark's store) with those
   row indexes added (:mod:`sinks.delta.roaring`), written by delta-spark's
   own deletion-vector store into one vector file of the merge, in Delta's
   format (version byte, each vector's size and checksum). The commit removes
   each such file with its old vector and adds it again with the new one
   (``AddFile.removeRows``: same path, ``dataChange``, statistics without
   tight bounds, ``baseRowId`` and ``defaultRowCommitVersion`` kept, so the
   rows left keep their ids and versions). A file whose every row is then
   deleted is removed without being added again;
3. **writes only the changed rows**: updates and inserts, through the
   transaction's writer, updated rows keeping their row id; with the change
   data feed, the same change-data rows as a rewrite (``update_preimage`` and
   ``delete`` from the rows found in 1, ``update_postimage`` and ``insert``).

**Exactly once.** Before the vector file is created, a staging marker naming
it is written (:mod:`sinks.delta.spark_staged`), and every file delta-spark's
writer wrote gets one as soon as its write returns; all are named after a
transaction of the sink's scope and the merge's highest batch. A crash before
the commit leaves them to the sweep; a commit that did not land deletes them;
a commit that landed deletes the markers. The commit itself carries the app
transaction, so a retried commit of a version the table holds is a no-op.
A crash while delta-spark's writer runs (before its files have markers)
leaves those files unreferenced, for VACUUM, as delta-spark's own MERGE does.

The vectors are built on the driver: the changed rows' indexes are collected
there (8 bytes a changed row), one vector file is written per merge.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sinks.delta import roaring
from sinks.delta.spark_features import property_on
from sinks.delta.spark_staged import Staged
from sinks.delta.spark_txn import SparkTxn

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

DELETION_VECTORS = "delta.enableDeletionVectors"
"""the table property under which delta-spark writes deletion vectors"""
ROW_INDEX = "_twophase_row_index"
FILE = "_twophase_file"


def enabled(config: dict[str, str]) -> bool:
    """Whether a merge into a table of properties ``config`` marks rows deleted
    (merge-on-read) rather than rewriting their files."""
    return property_on(config, DELETION_VECTORS)


@dataclass
class Changed:
    """The live rows of the planned files whose key a merge changes."""

    rows: DataFrame
    """the rows (persisted), every column delta-spark reads, joined to the
    changed keys' ``_k<i>`` columns and their delete flag, with :data:`FILE`
    and :data:`ROW_INDEX`"""
    files: list[Any]
    """the ``AddFile`` actions of the files that hold one"""
    indexes: dict[str, list[int]]
    """the row indexes to mark deleted, by ``AddFile`` path (as stored)"""

    def release(self) -> None:
        self.rows.unpersist()


def changed_rows(
    txn: SparkTxn, files: Sequence[Any], keys: DataFrame, on_keys: Any, targets: DataFrame
) -> Changed:
    """Rule 1: the live rows of ``targets`` (``txn.read(files)``) matching
    ``keys`` (``on_keys``: the join condition), their files and indexes."""
    from pyspark.sql import functions as F

    jvm = txn.spark._jvm
    assert jvm is not None  # a live session's gateway
    ops = jvm.org.apache.spark.sql.delta.util.DeltaFileOperations
    base = str(txn.jvm_txn.deltaLog().dataPath().toString())
    by_path = {str(ops.absolutePath(base, str(f.path())).toString()): f for f in files}
    located = targets.select(
        "*",
        F.col("_metadata.file_path").alias(FILE),
        F.col("_metadata.row_index").alias(ROW_INDEX),
    )
    rows = located.join(keys, on_keys, "inner").persist()
    try:
        grouped = rows.groupBy(FILE).agg(F.collect_list(ROW_INDEX).alias("rows")).collect()
        found, indexes = [], {}
        for name, idx in grouped:
            path = str(ops.absolutePath(base, name).toString())
            if path not in by_path:
                raise RuntimeError(f"delta-spark read a file the merge did not plan: {name}")
            f = by_path[path]
            found.append(f)
            indexes[str(f.path())] = [int(i) for i in idx]
    except BaseException:
        rows.unpersist()
        raise
    return Changed(rows, found, indexes)


def mark_deleted(txn: SparkTxn, changed: Changed, staged: Staged) -> tuple[list[Any], list[Any]]:
    """Rule 2: write the new vectors of ``changed.files`` into one vector file
    (its marker first, by ``staged``); return ``(file actions to commit, files
    to remove whole)``: per file whose rows stay partly live, its ``AddFile``
    with the new vector and the ``RemoveFile`` of the old."""
    if not changed.files:
        return [], []
    jvm = txn.spark._jvm
    assert jvm is not None
    dv = jvm.org.apache.spark.sql.delta.deletionvectors
    log = txn.jvm_txn.deltaLog()
    stores = getattr(jvm.org.apache.spark.sql.delta.storage.dv, "DeletionVectorStore$")
    store = getattr(stores, "MODULE$").createInstance(log.newDeltaHadoopConf())
    table = log.dataPath()
    portable = getattr(getattr(dv, "RoaringBitmapArrayFormat$"), "MODULE$").Portable()
    descriptor = getattr(jvm.org.apache.spark.sql.delta.actions, "DeletionVectorDescriptor$")
    descriptors = getattr(descriptor, "MODULE$")
    option = jvm.scala.Option
    vectors: list[tuple[Any, Any]] = []
    whole: list[Any] = []
    for f in changed.files:
        rows = changed.indexes[str(f.path())]
        bitmap = dv.RoaringBitmapArray.readFrom(roaring.serialize(rows))
        if int(bitmap.cardinality()) != len(set(rows)):
            raise RuntimeError(f"the deletion vector of {f.path()} does not read back")
        old = f.deletionVector()
        if old is not None and not old.isEmpty():
            bitmap.merge(store.read(old, table))
        physical = f.numPhysicalRecords()
        if not physical.isEmpty() and int(bitmap.cardinality()) >= int(physical.get()):
            whole.append(f)  # every row deleted: the file goes, as delta-spark's MERGE does
        else:
            vectors.append((f, bitmap))
    if not vectors:
        return [], whole
    vector_id = uuid.uuid4()
    jvm_id = jvm.java.util.UUID.fromString(str(vector_id))
    name = str(descriptors.assembleDeletionVectorFileName(jvm_id))
    staged.mark(name)  # the marker first: a crash from here on leaves it to the sweep
    path = store.generateFileNameInTable(store.pathWithFileSystem(table), jvm_id, "")
    actions = []
    writer = store.createWriter(path)
    try:
        for f, bitmap in vectors:
            written = writer.write(bitmap.serializeAsByteArray(portable))
            last = bitmap.last()
            new = descriptors.onDiskWithRelativePath(
                jvm_id,
                "",
                int(written.length()),
                int(bitmap.cardinality()),
                option.apply(int(written.offset())),
                last,
            )
            pair = f.removeRows(new, True, True)
            actions += [pair._1(), pair._2()]
    finally:
        writer.close()
    return actions, whole
