"""The winning row of each key, from a task's input sorted by key and order.

Sinks that apply a keyed write in the task (Kafka's tombstones and last
records; Delta's merge) get their partition sorted by ``key..., order_by``
(``Sink.sort_columns``, done by Spark, which spills: a task's memory stays
flat) and feed it here record batch by record batch. :class:`LastWriteWins`
yields each key's winner as soon as the key's rows are over, and enforces the
rules of :mod:`sinks.keys` on the way (different rows of one key without
``order_by``, or tied at its greatest value, raise
:class:`~sinks.keys.DuplicateKeyError`). It keeps one row between record
batches, and checks that the input really comes sorted: a key that went
backwards means the caller did not sort, and is an error, never a silent
second winner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sinks.keys import KeyedWrite

_ORDERED = (
    pa.types.is_integer,
    pa.types.is_floating,
    pa.types.is_decimal,
    pa.types.is_string,
    pa.types.is_large_string,
    pa.types.is_binary,
    pa.types.is_large_binary,
    pa.types.is_temporal,
    pa.types.is_boolean,
)


@dataclass(frozen=True)
class Winners:
    """The winning rows of some keys, and which of them are deletes."""

    rows: pa.RecordBatch
    deletes: np.ndarray
    """one bool per row"""


class LastWriteWins:
    """Reduces a sorted stream of record batches to one row per key."""

    def __init__(self, rules: KeyedWrite, batch_id: int) -> None:
        self._rules = rules
        self._batch_id = batch_id
        self._last: pa.RecordBatch | None = None
        """the last row seen: its key may go on in the next record batch"""
        self._last_delete = False
        self._tie = False
        """the rows tied at the last row's ``order_by`` value (of its key) differ"""

    def feed(self, batch: pa.RecordBatch) -> Winners | None:
        """The winners of the keys whose rows ended in ``batch``."""
        if batch.num_rows == 0:
            return None
        rules = self._rules
        rules.check_nulls(batch, self._batch_id)
        deletes = _bools(rules.deletes(batch), batch.num_rows)
        if self._last is not None:
            batch = pa.concat_batches([self._last, batch])
            deletes = np.concatenate([[self._last_delete], deletes])
        n = batch.num_rows
        same_key = np.ones(n - 1, dtype=bool)
        for name in rules.key:
            same_key &= _equal_next(batch.column(name))
        same_order = (
            _equal_next(batch.column(rules.order_by)) if rules.order_by else np.ones(n - 1, bool)
        )
        self._check_sorted(batch, same_key)
        tied = same_key & same_order
        differ = np.zeros(n - 1, dtype=bool)
        candidates = np.flatnonzero(tied)
        if len(candidates):
            differ[candidates] = _rows_differ(batch, candidates, deletes, rules)
        # groups of rows of one key and one order value; a group's rows must agree
        # when it is the last group of its key (the greatest order value)
        starts = np.concatenate([[True], ~tied])
        group = np.cumsum(starts) - 1
        conflict = np.zeros(group[-1] + 1, dtype=bool)
        conflict[0] = self._tie
        np.logical_or.at(conflict, group[1:], differ)
        ends = np.flatnonzero(~same_key)  # the last row of each key that ended here
        bad = ends[conflict[group[ends]]]
        if len(bad):
            raise self._duplicate(batch, int(bad[0]))
        self._last = batch.slice(n - 1, 1)
        self._last_delete = bool(deletes[-1])
        self._tie = bool(conflict[group[-1]])
        if not len(ends):
            return None
        return Winners(batch.take(pa.array(ends)), deletes[ends])

    def finish(self) -> Winners | None:
        """The winner of the last key."""
        last, self._last = self._last, None
        if last is None:
            return None
        if self._tie:
            raise self._duplicate(last, 0)
        return Winners(last, np.array([self._last_delete]))

    def _duplicate(self, batch: pa.RecordBatch, row: int) -> Exception:
        values = [batch.column(k)[row].as_py() for k in self._rules.key]
        return self._rules.duplicate_error(values, self._batch_id)

    def _check_sorted(self, batch: pa.RecordBatch, same_key: np.ndarray) -> None:
        """Every change of key goes up (in the columns whose order Arrow knows as
        Spark does), and within a key ``order_by`` never goes down."""
        rules = self._rules
        down = np.zeros(len(same_key), dtype=bool)
        settled = np.zeros(len(same_key), dtype=bool)  # an earlier key column went up
        for name in rules.key:
            col = batch.column(name)
            if not any(p(col.type) for p in _ORDERED):
                return  # Arrow cannot order it: trust the caller
            lt, gt = _less_next(col), _less_next(col, reverse=True)
            down |= ~settled & lt
            settled |= gt
        if rules.order_by:
            col = batch.column(rules.order_by)
            if any(p(col.type) for p in _ORDERED):
                down |= same_key & _less_next(col)
        if down.any():
            i = int(np.flatnonzero(down)[0]) + 1
            raise RuntimeError(
                f"{rules.sink}: the rows of a keyed write must come sorted by "
                f"{rules.sort_columns()} (Sink.sort_columns), and row {i} of this record "
                "batch goes back; the caller did not sort the partition"
            )


def _bools(mask: pa.Array | None, n: int) -> np.ndarray:
    if mask is None:
        return np.zeros(n, dtype=bool)
    return mask.to_numpy(zero_copy_only=False).astype(bool)


def _equal_next(col: pa.Array) -> np.ndarray:
    """For each row but the first: does it equal the row before it?"""
    return _equal(col.slice(1), col.slice(0, len(col) - 1))


def _equal(a: pa.Array, b: pa.Array) -> np.ndarray:
    """Element by element: equal, nulls equal to nulls, NaN equal to NaN."""
    try:
        eq = pc.fill_null(pc.equal(a, b), False)
    except pa.ArrowNotImplementedError:  # nested types: compare as Python values
        return np.array([x == y for x, y in zip(a.to_pylist(), b.to_pylist(), strict=True)], bool)
    both = pc.and_(pc.is_null(a), pc.is_null(b))
    if pa.types.is_floating(a.type):
        both = pc.or_(both, pc.fill_null(pc.and_(pc.is_nan(a), pc.is_nan(b)), False))
    return pc.or_(eq, both).to_numpy(zero_copy_only=False).astype(bool)


def _less_next(col: pa.Array, *, reverse: bool = False) -> np.ndarray:
    """For each row but the first: is it less (``reverse``: greater) than the
    row before it, in Spark's order (NaN above every number)?"""
    a, b = col.slice(1), col.slice(0, len(col) - 1)
    if reverse:
        a, b = b, a
    lt = pc.fill_null(pc.less(a, b), False)
    if pa.types.is_floating(col.type):  # a NaN is greater than every number
        nan_a, nan_b = pc.fill_null(pc.is_nan(a), False), pc.fill_null(pc.is_nan(b), False)
        lt = pc.or_(lt, pc.and_(nan_b, pc.invert(nan_a)))
    return lt.to_numpy(zero_copy_only=False).astype(bool)


def _rows_differ(
    batch: pa.RecordBatch, at: np.ndarray, deletes: np.ndarray, rules: KeyedWrite
) -> np.ndarray:
    """For the rows ``at + 1``: do they differ from the row before? Two deletes
    agree; a delete and a write differ; writes compare every written column."""
    this, before = at + 1, at
    both_delete = deletes[this] & deletes[before]
    one_delete = deletes[this] != deletes[before]
    differ = one_delete.copy()
    idx_a, idx_b = pa.array(this), pa.array(before)
    for name in batch.schema.names:
        if rules.delete_when is not None and name == rules.delete_when.column:
            continue
        col = batch.column(name)
        differ |= ~_equal(col.take(idx_a), col.take(idx_b))
    return differ & ~both_delete
