"""Executor side of the Delta sink: stage a task's rows as Parquet files.

Each record batch is conformed to the table (columns by name in table order,
cast to the table's types, NOT NULL checked), split by the partition columns,
and appended to one open Parquet file per partition. Rows are buffered only up
to a row group per open file, so a task's memory stays flat however large its
partition is. ``prepare`` closes and fsyncs the files and returns their add
actions; nothing is visible to readers until the driver commits them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sinks.base import Committable, SinkWriter, WriteContext
from sinks.delta.layout import (
    DeltaSchemaError,
    Layout,
    empty_as_null,
    partition_path,
    partition_value,
)
from sinks.delta.stats import FileStats
from sinks.delta.storage import DATA_SUFFIX, TableStorage, file_stem, marker_path
from sinks.errors import DataError

log = logging.getLogger("sinks.delta")

ROW_GROUP_BYTES = 64 * 1024 * 1024
"""Uncompressed bytes buffered per open file before they are written as a row group."""
MAX_BUFFERED_BYTES = 256 * 1024 * 1024
"""Uncompressed bytes buffered across a task's open files (many partitions) before
every buffer is written out, whatever its size: the bound on a task's memory."""
FILE_BYTES = 1024 * 1024 * 1024
"""Uncompressed bytes after which a file is closed and the next one started."""

PartitionKey = tuple[str | None, ...]


class _StagedFile:
    """One Parquet file being written: a ParquetWriter, its buffer and its stats."""

    def __init__(self, storage: TableStorage, rel: str, schema: pa.Schema) -> None:
        self.rel = rel
        self.schema = schema
        self.stats = FileStats(schema)
        self._buffer: list[pa.RecordBatch] = []
        self.buffered = 0
        self.written = 0
        self._stream = storage.open_output(rel)
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(
            self._stream, schema, compression="snappy", use_compliant_nested_type=True
        )

    def append(self, batch: pa.RecordBatch) -> None:
        self.stats.update(batch)
        self._buffer.append(batch)
        self.buffered += batch.nbytes
        if self.buffered >= ROW_GROUP_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as one row group."""
        if self._buffer and self._writer is not None:
            self._writer.write_table(pa.Table.from_batches(self._buffer, self.schema))
            self.written += self.buffered
            self._buffer, self.buffered = [], 0

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._stream.close()

    def discard(self) -> None:
        """Close without caring about errors (the file is deleted next)."""
        self._buffer = []
        try:
            self.close()
        except Exception:
            log.debug("closing discarded file %s", self.rel, exc_info=True)


def _partition_value(column: str, arr: pa.Array) -> str | None:
    """The partition value of a run of rows (``arr[0]``). A date is written
    ``YYYY-MM-DD``: one outside years 1 to 9999 is refused."""
    try:
        value = arr[0].as_py()
    except (OverflowError, ValueError) as e:
        raw = arr.slice(0, 1).cast(pa.int32()).to_pylist()[0]
        raise DataError(
            f"partition column {column!r}: the date {raw} days from 1970-01-01 is outside "
            "years 1 to 9999, the dates a Delta partition value (YYYY-MM-DD) holds; nothing of "
            f"this task is committed ({e})"
        ) from e
    return partition_value(value)


def table_column(batch: pa.RecordBatch, field: pa.Field) -> pa.Array:
    """``batch``'s column of the table's ``field``, cast losslessly to its type."""
    idx = batch.schema.get_field_index(field.name)
    if idx < 0:
        raise DeltaSchemaError(
            f"column {field.name!r} of the Delta table is missing from the data "
            f"(columns: {batch.schema.names})"
        )
    arr = batch.column(idx)
    if arr.type != field.type:
        try:
            arr = arr.cast(field.type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise DeltaSchemaError(
                f"column {field.name!r}: cannot convert {arr.type} to the table's "
                f"{field.type} without losing data: {e}"
            ) from e
    return arr


class DeltaWriter(SinkWriter):
    """Stages one task attempt's rows as Parquet files in the table directory.

    Files are named ``<txn>-<seq>.snappy.parquet`` after the task's transaction
    name, each announced by a staging marker before it is created (see
    :mod:`sinks.delta.storage`), so that every file can be found and attributed
    after any crash."""

    def __init__(self, storage: TableStorage, layout: Layout, ctx: WriteContext) -> None:
        self._storage = storage
        self._layout = layout
        self._file_schema = layout.file_schema
        self._stored = layout.stored  # names and ids in the files (column mapping)
        self._txn = str(ctx.txn_name())
        self._open: dict[PartitionKey, _StagedFile] = {}
        self._closed: list[tuple[PartitionKey, _StagedFile]] = []
        self._staged: list[str] = []  # every data file created (for cleanup)
        self._seq = 0
        self._rows = 0
        self._prepared = False

    # -- writing -------------------------------------------------------------------

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        batch = self._conform(batch)
        self._rows += batch.num_rows
        if not self._layout.partition_by:
            self._file(()).append(self._as_stored(batch))
            return
        for key, part in self._split(batch):
            self._file(key).append(self._as_stored(part.select(self._file_schema.names)))
        if sum(f.buffered for f in self._open.values()) > MAX_BUFFERED_BYTES:
            for f in self._open.values():
                f.flush()

    def _as_stored(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        mapping = self._layout.mapping
        return batch if mapping is None else mapping.to_stored(batch)

    def _conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Columns in table order, cast to the table's types; NOT NULL enforced."""
        arrays = []
        partitions = set(self._layout.partition_by)
        for field in self._layout.schema:
            arr = table_column(batch, field)
            if field.name in partitions:
                arr = empty_as_null(arr)  # how Delta stores "" there
            if not field.nullable and arr.null_count:
                raise DeltaSchemaError(
                    f"column {field.name!r} is NOT NULL in the Delta table but the data "
                    f"holds {arr.null_count} null value(s)"
                    + (
                        " (an empty string in a partition column is null)"
                        if field.name in partitions
                        else ""
                    )
                )
            arrays.append(arr)
        return pa.RecordBatch.from_arrays(arrays, schema=self._layout.schema)

    def _split(self, batch: pa.RecordBatch) -> Iterator[tuple[PartitionKey, pa.RecordBatch]]:
        """Runs of rows by partition value: sort by the partition columns' dictionary
        codes, then cut where any code changes (vectorised, no per-row Python)."""
        cols = self._layout.partition_by
        codes = [
            pc.dictionary_encode(batch.column(c), null_encoding="encode").indices for c in cols
        ]
        n = batch.num_rows
        if all(len(pc.unique(c)) == 1 for c in codes):
            starts = [0, n]
        else:
            keys = pa.table({str(i): c for i, c in enumerate(codes)})
            order = pc.sort_indices(
                keys, sort_keys=[(str(i), "ascending") for i in range(len(cols))]
            )
            batch = batch.take(order)
            change = None
            for c in codes:
                c = c.take(order)
                diff = pc.not_equal(c.slice(1), c.slice(0, n - 1))
                change = diff if change is None else pc.or_(change, diff)
            assert change is not None
            cuts = pc.add(pc.indices_nonzero(change), 1).to_pylist()
            starts = [0, *cuts, n]
        for s, e in itertools.pairwise(starts):
            part = batch.slice(s, e - s)
            key = tuple(_partition_value(c, part.column(c)) for c in cols)
            yield key, part

    def _file(self, key: PartitionKey) -> _StagedFile:
        f = self._open.get(key)
        if f is not None and f.written >= FILE_BYTES:
            f.close()
            self._closed.append((key, f))
            f = None
        if f is None:
            stem = file_stem(self._txn, self._seq)
            self._seq += 1
            rel = partition_path(self._layout.partition_by, key) + stem + DATA_SUFFIX
            # The marker first: a file that exists is always findable by a sweep.
            self._storage.put(marker_path(rel), rel.encode())
            self._staged.append(rel)
            f = self._open[key] = _StagedFile(self._storage, rel, self._stored.file_schema)
        return f

    # -- two-phase -------------------------------------------------------------------

    def prepare(self) -> Committable | None:
        for key, f in self._open.items():
            f.close()
            self._closed.append((key, f))
        self._open = {}
        self._prepared = True
        if not self._closed:
            return None
        adds = []
        for key, f in self._closed:
            self._storage.sync(f.rel)
            info = self._storage.info(f.rel)
            if info is None:
                raise OSError(f"staged file {f.rel} vanished right after it was written")
            size, mtime = info
            adds.append(
                {
                    "path": f.rel,
                    "size": size,
                    "partition_values": dict(zip(self._stored.partition_by, key, strict=True)),
                    "modification_time": mtime,
                    "stats": f.stats.to_json(),
                }
            )
        return {"txn": self._txn, "rows": self._rows, "adds": adds, **self._layout.stamp()}

    def close(self, failed: bool = False) -> None:
        for f in self._open.values():
            f.discard()
        self._open = {}
        if self._prepared and not failed:
            return
        for rel in self._staged:
            try:
                self._storage.delete(rel)
                self._storage.delete(marker_path(rel))
            except OSError:
                log.warning(
                    "could not delete staged file %s; a later sweep does", rel, exc_info=True
                )
        self._staged = []
