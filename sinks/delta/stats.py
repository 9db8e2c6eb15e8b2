"""Per-file column statistics for Delta add actions (``numRecords``,
``minValues``, ``maxValues``, ``nullCount``).

Readers skip files using these bounds, so a wrong bound silently drops rows
from query results. The rule here is: exact or omitted, never wrong.

* ``nullCount`` for every top-level column that is not nested.
* min/max for integers, dates, strings, finite floats and ``timestamp`` (UTC):
  - strings: min is cut to its first 32 characters (a prefix is never greater
    than the string); max is kept only when it is at most 32 characters long
    (a cut max would be smaller than the value);
  - timestamps: rounded outwards to milliseconds (min down, max up), since some
    readers keep only milliseconds of these bounds;
  - floats: omitted when the file holds a NaN or an infinity (JSON cannot hold
    them, and Spark orders NaN above every number).
* Omitted: booleans, binary, decimals, ``timestamp_ntz``, nested columns, and any
  value out of the range of Python's date and time types.

Bounds are computed from the Arrow data as it is written (one ``min_max`` per
column and record batch), not from Parquet footers, so they are exact.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

STRING_PREFIX = 32
_EPOCH = dt.datetime(1970, 1, 1)
_EPOCH_DATE = dt.date(1970, 1, 1)


def _kind(t: pa.DataType) -> str | None:
    """Which bounds a column of type ``t`` gets; ``None`` for null counts only."""
    if pa.types.is_signed_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_date32(t):
        return "date"
    if pa.types.is_timestamp(t) and t.tz is not None and t.unit == "us":
        return "timestamp"
    return None


def _is_nested(t: pa.DataType) -> bool:
    return pa.types.is_nested(t)


class _Column:
    """Running null count and bounds of one column."""

    def __init__(self, kind: str | None) -> None:
        self.kind = kind
        self.nulls = 0
        self.lo: Any = None
        self.hi: Any = None
        self.poisoned = False  # bounds must be omitted

    def update(self, arr: pa.Array | pa.ChunkedArray) -> None:
        self.nulls += arr.null_count
        if self.kind is None or self.poisoned or arr.null_count == len(arr):
            return
        if self.kind == "float" and pc.any(pc.is_nan(arr)).as_py():
            self.poisoned = True
            return
        if self.kind == "date":
            arr = arr.cast(pa.int32())
        elif self.kind == "timestamp":
            arr = arr.cast(pa.int64())
        mm = pc.min_max(arr)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        self.lo = lo if self.lo is None or lo < self.lo else self.lo
        self.hi = hi if self.hi is None or hi > self.hi else self.hi

    def bounds(self) -> tuple[Any, Any]:
        """JSON values of (min, max); ``None`` for a bound that must be omitted."""
        if self.poisoned or self.lo is None:
            return None, None
        if self.kind == "float":
            if not (math.isfinite(self.lo) and math.isfinite(self.hi)):
                return None, None
            return self.lo, self.hi
        if self.kind == "string":
            hi = self.hi if len(self.hi) <= STRING_PREFIX else None
            return self.lo[:STRING_PREFIX], hi
        if self.kind == "date":
            return _date(self.lo), _date(self.hi)
        if self.kind == "timestamp":
            return _timestamp_ms(self.lo // 1000), _timestamp_ms(-(-self.hi // 1000))
        return self.lo, self.hi


def _date(days: int) -> str | None:
    try:
        return (_EPOCH_DATE + dt.timedelta(days=days)).isoformat()
    except OverflowError:
        return None


def _timestamp_ms(ms: int) -> str | None:
    try:
        t = _EPOCH + dt.timedelta(milliseconds=ms)
    except OverflowError:
        return None
    return (
        f"{t.year:04d}-{t.month:02d}-{t.day:02d}T{t.hour:02d}:{t.minute:02d}:{t.second:02d}"
        f".{t.microsecond // 1000:03d}Z"
    )


class FileStats:
    """Statistics of one data file, fed the record batches written to it."""

    def __init__(self, schema: pa.Schema) -> None:
        self.rows = 0
        self._columns = {f.name: _Column(_kind(f.type)) for f in schema if not _is_nested(f.type)}

    def update(self, data: pa.RecordBatch | pa.Table) -> None:
        """Account for ``data`` (a batch or table of the file's schema)."""
        self.rows += data.num_rows
        for name, col in self._columns.items():
            col.update(data.column(name))

    def to_json(self) -> str:
        """The ``stats`` string of the file's add action."""
        lo: dict[str, Any] = {}
        hi: dict[str, Any] = {}
        for name, col in self._columns.items():
            a, b = col.bounds()
            if a is not None:
                lo[name] = a
            if b is not None:
                hi[name] = b
        doc: dict[str, Any] = {"numRecords": self.rows}
        if lo:
            doc["minValues"] = lo
        if hi:
            doc["maxValues"] = hi
        doc["nullCount"] = {name: col.nulls for name, col in self._columns.items()}
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)
