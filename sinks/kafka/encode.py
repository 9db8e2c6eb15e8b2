"""Arrow record batches to Kafka record keys, values and headers.

Longer than 450 lines because it is one encoding with one rule per type: keys
and headers write numbers by the JSON rules below, and the preflight's type
check and the encoder apply the same per-type rules, so they are read together.

Everything is converted column-wise with pyarrow compute kernels, nested types
included (a list column is encoded by encoding all its elements as one column and
joining them per row); only the final ``bytes`` per record are materialised in
Python, plus, per value, base64 of binary values, escaping of strings that hold a
control character and the plain text of decimals Arrow writes with an exponent.

Keys and headers (:func:`to_bytes`)
-----------------------------------
Binary as is; strings as UTF-8; integers and decimals as their exact decimal text
(``411`` -> the three bytes ``b"411"``, never an 8-byte big-endian long: a Java
consumer reads them with ``StringDeserializer``; decimal(5,2) ``1.50`` ->
``b"1.50"``, in plain notation as in JSON below); booleans ``true`` / ``false``;
floats as in JSON below (``1.5``, ``1e+20``, ``NaN``, ``Infinity``,
``-Infinity``). A null key is a null key; a null header value leaves that header
out (kafka-python cannot send a header without a value).

JSON values (:func:`json_rows`, when the sink has no ``value`` column)
----------------------------------------------------------------------
Each row becomes one JSON object of all its columns, in column order, UTF-8.
One rule per type, the same at every depth (top-level columns, struct fields,
list elements, map values):

* null: ``null``; booleans: ``true`` / ``false``; integers (any width): numbers.
* floats: numbers, in the shortest text that reads back to the same value (for
  float32: to the same float32): ``1.5``, ``1`` for 1.0, ``1e+20``, ``-0``.
  NaN and the infinities, which JSON numbers cannot carry, are the strings
  ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (what Spark's ``from_json``, Jackson and
  Python's ``float()`` read back); never ``null``.
* decimals (decimal32 to decimal256, any precision): strings of the exact
  decimal text in plain notation with ``scale`` fraction digits (``"1.50"``,
  ``"-0.05"``, ``"411"``, ``"0.0000000000"`` at scale 10, never ``0E-10``; a
  negative scale, which Spark does not produce, has no fraction: ``"12300"``). Strings, not
  numbers, so that readers which parse JSON numbers as doubles (JavaScript,
  Python's :mod:`json` for fractions, Jackson by default) lose neither digits nor
  the scale.
* strings: JSON strings in UTF-8 (non-ASCII characters are not escaped); ``"``,
  ``\\`` and the control characters U+0000 to U+001F are escaped (``\\n``,
  ``\\u0000``).
* binary (any binary type): the base64 text (RFC 4648, padded) as a string.
* dates: ``"YYYY-MM-DD"``; times of day: ``"HH:MM:SS.ffffff"``.
* timestamps with a time zone (Spark's ``TimestampType``, which arrives in the
  session time zone): the instant in UTC, ``"YYYY-MM-DDTHH:MM:SS.ffffffZ"``, always
  six fraction digits, whatever the session or column zone. Timestamps without a
  zone (Spark's ``TimestampNTZType``): the same text without ``Z``
  (``"YYYY-MM-DDTHH:MM:SS.ffffff"``): a wall-clock time, not an instant.
* durations (Spark's ``DayTimeIntervalType``): ISO 8601 seconds,
  ``"PT90.000001S"``, negative ones ``"-PT1.500000S"``.
* lists (any list type): arrays; structs: objects of their fields in order.
* maps: objects. A key is the text of the key's JSON value: the string itself
  where the value is written as a JSON string (strings, decimals, dates,
  timestamps, binary as base64, ``NaN``), otherwise its JSON text (``411`` ->
  ``"411"``, ``true`` -> ``"true"``, ``1.5`` -> ``"1.5"``, a struct -> its object
  text). Arrow map keys are never null.
* dictionary-encoded columns: as their values.

Refused, never written in a lossy or ambiguous way:

* types (:func:`check_json_schema`, a :class:`PreflightError` at preflight naming
  the column and its type): unions, calendar intervals (month_day_nano),
  extension and run-end encoded types, and duplicate names among the columns or
  a struct's fields (an object cannot hold both);
* values (:class:`JSONEncodeError` from :func:`json_rows`, raised by the writer
  before the batch is sent, so nothing of it commits): dates and timestamps
  outside 0001-01-01 to 9999-12-31 (zoned timestamps: in UTC), times outside
  00:00 to 24:00, timestamps, times and durations with a fraction of a
  microsecond (possible only in nanosecond units, which Spark's TIME type uses
  with whole microseconds: truncate them first), and maps whose keys
  repeat once written as text.
"""

from __future__ import annotations

import base64
import decimal
import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sinks import _binaries as _b
from sinks.errors import DataError, PreflightError

_LS = pa.large_string()
_NULL = pa.scalar("null", _LS)
_NO_TEXT = pa.scalar(None, _LS)
_EMPTY = pa.scalar("", _LS)
_QUOTE = pa.scalar('"', _LS)
_COMMA = pa.scalar(",", _LS)

_US_PER_UNIT = {"s": 1_000_000, "ms": 1_000, "us": 1, "ns": None}
_UNITS_PER_S = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
_FIRST_S = -62_135_596_800  # 0001-01-01T00:00:00 UTC, in seconds since 1970
_END_S = 253_402_300_800  # 10000-01-01T00:00:00 UTC
_FIRST_DAY, _END_DAY = _FIRST_S // 86_400, _END_S // 86_400
_DAY_US = 86_400_000_000
_INT64 = (-(2**63), 2**63 - 1)


class JSONEncodeError(DataError, ValueError):
    """A value (or type) the JSON encoding refuses: the message names the column,
    the row and the value. Raised before anything of the batch is sent."""


# -- types -----------------------------------------------------------------------------


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or _is(t, "is_string_view")


def _is_binary(t: pa.DataType) -> bool:
    return (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or _is(t, "is_binary_view")
    )


def _is_list(t: pa.DataType) -> bool:
    return (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or _is(t, "is_list_view")
        or _is(t, "is_large_list_view")
    )


def _is(t: pa.DataType, predicate: str) -> bool:
    """``pa.types.<predicate>(t)``, False where this pyarrow lacks the type."""
    f = getattr(pa.types, predicate, None)
    return bool(f(t)) if f is not None else False


def _is_number(t: pa.DataType) -> bool:
    return (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_decimal(t)
        or pa.types.is_boolean(t)
    )


def _value_type(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _writes_string(t: pa.DataType) -> bool:
    """Whether every non-null value of type ``t`` is written as a JSON string."""
    return (
        _is_text(t)
        or _is_binary(t)
        or pa.types.is_decimal(t)
        or pa.types.is_date(t)
        or pa.types.is_time(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_duration(t)
    )


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


def _duplicate(names: Sequence[str]) -> str | None:
    seen: set[str] = set()
    for n in names:
        if n in seen:
            return n
        seen.add(n)
    return None


def _type_problem(t: pa.DataType, path: str) -> str | None:
    """Why a value of type ``t`` at ``path`` cannot be written as JSON, or None."""
    t = _value_type(t)
    if (
        pa.types.is_null(t)
        or _is_number(t)
        or _is_text(t)
        or _is_binary(t)
        or pa.types.is_date(t)
        or pa.types.is_time(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_duration(t)
    ):
        return None
    if _is_list(t):
        return _type_problem(t.value_type, f"{path}[]")
    if pa.types.is_map(t):
        return _type_problem(t.key_type, f"{path}{{key}}") or _type_problem(
            t.item_type, f"{path}{{value}}"
        )
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        dup = _duplicate(names)
        if dup is not None:
            return (
                f"the struct {path!r} has two fields named {dup!r}, which one JSON object "
                "cannot hold: rename one"
            )
        for i in range(t.num_fields):
            problem = _type_problem(t.field(i).type, f"{path}.{t.field(i).name}")
            if problem:
                return problem
        return None
    return (
        f"{path!r} has type {t}, which the Kafka JSON encoding does not write: cast it "
        "first (e.g. to a string, or with to_json(...) into a value column)"
    )


def _schema_problem(schema: pa.Schema) -> str | None:
    dup = _duplicate(schema.names)
    if dup is not None:
        return (
            f"two columns are named {dup!r}; a Kafka JSON value is one object per row and "
            "cannot hold both: rename or drop one"
        )
    for f in schema:
        problem = _type_problem(f.type, f.name)
        if problem:
            return problem
    return None


def check_json_schema(schema: pa.Schema) -> None:
    """Raise :class:`PreflightError` unless every column can be written as JSON."""
    problem = _schema_problem(schema)
    if problem:
        raise PreflightError(f"cannot write rows as Kafka JSON values: {problem}")


# -- keys and headers ------------------------------------------------------------------


def _plain(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return arr


def to_binary(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A key/header/value column as a ``large_binary`` array (nulls stay null)."""
    arr = _plain(arr)
    t = arr.type
    if _is_binary(t) or _is_text(t):
        text = arr
    elif pa.types.is_boolean(t) or pa.types.is_integer(t):
        text = pc.cast(arr, _LS)
    elif pa.types.is_decimal(t):
        text = _decimal_text(arr)
    elif pa.types.is_floating(t):
        text = _float_text(arr)
    else:
        raise TypeError(f"cannot turn a column of type {t} into Kafka bytes")
    return pc.cast(text, pa.large_binary())


def to_bytes(arr: pa.Array | pa.ChunkedArray) -> list[bytes | None]:
    """One ``bytes`` (or None for null) per element of a key/header/value column."""
    return to_binary(arr).to_pylist()


# -- JSON: scalars -----------------------------------------------------------------------


def _s(text: str) -> pa.Scalar:
    return pa.scalar(text, _LS)


def _where(arr: pa.Array, text: pa.Array) -> pa.Array:
    """``text`` with a null wherever ``arr`` is null."""
    if arr.null_count == 0:
        return text
    return pc.if_else(pc.is_valid(arr), text, _NO_TEXT)


def _quoted_text(arr: pa.Array) -> pa.Array:
    """A JSON string literal per element (nulls stay null)."""
    s = pc.cast(arr, _LS)
    control, specials = _escapes(s)
    if control:
        dump = json.dumps
        return pa.array(
            [None if v is None else dump(v, ensure_ascii=False) for v in s.to_pylist()], _LS
        )
    if specials:
        s = pc.replace_substring(s, "\\", "\\\\")
        s = pc.replace_substring(s, '"', '\\"')
    return _quote(s)


def _escapes(s: pa.Array) -> tuple[bool, bool]:
    """Whether the text of ``s`` holds a control character, and whether it holds
    a ``"`` or a ``\\``: one pass over its bytes (UTF-8 continuation and lead bytes
    are all >= 0x80, so a byte below 0x20 or equal to 0x22 or 0x5C is that ASCII
    character). Bytes behind nulls count too: at worst a needless escape pass."""
    text = _b.used_bytes(s)
    if (text < 0x20).any():
        return True, True
    return False, bool(((text == 0x22) | (text == 0x5C)).any())


def _bare_text(arr: pa.Array) -> pa.Array | None:
    """``arr`` as ``large_string`` when it is text with no nulls and nothing to
    escape, so that its quotes can be joined with the text around it; else None."""
    if arr.null_count or not _is_text(arr.type):
        return None
    s = pc.cast(arr, _LS)
    return None if any(_escapes(s)) else s


def _quote(s: pa.Array) -> pa.Array:
    """Wrap text that needs no escaping in double quotes."""
    return pc.binary_join_element_wise(_QUOTE, s, _QUOTE, _EMPTY)


def _float_text(arr: pa.Array) -> pa.Array:
    """Shortest round-trip text of each float; NaN, Infinity, -Infinity as words."""
    if pa.types.is_float16(arr.type):
        arr = pc.cast(arr, pa.float32())
    text = pc.cast(arr, _LS)
    if pc.all(pc.is_finite(arr)).as_py() is not False:
        return text
    inf = pc.if_else(pc.greater(arr, 0), _s("Infinity"), _s("-Infinity"))
    return pc.if_else(pc.is_nan(arr), _s("NaN"), pc.if_else(pc.is_inf(arr), inf, text))


def _decimal_text(arr: pa.Array) -> pa.Array:
    """The exact text of each decimal in plain notation, ``scale`` fraction digits.

    Arrow writes small values with a large scale (``0E-10``, ``1E-7``) and values
    with a negative scale (``1.23E+4``) in scientific notation; those few are
    rewritten in Python (``0.0000000000``, ``0.0000001``, ``12300``)."""
    text = pc.cast(arr, _LS)
    sci = pc.fill_null(pc.match_substring(text, "E"), False)
    if not pc.any(sci).as_py():
        return text
    plain = [format(decimal.Decimal(v), "f") for v in pc.filter(text, sci).to_pylist()]
    return pc.replace_with_mask(text, sci, pa.array(plain, _LS))


def _float_json(arr: pa.Array) -> pa.Array:
    if pa.types.is_float16(arr.type):
        arr = pc.cast(arr, pa.float32())
    text = pc.cast(arr, _LS)
    if pc.all(pc.is_finite(arr)).as_py() is not False:
        return text
    return pc.if_else(pc.is_finite(arr), text, _quote(_float_text(arr)))


def _refuse(path: str, arr: pa.Array, bad: pa.Array, what: str) -> None:
    """Raise for the first element where ``bad`` is true, if any."""
    bad = pc.fill_null(bad, False)
    if not pc.any(bad).as_py():
        return
    i = pc.index(bad, True).as_py()
    shown = pc.cast(arr.slice(i, 1), _LS)[0].as_py() if _castable(arr.type) else arr[i]
    where = f"row {i}" if _top_level(path) else f"nested value {i} (in row order)"
    raise JSONEncodeError(
        f"column {path!r}, {where} of the batch: {shown} ({arr.type}) cannot be written "
        f"as Kafka JSON: {what}"
    )


def _top_level(path: str) -> bool:
    return not any(c in path for c in ".[{")


def _castable(t: pa.DataType) -> bool:
    try:
        pc.cast(pa.array([], t), _LS)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        return False
    return True


def _ints(arr: pa.Array) -> pa.Array:
    return arr.view(pa.int64() if arr.type.bit_width == 64 else pa.int32())


def _to_micros(arr: pa.Array, path: str) -> pa.Array:
    """The int64 count of microseconds of a time/timestamp/duration array."""
    unit = arr.type.unit
    ints = pc.cast(_ints(arr), pa.int64())
    if unit == "ns":
        whole = pc.multiply(pc.divide(ints, 1000), 1000)  # integer division truncates
        _refuse(
            path,
            arr,
            pc.not_equal(whole, ints),
            "it has a fraction of a microsecond and the encoding writes microseconds; "
            "truncate it first (e.g. cast to microseconds)",
        )
        return pc.divide(ints, 1000)
    factor = _US_PER_UNIT[unit]
    assert factor is not None
    if factor > 1:
        lo, hi = -(2**63 // factor), _INT64[1] // factor
        _refuse(
            path,
            arr,
            pc.or_(pc.less(ints, lo), pc.greater(ints, hi)),
            "out of range: more microseconds than a 64-bit integer holds",
        )
        return pc.multiply_checked(ints, factor)
    return ints


def _timestamp_json(arr: pa.Array, path: str) -> pa.Array:
    t = arr.type
    per_s = _UNITS_PER_S[t.unit]
    first, end = _FIRST_S * per_s, _END_S * per_s
    ints = pc.cast(_ints(arr), pa.int64())
    if first >= _INT64[0] or end <= _INT64[1]:
        span = "0001-01-01T00:00:00 to 9999-12-31T23:59:59.999999"
        what = f"in UTC it is outside {span}Z (the column's zone is {t.tz})"
        _refuse(
            path,
            arr,
            pc.or_(pc.less(ints, max(first, _INT64[0])), pc.greater_equal(ints, end)),
            what if t.tz is not None else f"it is outside {span}",
        )
    micros = _to_micros(arr, path)
    text = pc.cast(micros.view(pa.timestamp("us")), _LS)  # "YYYY-MM-DD HH:MM:SS.ffffff"
    text = pc.replace_substring(text, " ", "T", max_replacements=1)
    if t.tz is not None:
        text = pc.binary_join_element_wise(text, _s("Z"), _EMPTY)
    return _quote(text)


def _date_json(arr: pa.Array, path: str) -> pa.Array:
    if pa.types.is_date64(arr.type):
        ms = pc.cast(arr.view(pa.int64()), pa.int64())
        _refuse(
            path,
            arr,
            pc.not_equal(pc.multiply(pc.divide(ms, 86_400_000), 86_400_000), ms),
            "a date64 that is not at midnight",
        )
        days = pc.divide(ms, 86_400_000)
    else:
        days = pc.cast(arr.view(pa.int32()), pa.int64())
    _refuse(
        path,
        arr,
        pc.or_(pc.less(days, _FIRST_DAY), pc.greater_equal(days, _END_DAY)),
        "it is outside 0001-01-01 to 9999-12-31",
    )
    return _quote(pc.cast(pc.cast(days, pa.int32()).view(pa.date32()), _LS))


def _time_json(arr: pa.Array, path: str) -> pa.Array:
    micros = _to_micros(arr, path)
    _refuse(
        path,
        arr,
        pc.or_(pc.less(micros, 0), pc.greater_equal(micros, _DAY_US)),
        "a time of day must be from 00:00:00 to before 24:00:00",
    )
    return _quote(pc.cast(micros.view(pa.time64("us")), _LS))  # "HH:MM:SS.ffffff"


def _duration_json(arr: pa.Array, path: str) -> pa.Array:
    micros = _to_micros(arr, path)
    digits = pc.replace_substring(pc.cast(micros, _LS), "-", "", max_replacements=1)
    digits = pc.utf8_lpad(digits, 7, "0")
    whole = pc.utf8_slice_codeunits(digits, 0, -6)
    fraction = pc.utf8_slice_codeunits(digits, -6)
    sign = pc.if_else(pc.less(micros, 0), _s('"-PT'), _s('"PT'))
    return pc.binary_join_element_wise(sign, whole, _s("."), fraction, _s('S"'), _EMPTY)


def _binary_json(arr: pa.Array) -> pa.Array:
    b64 = base64.b64encode
    encoded = [None if v is None else b64(v).decode("ascii") for v in arr.to_pylist()]
    return _quote(pa.array(encoded, _LS))  # the base64 alphabet needs no escaping


# -- JSON: nested ------------------------------------------------------------------------


def _filled(arr: pa.Array, path: str) -> pa.Array:
    """The JSON text of each element, ``null`` for nulls (never a null)."""
    return pc.fill_null(_fragment(arr, path), _NULL)


def _object(names: Sequence[str], children: Sequence[pa.Array], length: int, path: str) -> pa.Array:
    """``{"name": child, ...}`` per row (no nulls)."""
    if not names:
        return pa.array(["{}"] * length, _LS)
    prefix = path + "." if path else ""
    parts: list[Any] = []
    text = ""  # the literal text before the next column
    for i, (name, child) in enumerate(zip(names, children, strict=True)):
        text += ("{" if i == 0 else ",") + json.dumps(name, ensure_ascii=False) + ":"
        plain = _plain(child)
        bare = _bare_text(plain)
        if bare is not None:  # its quotes go into the literals around it
            parts += [_s(text + '"'), bare]
            text = '"'
        else:
            parts += [_s(text), _filled(plain, prefix + name)]
            text = ""
    parts.append(_s(text + "}"))
    return pc.binary_join_element_wise(*parts, _EMPTY)


def _joined(arr: pa.Array, items: pa.Array, open_: str, close: str) -> pa.Array:
    """``open_ item,item close`` per list of ``arr`` (null where ``arr`` is null);
    ``items`` holds the text of every element of the non-null lists, in order."""
    lists = pa.LargeListArray.from_arrays(_offsets(arr), items)
    text = pc.binary_join_element_wise(_s(open_), pc.binary_join(lists, _COMMA), _s(close), _EMPTY)
    return _where(arr, text)


def _offsets(arr: pa.Array) -> pa.Array:
    """int64 offsets of the elements of ``arr``'s lists in ``pc.list_flatten(arr)``
    (a null list counts as empty)."""
    lengths = pc.cast(pc.fill_null(pc.list_value_length(arr), 0), pa.int64())
    return pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(lengths)])


def _list_json(arr: pa.Array, path: str) -> pa.Array:
    return _joined(arr, _filled(pc.list_flatten(arr), f"{path}[]"), "[", "]")


def _map_json(arr: pa.Array, path: str) -> pa.Array:
    # the map as a list of its entries (Array.view breaks on a null-typed value)
    off = arr.offsets
    start, end = off[0].as_py(), off[-1].as_py()
    entries = arr.values.slice(start, end - start)
    mask = arr.is_null() if arr.null_count else None
    as_list = pa.ListArray.from_arrays(pc.subtract(off, start), entries, mask=mask)
    keys, values = pc.list_flatten(as_list).flatten()
    if keys.null_count:
        raise JSONEncodeError(f"column {path!r}: a map has a null key (Arrow forbids them)")
    key_text = _key_json(keys, f"{path}{{key}}")
    _refuse_repeated_keys(as_list, keys, key_text, path)
    value_text = _filled(values, f"{path}{{value}}")
    items = pc.binary_join_element_wise(key_text, _s(":"), value_text, _EMPTY)
    return _joined(as_list, items, "{", "}")


def _refuse_repeated_keys(as_list: pa.Array, keys: pa.Array, key_text: pa.Array, path: str) -> None:
    """Raise if one map holds two keys with the same text (a JSON reader would keep
    only one of them)."""
    if len(keys) < 2:
        return
    parents = pc.list_parent_indices(pa.LargeListArray.from_arrays(_offsets(as_list), key_text))
    # a key's text is a JSON string literal: "<map index>:<literal>" is unique per key
    tagged = pc.binary_join_element_wise(pc.cast(parents, _LS), _s(":"), key_text, _EMPTY)
    if pc.count_distinct(tagged).as_py() == len(keys):
        return
    seen: set[str] = set()
    for v in tagged.to_pylist():
        if v in seen:
            where, _, literal = v.partition(":")
            raise JSONEncodeError(
                f"column {path!r}: map number {where} of the batch holds the key "
                f"{json.loads(literal)!r} more than once (keys of type {keys.type} written "
                "as JSON object names), which one JSON object cannot hold"
            )
        seen.add(v)


def _key_json(keys: pa.Array, path: str) -> pa.Array:
    """A JSON string per map key: the key's JSON value as text."""
    t = _plain(keys).type
    if _writes_string(t):
        return _fragment(keys, path)
    if pa.types.is_floating(t):
        return _quote(_float_text(_plain(keys)))  # digits, letters, '-', '+', '.'
    return _quoted_text(_fragment(keys, path))


def _fragment(arr: pa.Array, path: str) -> pa.Array:
    """The JSON text of each element of ``arr``; null where ``arr`` is null."""
    arr = _plain(arr)
    t = arr.type
    if pa.types.is_null(t):
        return pa.nulls(len(arr), _LS)
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        return pc.cast(arr, _LS)
    if pa.types.is_floating(t):
        return _float_json(arr)
    if pa.types.is_decimal(t):
        return _quote(_decimal_text(arr))
    if _is_text(t):
        return _quoted_text(arr)
    if _is_binary(t):
        return _binary_json(arr)
    if pa.types.is_timestamp(t):
        return _where(arr, _timestamp_json(arr, path))
    if pa.types.is_date(t):
        return _where(arr, _date_json(arr, path))
    if pa.types.is_time(t):
        return _where(arr, _time_json(arr, path))
    if pa.types.is_duration(t):
        return _where(arr, _duration_json(arr, path))
    if _is_list(t):
        return _list_json(arr, path)
    if pa.types.is_map(t):
        return _map_json(arr, path)
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        return _where(arr, _object(names, arr.flatten(), len(arr), path))
    raise JSONEncodeError(_type_problem(t, path) or f"{path!r}: unsupported type {t}")


def json_values(batch: pa.RecordBatch) -> pa.Array:
    """Each row of ``batch`` as a UTF-8 JSON object (``{"col": value, ...}``), as a
    ``large_binary`` array; see the module docstring for the rules. Raises
    :class:`JSONEncodeError` for a value (or a type) the encoding refuses, before
    returning anything."""
    problem = _schema_problem(batch.schema)
    if problem:
        raise JSONEncodeError(f"cannot write rows as Kafka JSON values: {problem}")
    rows = _object(batch.schema.names, batch.columns, batch.num_rows, "")
    return pc.cast(rows, pa.large_binary())


def json_rows(batch: pa.RecordBatch) -> list[bytes]:
    """:func:`json_values` as a list of ``bytes``."""
    return json_values(batch).to_pylist()
