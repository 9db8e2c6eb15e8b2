"""Per-file column statistics for Delta add actions (``numRecords``,
``minValues``, ``maxValues``, ``nullCount``).

Readers skip files using these bounds, so a wrong bound silently drops rows
from query results. And so does a *missing* one: deltalake (delta-rs, 1.6 and
its main branch) turns a column absent from a file's ``minValues`` or
``maxValues`` into ``col >= null``, which prunes the file from every scan that
filters on that column (a boolean or decimal column, a float column holding
a NaN, ...: ``to_pyarrow_table(filters=...)`` returned none of their rows).
The rule here is therefore: a bound for every column, or no bounds at all;
each bound exact or, for cut strings, on the safe side; never wrong.

* ``nullCount`` for every top-level column that is not nested.
* min and max of every top-level column that is not nested, binary or null
  only (readers index none of those):

  - integers, booleans, decimals (as exact JSON numbers), finite floats, dates:
    exact;
  - timestamps, with and without time zone: rounded outwards to milliseconds
    (min down, max up), since some readers keep only milliseconds of these
    bounds;
  - strings: the min is cut to its first 32 characters (a prefix is never
    greater than the string); a max longer than that becomes its first 32
    characters with the last one that can be raised raised by one code point,
    which is greater than every string of the file (UTF-8 orders as code points).

* No ``minValues`` / ``maxValues`` at all when one column has no faithful
  bound: a float column holding a NaN or an infinity (JSON cannot hold them,
  and Spark orders NaN above every number), a date or timestamp outside years
  1 to 9999, a max of 32 times U+10FFFF.

Bounds are computed from the Arrow data as it is written (one ``min_max`` per
column and record batch) by the sink's own writer. Files written by Spark's
Parquet writer (:mod:`sinks.delta.spark_stage`) get them from their footers
(:meth:`FileStats.from_footer`): Parquet statistics are exact for these types,
a float column's NaN shows as a NaN bound, and a column whose footer states no
bound (Spark leaves out bounds of values over 4 KB) leaves the file without
bounds, by the rule above. The
JSON holds characters beyond U+FFFF as UTF-8, not as escapes (see :func:`_dumps`).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import uuid
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

STRING_PREFIX = 32
_EPOCH = dt.datetime(1970, 1, 1)
_EPOCH_DATE = dt.date(1970, 1, 1)
_MAX_CHAR = 0x10FFFF


class _Unbounded(Exception):
    """A column holds values that no bound in the statistics can state."""


def _kind(t: pa.DataType) -> str | None:
    """Which bounds a column of type ``t`` gets; ``None`` for null counts only."""
    if pa.types.is_signed_integer(t):
        return "int"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_decimal(t):
        return "decimal"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_date32(t):
        return "date"
    if pa.types.is_timestamp(t) and t.unit == "us":
        return "timestamp" if t.tz is not None else "timestamp_ntz"
    return None


class _Column:
    """Running null count and bounds of one column."""

    def __init__(self, kind: str | None) -> None:
        self.kind = kind
        self.nulls = 0
        self.lo: Any = None
        self.hi: Any = None
        self.unbounded = False  # holds a value no bound can state
        self.nulls_unknown = False  # a footer without a null count

    def update(self, arr: pa.Array | pa.ChunkedArray) -> None:
        self.nulls += arr.null_count
        if self.kind is None or self.unbounded or arr.null_count == len(arr):
            return
        if self.kind == "float" and not pc.all(pc.is_finite(arr)).as_py():
            self.unbounded = True  # a NaN or an infinity
            return
        if self.kind == "date":
            arr = arr.cast(pa.int32())
        elif self.kind in ("timestamp", "timestamp_ntz"):
            arr = arr.cast(pa.int64())
        mm = pc.min_max(arr)
        self._widen(mm["min"].as_py(), mm["max"].as_py())

    def update_bounds(self, nulls: int, bounds: tuple[Any, Any] | None, rows: int) -> None:
        """Account for one Parquet row group: its null count and its (min, max)
        as footer statistics give them (``None``: the footer states none)."""
        self.nulls += nulls
        if self.kind is None or self.unbounded or nulls == rows:
            return
        if bounds is None:
            self.unbounded = True  # values the footer holds no bound of
            return
        lo, hi = (_footer_value(self.kind, v) for v in bounds)
        if lo is None or hi is None:
            self.unbounded = True
            return
        self._widen(lo, hi)

    def _widen(self, lo: Any, hi: Any) -> None:
        """Take in the bounds ``lo`` and ``hi`` of more values."""
        self.lo = lo if self.lo is None or lo < self.lo else self.lo
        self.hi = hi if self.hi is None or hi > self.hi else self.hi

    @property
    def has_values(self) -> bool:
        return self.unbounded or self.lo is not None

    def bounds(self) -> tuple[Any, Any]:
        """JSON values of (min, max); raise :class:`_Unbounded` when the column
        holds a value no bound can state."""
        if self.unbounded:
            raise _Unbounded
        if self.kind == "string":
            return self.lo[:STRING_PREFIX], _string_upper(self.hi)
        if self.kind == "date":
            return _date(self.lo), _date(self.hi)
        if self.kind in ("timestamp", "timestamp_ntz"):
            zone = "Z" if self.kind == "timestamp" else ""
            return _timestamp_ms(self.lo // 1000, zone), _timestamp_ms(-(-self.hi // 1000), zone)
        return self.lo, self.hi


def _footer_value(kind: str, value: Any) -> Any:
    """A footer's bound in the form :meth:`_Column.update` keeps (days for dates,
    microseconds for timestamps); ``None`` for a NaN or an infinity."""
    if kind == "float":
        return value if math.isfinite(value) else None
    if kind == "date":
        return (value - _EPOCH_DATE).days
    if kind in ("timestamp", "timestamp_ntz"):
        if value.tzinfo is not None:
            value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
        delta = value - _EPOCH
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return value


def _string_upper(s: str) -> str:
    """``s`` if at most 32 characters long, else the least string of at most 32
    characters that is greater than every string starting with ``s[:32]``."""
    if len(s) <= STRING_PREFIX:
        return s
    prefix = s[:STRING_PREFIX]
    for i in range(len(prefix) - 1, -1, -1):
        c = ord(prefix[i])
        if c < _MAX_CHAR:
            return prefix[:i] + chr(0xE000 if c + 1 == 0xD800 else c + 1)  # skip surrogates
    raise _Unbounded


def _date(days: int) -> str:
    try:
        return (_EPOCH_DATE + dt.timedelta(days=days)).isoformat()
    except OverflowError:
        raise _Unbounded from None


def _timestamp_ms(ms: int, zone: str) -> str:
    try:
        t = _EPOCH + dt.timedelta(milliseconds=ms)
    except OverflowError:
        raise _Unbounded from None
    return (
        f"{t.year:04d}-{t.month:02d}-{t.day:02d}T{t.hour:02d}:{t.minute:02d}:{t.second:02d}"
        f".{t.microsecond // 1000:03d}{zone}"
    )


class FileStats:
    """Statistics of one data file, fed the record batches written to it."""

    def __init__(self, schema: pa.Schema) -> None:
        self.rows = 0
        self._columns = {
            f.name: _Column(_kind(f.type)) for f in schema if not pa.types.is_nested(f.type)
        }

    @classmethod
    def from_footer(cls, meta: pq.FileMetaData, schema: pa.Schema) -> FileStats:
        """Statistics of a Parquet file of ``schema`` (its columns at the top
        level) from its footer, without reading its data."""
        stats = cls(schema)
        leaves = {meta.schema.column(j).path: j for j in range(meta.num_columns)}
        for rg in range(meta.num_row_groups):
            group = meta.row_group(rg)
            stats.rows += group.num_rows
            for name, col in stats._columns.items():
                j = leaves.get(name)
                st = group.column(j).statistics if j is not None else None
                if st is None or not st.has_null_count:
                    col.unbounded = col.unbounded or col.kind is not None
                    col.nulls_unknown = True
                    continue
                bounds = (st.min, st.max) if st.has_min_max else None
                col.update_bounds(st.null_count, bounds, group.num_rows)
        return stats

    def update(self, data: pa.RecordBatch | pa.Table) -> None:
        """Account for ``data`` (a batch or table of the file's schema)."""
        self.rows += data.num_rows
        for name, col in self._columns.items():
            col.update(data.column(name))

    def to_json(self) -> str:
        """The ``stats`` string of the file's add action."""
        lo: dict[str, Any] = {}
        hi: dict[str, Any] = {}
        try:
            for name, col in self._columns.items():
                if col.kind is not None and col.has_values:
                    lo[name], hi[name] = col.bounds()
        except _Unbounded:
            lo, hi = {}, {}  # a bound for every column, or none (see the module doc)
        doc: dict[str, Any] = {"numRecords": self.rows}
        if lo:
            doc["minValues"] = lo
            doc["maxValues"] = hi
        doc["nullCount"] = {
            name: col.nulls for name, col in self._columns.items() if not col.nulls_unknown
        }
        return _dumps(doc)


def _dumps(doc: dict[str, Any]) -> str:
    """JSON of ``doc`` with every :class:`~decimal.Decimal` as an exact number
    (``json`` writes none: each goes in as a unique string, then is replaced)."""
    token = f"twophase-decimal-{uuid.uuid4().hex}-"
    numbers: dict[str, str] = {}

    def exact(value: Any) -> Any:
        if isinstance(value, Decimal):
            key = f"{token}{len(numbers)}"
            numbers[json.dumps(key)] = f"{value:f}"
            return key
        if isinstance(value, dict):
            return {k: exact(v) for k, v in value.items()}
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"statistics cannot hold {value}")
        return value

    # ensure_ascii=False: deltalake (1.6) decodes an escaped surrogate pair
    # wrongly ("\\ud840\\udc00", U+20000, as U+10000), so characters beyond
    # U+FFFF go in as UTF-8 (control characters are still escaped)
    text = json.dumps(exact(doc), separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    for quoted, number in numbers.items():
        text = text.replace(quoted, number)
    return text
