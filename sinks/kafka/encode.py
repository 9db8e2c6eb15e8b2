"""Arrow record batches to Kafka record keys, values and headers.

Everything is converted column-wise with pyarrow compute kernels; only the
final list of ``bytes`` per column is materialised in Python (kafka-python
sends one record at a time anyway).

* key and header columns: binary as is; strings as UTF-8; integers, floats,
  decimals and booleans as their decimal text in UTF-8 (``42`` -> ``b"42"``).
  A null key is a null key; a null header value leaves that header out
  (kafka-python cannot send a header without a value).
* value column: binary or string.
* no value column: each row becomes a JSON object of all its columns.
  Numbers are JSON numbers (decimals exact), booleans and nulls as such,
  non-finite floats become ``null``, strings are escaped, binary is base64,
  dates, times and timestamps are ISO-8601 strings (``T`` separator, ``Z`` for
  UTC-aware timestamps), anything else (lists, structs, maps, durations) goes
  through :func:`json.dumps` per value (nested decimals as strings).
"""

from __future__ import annotations

import base64
import datetime
import json
import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sinks.errors import PreflightError

_LS = pa.large_string()
_NULL = pa.scalar("null", _LS)
_EMPTY = pa.scalar("", _LS)
_QUOTE = pa.scalar('"', _LS)
_CONTROL = r"[\x00-\x1f]"


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_binary(t: pa.DataType) -> bool:
    return (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_binary_view(t)
    )


def _is_number(t: pa.DataType) -> bool:
    return (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_decimal(t)
        or pa.types.is_boolean(t)
    )


def _value_type(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def check_bytes_column(schema: pa.Schema, name: str, role: str, *, numbers: bool) -> None:
    """Raise :class:`PreflightError` unless ``name`` is a column usable as ``role``."""
    if name not in schema.names:
        raise PreflightError(
            f"the {role} column {name!r} is not in the DataFrame (columns: {schema.names})"
        )
    t = _value_type(schema.field(name).type)
    ok = _is_text(t) or _is_binary(t) or (numbers and _is_number(t))
    if not ok:
        kinds = "binary, string, integer, floating point, decimal or boolean"
        if not numbers:
            kinds = "binary or string"
        raise PreflightError(
            f"the {role} column {name!r} has type {t}; a Kafka {role} must be {kinds}: "
            f"cast it first (e.g. to_json(...) or cast('string'))"
        )


def _plain(arr: pa.Array) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return arr


def to_bytes(arr: pa.Array) -> list[bytes | None]:
    """One ``bytes`` (or None for null) per element of a key/header/value column."""
    arr = _plain(arr)
    t = arr.type
    if _is_binary(t):
        return arr.to_pylist()  # type: ignore[no-any-return]
    if _is_text(t):
        return pc.cast(arr, pa.large_binary()).to_pylist()  # type: ignore[no-any-return]
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_decimal(t):
        return pc.cast(pc.cast(arr, _LS), pa.large_binary()).to_pylist()  # type: ignore[no-any-return]
    if pa.types.is_floating(t):
        return pc.cast(pc.cast(arr, _LS), pa.large_binary()).to_pylist()  # type: ignore[no-any-return]
    raise TypeError(f"cannot turn a column of type {t} into Kafka bytes")


# -- JSON ------------------------------------------------------------------------------


def _json_default(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(v)).decode("ascii")
    if isinstance(v, (datetime.datetime, datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, datetime.timedelta):
        return v.total_seconds()
    return str(v)  # Decimal (exact text, as a JSON string), UUID, ...


def _sanitize(v: Any) -> Any:
    """Non-finite floats (which JSON cannot carry) become None, at any depth."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _sanitize(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_sanitize(x) for x in v]
    return v


def _generic(arr: pa.Array) -> pa.Array:
    """Nested and unusual types: json.dumps per value (rare, slower path)."""
    out = [
        None if v is None else json.dumps(_sanitize(v), default=_json_default, allow_nan=False)
        for v in arr.to_pylist()
    ]
    return pa.array(out, _LS)


def _quoted_text(arr: pa.Array) -> pa.Array:
    """A JSON string literal per element (nulls stay null)."""
    s = pc.cast(arr, _LS)
    if pc.any(pc.match_substring_regex(s, _CONTROL)).as_py():
        return pa.array([None if v is None else json.dumps(v) for v in s.to_pylist()], _LS)
    s = pc.replace_substring(s, "\\", "\\\\")
    s = pc.replace_substring(s, '"', '\\"')
    return pc.binary_join_element_wise(_QUOTE, s, _QUOTE, _EMPTY)


def _fragment(arr: pa.Array) -> pa.Array:
    """A JSON text per element: numbers, literals, quoted strings; null as null."""
    arr = _plain(arr)
    t = arr.type
    if pa.types.is_null(t):
        return pa.array([None] * len(arr), _LS)
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_decimal(t):
        return pc.cast(arr, _LS)
    if pa.types.is_floating(t):
        finite = pc.is_finite(arr)
        return pc.if_else(finite, pc.cast(arr, _LS), pa.scalar(None, _LS))
    if _is_text(t):
        return _quoted_text(arr)
    if _is_binary(t):
        encoded = [
            None if v is None else base64.b64encode(v).decode("ascii") for v in arr.to_pylist()
        ]
        return _quoted_text(pa.array(encoded, _LS))
    if pa.types.is_date(t) or pa.types.is_time(t):
        return _quoted_text(pc.cast(arr, _LS))
    if pa.types.is_timestamp(t):
        text = pc.replace_substring(pc.cast(arr, _LS), " ", "T", max_replacements=1)
        return _quoted_text(text)
    return _generic(arr)


def json_rows(batch: pa.RecordBatch) -> list[bytes]:
    """Each row of ``batch`` as a UTF-8 JSON object (``{"col": value, ...}``)."""
    if batch.num_columns == 0:
        return [b"{}"] * batch.num_rows
    parts: list[Any] = []
    for i, (name, column) in enumerate(zip(batch.schema.names, batch.columns, strict=True)):
        prefix = ("{" if i == 0 else ",") + json.dumps(name) + ":"
        parts.append(pa.scalar(prefix, _LS))
        parts.append(pc.fill_null(_fragment(column), _NULL))
    parts.append(pa.scalar("}", _LS))
    rows = pc.binary_join_element_wise(*parts, _EMPTY)
    return pc.cast(rows, pa.large_binary()).to_pylist()  # type: ignore[no-any-return]
