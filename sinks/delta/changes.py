"""Executor side of a keyed Delta sink: stage a task's changes, not table rows.

A keyed write (``DeltaSink(key=...)``) cannot place rows at the barrier: which
table files a key's row replaces is known only against the snapshot the
checkpoint commits on (:mod:`sinks.delta.merge`). So each task reduces its
partition, sorted by key and ``order_by`` (``Sink.sort_columns``), to the
batch's winner per key (:class:`~sinks.last_write.LastWriteWins`, the rules of
:mod:`sinks.keys`) and stages those rows as one Parquet **change file**: the
table's columns cast to the table's types, plus :data:`DELETE_COLUMN`. It is
staged like a data file (a marker first, named after the task's transaction,
so commit, abort and sweep find it) but under :data:`CHANGES_DIR`, never in the
table. The committable lists it with what the planner prunes by: the first key
column's range and, when every partition column is a key column, the
partitions the changes fall in.

An empty string in a partition column is null, in change files as in every
Delta path (Delta stores it so, as delta-spark does): the merge matches keys
null-safely, so an upsert or a delete of ``("", 1)`` finds the row an append of
``("", 1)`` stored.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sinks.base import Committable, SinkWriter, WriteContext
from sinks.delta.layout import DeltaSchemaError, Layout, empty_as_null, partition_value
from sinks.delta.storage import DATA_SUFFIX, TableStorage, file_stem, marker_path
from sinks.delta.writer import table_column
from sinks.keys import KeyedWrite
from sinks.last_write import LastWriteWins, Winners

log = logging.getLogger("sinks.delta")

CHANGES_DIR = "_twophase/changes"
DELETE_COLUMN = "_twophase_delete"
"""the change file's column that marks a delete"""


def change_schema(layout: Layout) -> pa.Schema:
    """The schema of change files: the table's columns, all nullable (a delete
    carries only its key), and the delete flag."""
    return pa.schema(
        [pa.field(f.name, f.type, True) for f in layout.schema]
        + [pa.field(DELETE_COLUMN, pa.bool_(), False)]
    )


def range_value(value: Any) -> Any:
    """A key value as JSON keeps it and the planner compares it (numbers and
    strings as they are, dates and timestamps as ISO text); None for others."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float, str)):
        return value
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    return None


def _partition_order(values: list[str | None]) -> list[tuple[bool, str]]:
    """A sort key of partition value tuples that may hold nulls (null first)."""
    return [(v is not None, v or "") for v in values]


class ChangeWriter(SinkWriter):
    """Stages one task attempt's changes (winner per key) as a change file."""

    def __init__(
        self, storage: TableStorage, layout: Layout, rules: KeyedWrite, ctx: WriteContext
    ) -> None:
        self._storage = storage
        self._layout = layout
        self._rules = rules
        self._schema = change_schema(layout)
        self._txn = str(ctx.txn_name())
        self._last_write = LastWriteWins(rules, ctx.batch_id)
        self._rel: str | None = None
        self._writer: pq.ParquetWriter | None = None
        self._stream: Any = None
        self._rows = 0
        self._deletes = 0
        self._low: Any = None
        self._high: Any = None
        self._partitions: set[tuple[str | None, ...]] = set()
        self._prepared = False

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            self._stage(self._last_write.feed(batch))

    def _stage(self, winners: Winners | None) -> None:
        if winners is None:
            return
        rows = self._conform(winners)
        if self._writer is None:
            self._rel = f"{CHANGES_DIR}/{file_stem(self._txn, 0)}{DATA_SUFFIX}"
            self._storage.put(marker_path(self._rel), self._rel.encode())  # the marker first
            self._stream = self._storage.open_output(self._rel)
            self._writer = pq.ParquetWriter(self._stream, self._schema, compression="snappy")
        self._writer.write_batch(rows)
        self._rows += rows.num_rows
        self._deletes += int(winners.deletes.sum())
        first = rows.column(self._rules.key[0])
        bounds = pc.min_max(first)
        low, high = range_value(bounds["min"].as_py()), range_value(bounds["max"].as_py())
        if low is not None and high is not None:
            self._low = low if self._low is None else min(self._low, low)
            self._high = high if self._high is None else max(self._high, high)
        parts = self._layout.partition_by
        if parts and set(parts) <= set(self._rules.key):
            table = pa.Table.from_batches([rows]).select(list(parts))
            for row in table.group_by(list(parts)).aggregate([]).to_pylist():
                self._partitions.add(tuple(partition_value(row[c]) for c in parts))

    def _conform(self, winners: Winners) -> pa.RecordBatch:
        """The table's columns cast to the table's types, NOT NULL checked on
        the rows that write (a delete needs only its key), and the flag."""
        batch, deletes = winners.rows, pa.array(winners.deletes)
        arrays = []
        partitions = set(self._layout.partition_by)
        for field in self._layout.schema:
            arr = table_column(batch, field)
            if field.name in partitions:
                arr = empty_as_null(arr)
            if not field.nullable and arr.null_count:
                writes = pc.invert(deletes)
                nulls = pc.sum(pc.and_(pc.is_null(arr), writes)).as_py() or 0
                if nulls:
                    raise DeltaSchemaError(
                        f"column {field.name!r} is NOT NULL in the Delta table but the data "
                        f"holds {nulls} null value(s)"
                    )
            arrays.append(arr)
        arrays.append(deletes)
        return pa.RecordBatch.from_arrays(arrays, schema=self._schema)

    def prepare(self) -> Committable | None:
        self._stage(self._last_write.finish())
        self._prepared = True
        if self._writer is None:
            return None
        self._writer.close()
        self._writer = None
        self._stream.close()
        assert self._rel is not None
        self._storage.sync(self._rel)
        info = self._storage.info(self._rel)
        if info is None:
            raise OSError(f"change file {self._rel} vanished right after it was written")
        change = {
            "path": self._rel,
            "size": info[0],
            "rows": self._rows,
            "deletes": self._deletes,
            "key_range": [self._low, self._high] if self._low is not None else None,
            "partitions": (
                sorted((list(p) for p in self._partitions), key=_partition_order)
                if self._partitions
                else None
            ),
        }
        return {
            "txn": self._txn,
            "rows": self._rows,
            "bytes": info[0],
            "changes": [change],
            **self._layout.stamp(),
        }

    def close(self, failed: bool = False) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
                self._stream.close()
            except Exception:
                log.debug("closing discarded change file %s", self._rel, exc_info=True)
            self._writer = None
        if (self._prepared and not failed) or self._rel is None:
            return
        try:
            self._storage.delete(self._rel)
            self._storage.delete(marker_path(self._rel))
        except OSError:
            log.warning("could not delete change file %s; a later sweep does", self._rel)
