"""Arrow <-> PostgreSQL type mapping for binary COPY.

Binary COPY carries no type information: the bytes of each field must be in
the exact binary format of the target column's type. So every Arrow column is
cast to a *wire type* chosen from the target column's PostgreSQL type before
``pgpq`` encodes it. The cast is checked (an int64 that does not fit an int4
column is an error, never a silent wrap), and so are the values the cast lets
through (:mod:`sinks.postgres.values`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pyarrow as pa

# PostgreSQL type (pg_type.typname) -> Arrow type whose pgpq binary encoding
# that column accepts. numeric is handled separately (precision follows the data).
_WIRE: dict[str, pa.DataType] = {
    "bool": pa.bool_(),
    "int2": pa.int16(),
    "int4": pa.int32(),
    "int8": pa.int64(),
    "float4": pa.float32(),
    "float8": pa.float64(),
    "text": pa.string(),
    "varchar": pa.string(),
    "bpchar": pa.string(),
    "bytea": pa.binary(),
    "date": pa.date32(),
    "timestamp": pa.timestamp("us"),
    "timestamptz": pa.timestamp("us", tz="UTC"),
}

SUPPORTED_PG_TYPES = sorted([*_WIRE, "numeric"])

MAX_DECIMAL_DIGITS = 38
"""Widest decimal the binary COPY encoder (pgpq) writes: Arrow decimal128."""

_INTS = ("int2", "int4", "int8")
_FLOATS = ("float4", "float8")
_TEXT = ("text", "varchar", "bpchar")


def _source_kind(t: pa.DataType) -> str | None:
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_decimal(t):
        return "decimal" if t.precision <= MAX_DECIMAL_DIGITS else None
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "binary"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_timestamp(t):
        return "timestamp"
    return None


def unsupported(source: pa.DataType) -> str | None:
    """Why this sink cannot write a column of Arrow type ``source`` to any
    PostgreSQL column; None when it can."""
    if _source_kind(source) is not None:
        return None
    if pa.types.is_nested(source):
        return (
            f"the DataFrame type {source} is nested (struct, array or map), which this sink "
            "does not write; flatten it or serialise it (e.g. to_json) into a text column"
        )
    if pa.types.is_decimal(source):
        return (
            f"the DataFrame type {source} has more than {MAX_DECIMAL_DIGITS} digits, which "
            "this sink's binary COPY encoder does not write; cast it to a decimal of at most "
            f"{MAX_DECIMAL_DIGITS} digits or to a string"
        )
    return f"the DataFrame type {source} is not supported by this sink"


# source kind -> PostgreSQL column types it may be written to
_COMPATIBLE: dict[str, tuple[str, ...]] = {
    "bool": ("bool",),
    "int": (*_INTS, *_FLOATS, "numeric"),
    "float": _FLOATS,
    "decimal": ("numeric", *_FLOATS),
    "string": _TEXT,
    "binary": ("bytea",),
    "date": ("date", "timestamp", "timestamptz"),
    "timestamp": ("timestamp", "timestamptz"),
}

# Arrow kind -> column type used when the sink creates the table itself
_DDL: dict[str, str] = {
    "bool": "boolean",
    "float": "double precision",
    "string": "text",
    "binary": "bytea",
    "date": "date",
}


@dataclass(frozen=True)
class PgColumn:
    """A column of the target table as the catalog describes it."""

    name: str
    typname: str  # pg_type.typname, e.g. "int8"
    formatted: str  # format_type(), e.g. "character varying(20)"
    not_null: bool
    has_default: bool


def incompatibility(source: pa.DataType, column: PgColumn) -> str | None:
    """Why a ``source`` Arrow column cannot be written to ``column``; None if it can."""
    kind = _source_kind(source)
    if kind is None:
        return unsupported(source)
    if column.typname not in SUPPORTED_PG_TYPES:
        return (
            f"the column type {column.formatted} is not supported by this sink "
            f"(supported: {', '.join(SUPPORTED_PG_TYPES)})"
        )
    if column.typname not in _COMPATIBLE[kind]:
        return f"the DataFrame has {source}, which cannot be written to {column.formatted}"
    return None


def wire_type(source: pa.DataType, column: PgColumn) -> pa.DataType:
    """The Arrow type ``source`` is cast to before binary encoding for ``column``."""
    if column.typname == "numeric":
        return _numeric_wire(source, column)
    return _WIRE[column.typname]


_NUMERIC_TYPMOD = re.compile(r"^numeric\((\d+),(-?\d+)\)$")


def _numeric_wire(source: pa.DataType, column: PgColumn) -> pa.DataType:
    """decimal128 (what pgpq encodes) of the source's digits; at the column's
    scale when that is smaller than the source's, so that the checked cast
    refuses a value PostgreSQL would round to the column's scale."""
    p, s = (source.precision, source.scale) if pa.types.is_decimal(source) else (38, 0)
    m = _NUMERIC_TYPMOD.match(column.formatted)
    if m is not None and int(m[2]) < s:
        scale = int(m[2])
        p, s = max(1, p - (s - scale)), scale
    return pa.decimal128(p, s)


def ddl_type(source: pa.DataType) -> str | None:
    """The PostgreSQL column type used when creating a table for ``source``;
    None when there is none (see :func:`unsupported`)."""
    kind = _source_kind(source)
    if kind is None:
        return None
    if kind == "int":
        # an unsigned type needs the next wider signed column (uint64: numeric)
        bits = source.bit_width * (2 if pa.types.is_unsigned_integer(source) else 1)
        return {8: "smallint", 16: "smallint", 32: "integer", 64: "bigint"}.get(bits, "numeric")
    if kind == "decimal":
        p, s = source.precision, source.scale
        # decimal(p, s) holds the values of numeric(p, s); PostgreSQL before 15 takes
        # no scale outside [0, p]: a negative one needs p - s integer digits
        return f"numeric({p - s},0)" if s < 0 else f"numeric({max(p, s)},{s})"
    if kind == "timestamp":
        # an instant (with a time zone), or a wall-clock time (without: TimestampNTZ)
        return "timestamptz" if source.tz else "timestamp"
    return _DDL[kind]
