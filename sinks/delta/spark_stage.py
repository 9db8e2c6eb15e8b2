"""Stage a micro-batch with Spark's own Parquet writer (local tables).

The route without a round trip through Python: the batch's DataFrame, conformed
to the table (columns in table order, cast to the table's types), is written by
Spark's file writer on the executors into a staging directory of the table
named after the batch's transaction, ``_twophase/spark/<txn>/`` (hidden from
readers like every directory starting with ``_``). Then the driver, for each
file Spark wrote:

1. reads its footer: the row count, the add action's statistics
   (:meth:`~sinks.delta.stats.FileStats.from_footer`) and the table's schema
   and NOT NULL checks (:func:`~sinks.delta.layout.check_file_schema`);
2. writes its staging marker, then moves it to
   ``<partition dirs>/<txn>-<seq>.snappy.parquet``, exclusively: the name and
   the marker of a file the sink's own writer stages (:mod:`sinks.delta.storage`),
   so commit, abort and sweep treat both alike;

and finally makes the moves durable and deletes the staging directory (with
Spark's ``_temporary``, ``_SUCCESS`` and ``.crc`` files). Nothing is visible to
readers until the checkpoint's Delta version adds the files.

Crash windows: before or during Spark's job, and after its job commit but
before the moves, the files are in the staging directory, whose name is the
transaction's: the sweep deletes the staging directories of orphan
transactions. During the moves, a moved file has its marker (written first),
the rest are still staged. After the staging directory is gone, markers name
every file, as for the sink's own writer.

Timestamps are written as ``TIMESTAMP_MICROS`` (Spark's default, INT96, carries
no statistics and is deprecated): when the table has a timestamp column and the
session writes INT96, the session's ``spark.sql.parquet.outputTimestampType``
is set to ``TIMESTAMP_MICROS`` (logged once).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import re
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from sinks import _faults
from sinks._parallel import raise_first, run_all
from sinks.base import Committable, JobScope
from sinks.delta.layout import (
    NULL_PARTITION,
    DeltaSchemaError,
    Layout,
    check_file_schema,
    partition_path,
    quoted,
)
from sinks.delta.stats import FileStats
from sinks.delta.storage import (
    DATA_SUFFIX,
    SPARK_STAGING_DIR,
    TableStorage,
    file_stem,
    marker_path,
    parent_dir,
)
from sinks.naming import TxnName

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger("sinks.delta")

_TIMESTAMP_CONF = "spark.sql.parquet.outputTimestampType"
_ATTEMPTS = itertools.count()
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
PLACE_THREADS = 8
"""Files of a batch the driver checks and moves at once."""


def nested_not_null(layout: Layout) -> bool:
    """Whether a column of the table has a NOT NULL field inside it (a struct
    field, list element or map value): Spark writes the nullability of its
    DataFrame's schema there, which must then match; such tables are staged by
    the sink's own writer, which writes the table's."""

    def strict(t: pa.DataType) -> bool:
        if pa.types.is_struct(t):
            return any(not f.nullable or strict(f.type) for f in t)
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return not t.value_field.nullable or strict(t.value_type)
        if pa.types.is_map(t):
            return not t.item_field.nullable or strict(t.key_type) or strict(t.item_type)
        return False

    return any(strict(f.type) for f in layout.schema)


def _has_timestamp(t: pa.DataType) -> bool:
    if pa.types.is_timestamp(t):
        return True
    if pa.types.is_struct(t):
        return any(_has_timestamp(f.type) for f in t)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _has_timestamp(t.value_type)
    if pa.types.is_map(t):
        return _has_timestamp(t.key_type) or _has_timestamp(t.item_type)
    return False


def conform(df: DataFrame, layout: Layout) -> DataFrame:
    """``df``'s columns in the table's order, each cast to the table's type where
    Spark's differs (the lossless widenings the preflight admitted)."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_type

    have = {f.name: f.dataType for f in df.schema.fields}
    cols = []
    for field in layout.schema:
        want = from_arrow_type(field.type, prefer_timestamp_ntz=True)
        col = F.col(quoted(field.name))
        if have.get(field.name) != want:
            col = col.cast(want).alias(field.name)
        cols.append(col)
    return df.select(*cols)


def _micros_timestamps(df: DataFrame, layout: Layout) -> None:
    if not any(_has_timestamp(f.type) for f in layout.schema):
        return
    conf = df.sparkSession.conf
    if (conf.get(_TIMESTAMP_CONF, None) or "INT96").upper() != "TIMESTAMP_MICROS":
        log.info(
            "DeltaSink: setting %s=TIMESTAMP_MICROS for this Spark session (INT96, the "
            "default, carries no statistics)",
            _TIMESTAMP_CONF,
        )
        conf.set(_TIMESTAMP_CONF, "TIMESTAMP_MICROS")


def _unescape(text: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m[1], 16)), text)


def _partition_values(layout: Layout, rel: str) -> dict[str, str | None]:
    """The partition values of a file Spark wrote at ``rel`` (relative to the
    staging directory: ``col=value/.../part-....parquet``)."""
    dirs = rel.split("/")[:-1]
    values: dict[str, str | None] = {}
    for d in dirs:
        name, sep, value = d.partition("=")
        if not sep:
            raise OSError(f"unexpected directory {d!r} in Spark's output {rel}")
        values[_unescape(name)] = None if value == NULL_PARTITION else _unescape(value)
    if list(values) != list(layout.partition_by):
        raise OSError(
            f"Spark wrote {rel} partitioned by {list(values)}, not by the table's "
            f"{list(layout.partition_by)}"
        )
    return values


def _spark_files(root: str) -> list[str]:
    """Data files Spark left under ``root`` (relative, sorted), not its
    ``_temporary``, ``_SUCCESS`` or ``.crc`` files."""
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        rel_dir = os.path.relpath(here, root)
        for f in files:
            if f.endswith(".parquet") and not f.startswith(("_", ".")):
                found.append(f if rel_dir == "." else f"{rel_dir}/{f}")
    return sorted(found)


class SparkStage:
    """Stages micro-batches of one Delta sink with Spark's Parquet writer."""

    def __init__(self, storage: TableStorage, layout: Layout, where: str) -> None:
        if storage.root is None:
            raise ValueError("Spark's writer stages into local tables only")
        self._storage = storage
        self._layout = layout
        self._where = where

    def stage(
        self,
        df: DataFrame,
        scope: JobScope,
        run: int,
        batch_id: int,
        attempt: int | None = None,
    ) -> Committable | None:
        """Write ``df`` as the staged files of one transaction; its committable,
        or ``None`` when the batch has no rows. On an error nothing is left
        staged (or, if the driver dies, a sweep finds it). ``attempt``: the
        transaction name's attempt number (default: the next of this process)."""
        txn = TxnName(
            job=scope.job,
            pipeline=scope.pipeline,
            sink_id=scope.sink_id,
            run=run,
            batch_id=batch_id,
            partition=0,
            attempt=next(_ATTEMPTS) if attempt is None else attempt,
            incarnation=scope.incarnation,
        )
        staging = f"{SPARK_STAGING_DIR}/{txn}"
        moved: list[str] = []
        try:
            self._write(df, staging)
            _faults.hit("driver.spark_staged", batch=batch_id, sink="delta")
            adds, rows = self._place(staging, str(txn), moved, batch_id)
        except BaseException:
            self._discard(staging, moved)
            raise
        if not adds:
            return None
        return {"txn": str(txn), "rows": rows, "adds": adds, **self._layout.stamp()}

    def _write(self, df: DataFrame, staging: str) -> None:
        _micros_timestamps(df, self._layout)
        writer = (
            conform(df, self._layout)
            .write.mode("errorifexists")
            .option("compression", "snappy")
            .option("mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
        )
        if self._layout.partition_by:
            writer = writer.partitionBy(*self._layout.partition_by)
        writer.parquet(self._storage.path(staging))

    def _place(
        self, staging: str, txn: str, moved: list[str], batch_id: int
    ) -> tuple[list[dict[str, Any]], int]:
        """Check, describe and move each file Spark wrote (several at once: each
        is a few file-system round trips and fsyncs); their add actions and rows."""
        files = _spark_files(self._storage.path(staging))
        calls = [
            functools.partial(self._place_one, staging, rel, txn, seq, moved, batch_id)
            for seq, rel in enumerate(files)
        ]
        done = raise_first(run_all(calls, limit=PLACE_THREADS, name="place"))
        placed = [p for p in done if p is not None]
        dirs = {parent_dir(add["path"]) for add, _ in placed}
        self._storage.sync_dirs(dirs)
        self._storage.delete_tree(staging)
        return [add for add, _ in placed], sum(rows for _, rows in placed)

    def _place_one(
        self, staging: str, rel: str, txn: str, seq: int, moved: list[str], batch_id: int
    ) -> tuple[dict[str, Any], int] | None:
        """One file's add action and rows (``None``: a file without rows)."""
        layout, storage = self._layout, self._storage
        src = f"{staging}/{rel}"
        meta = storage.parquet_metadata(src)
        if meta.num_rows == 0:
            return None  # Spark writes a schema-only file for an empty batch
        values = _partition_values(layout, rel)
        self._check_partitions(values, rel)
        check_file_schema(meta, layout, f"{self._where}: a file of this batch")
        dst = partition_path(layout.partition_by, list(values.values()))
        dst += file_stem(txn, seq) + DATA_SUFFIX
        storage.put(marker_path(dst), dst.encode())  # the marker first, as always
        storage.move_new(src, dst)
        moved.append(dst)
        _faults.hit("driver.mid_move", batch=batch_id, sink="delta")
        info = storage.info(dst)
        if info is None:
            raise OSError(f"staged file {dst} vanished right after it was moved")
        add = {
            "path": dst,
            "size": info[0],
            "partition_values": values,
            "modification_time": info[1],
            "stats": FileStats.from_footer(meta, layout.file_schema).to_json(),
        }
        return add, meta.num_rows

    def _check_partitions(self, values: dict[str, str | None], rel: str) -> None:
        for name, value in values.items():
            if value is None and not self._layout.schema.field(name).nullable:
                raise DeltaSchemaError(
                    f"{self._where}: partition column {name!r} is NOT NULL in the Delta "
                    f"table but the data holds null value(s) ({rel})"
                )

    def _discard(self, staging: str, moved: list[str]) -> None:
        try:
            for rel in moved:
                self._storage.delete(rel)
                self._storage.delete(marker_path(rel))
            self._storage.delete_tree(staging)
        except OSError:
            log.warning(
                "%s: could not delete the files of a failed batch (%s); a later sweep does",
                self._where,
                staging,
                exc_info=True,
            )
