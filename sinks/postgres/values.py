"""Record batches cast to their wire types for binary COPY: exact or refused.

Binary COPY hands PostgreSQL the bytes of each value in its column's binary
format, so what PostgreSQL would refuse or mangle must be caught before the
bytes are sent. Every column is cast to its wire type (:mod:`sinks.postgres.types`)
with Arrow's checked cast (narrowed integers, sub-microsecond timestamps,
decimals the column's scale would round), then checked for what the cast lets
through:

* text holding NUL (0x00), which PostgreSQL text cannot store;
* dates and timestamps outside PostgreSQL's range. Below it, pgpq's shift from
  the 1970 to the 2000 epoch overflows: one value comes out as ``-infinity``
  (accepted by the server: silent garbage), the others as encoder or server
  errors that name no value;
* finite numbers that a ``real`` column would hold as an infinity.

A value that fails raises :class:`~sinks.errors.DataError` naming the sink, the
column, the row of the record batch and the value. All checks are vectorised:
no per-row Python unless a value fails.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from sinks import _binaries as _b
from sinks.errors import DataError

PG_TYPE_KEY = b"pg"
"""Field metadata of a wire schema: the target column's type, for messages."""

PG_MIN_DATE = -2_440_588
"""4714-11-24 BC (Julian day 0), PostgreSQL's first date, in days since 1970-01-01."""
PG_END_DATE = 2_145_042_906
"""The day after 5874897-12-31, PostgreSQL's last date, in days since 1970-01-01."""
PG_MIN_TIMESTAMP = PG_MIN_DATE * 86_400_000_000
"""PostgreSQL's first timestamp (4714-11-24 00:00 BC UTC) in microseconds since
1970. Its last (294276-12-31) is later than Arrow's (294247-01-10 for int64
microseconds), so timestamps need no upper check."""

_PG_RANGE = {
    "date": "4714-11-24 BC to 5874897-12-31",
    "timestamp": "4714-11-24 00:00 BC to 294276-12-31",
}


def to_wire(batch: pa.RecordBatch, wire: pa.Schema, where: str) -> pa.RecordBatch:
    """``batch`` (fields in the order of ``wire``) cast to the wire types; raise
    :class:`DataError` on the first value the target column cannot hold exactly."""
    arrays = []
    for field, arr in zip(wire, batch.columns, strict=True):
        arrays.append(_column(arr, field, where))
    return pa.RecordBatch.from_arrays(arrays, schema=wire)


def _column(arr: pa.Array, field: pa.Field, where: str) -> pa.Array:
    t = field.type
    target = (field.metadata or {}).get(PG_TYPE_KEY, str(t).encode()).decode()

    def refuse(row: int, why: str) -> DataError:
        return DataError(
            f"{where}: column {field.name!r} ({target}), row {row} of a record batch: "
            f"{_show(arr[row])} {why}; nothing of this task is committed"
        )

    try:
        out = arr.cast(t, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        row = _first_failing(arr, lambda part: part.cast(t, safe=True))
        raise refuse(row, f"cannot be written exactly ({e})") from e
    bad: pa.Array | None = None
    why = ""
    if pa.types.is_string(t):
        if (_b.used_bytes(out) == 0).any():  # one pass over the bytes; then find the row
            bad = pc.match_substring(out, "\0")
        why = "holds NUL (\\x00), which PostgreSQL text cannot store"
    elif pa.types.is_date32(t):
        days = out.view(pa.int32())
        bad = pc.or_(pc.less(days, PG_MIN_DATE), pc.greater_equal(days, PG_END_DATE))
        why = f"is out of PostgreSQL's range ({_PG_RANGE['date']})"
    elif pa.types.is_timestamp(t):
        bad = pc.less(out.view(pa.int64()), PG_MIN_TIMESTAMP)
        why = f"is out of PostgreSQL's range ({_PG_RANGE['timestamp']})"
    elif pa.types.is_float32(t):
        bad = pc.is_inf(out)
        if pa.types.is_floating(arr.type):
            bad = pc.and_(bad, pc.invert(pc.is_inf(arr)))
        why = "is too large for real (it would be stored as an infinity)"
    if bad is not None and pc.any(bad).as_py():
        raise refuse(pc.index(bad, True).as_py(), why)
    return out


def _first_failing(arr: pa.Array, convert: Callable[[pa.Array], object]) -> int:
    """The first row of ``arr`` that ``convert`` fails on (``convert`` fails on
    the whole of ``arr``): a bisection, O(log n) conversions of prefixes."""
    lo, hi = 0, len(arr)  # arr[:lo] converts, arr[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            convert(arr.slice(0, mid))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            hi = mid
        else:
            lo = mid
    return lo


def _show(value: pa.Scalar) -> str:
    """A value for a message; dates and times out of Python's range as raw counts."""
    t = value.type
    try:
        v = value.as_py()
    except (ValueError, OverflowError):
        v = None
    if isinstance(v, dt.datetime | dt.date):
        return v.isoformat()
    if v is not None:
        text = repr(v)
        return text if len(text) <= 80 else text[:77] + "..."
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        raw = value.cast(pa.int64() if t.bit_width == 64 else pa.int32()).as_py()
        unit = "days" if pa.types.is_date32(t) else getattr(t, "unit", "ms")
        return f"{raw} {unit} since 1970-01-01"
    return str(value)
