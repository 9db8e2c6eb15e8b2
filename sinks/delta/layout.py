"""How the Delta sink maps Arrow data onto a Delta table: types, schemas, partitions.

* :func:`delta_arrow_type` turns an input (Spark / Arrow) type into the Arrow type
  of the Delta column it becomes, refusing types Delta cannot store faithfully
  (unsigned integers, time of day, ...). Timestamps become microseconds, as Delta
  and Spark store them: with a time zone -> Delta ``timestamp`` (UTC instants),
  without -> ``timestamp_ntz``.
* :func:`incompatibility` says why input of one type cannot be written to a
  column of another (``None`` when it can: equal types or a lossless widening).
* :class:`Layout` is what executors need to write files the table accepts: the
  table's columns, which of them partition it, and the Arrow schema of its
  Parquet data files (partition columns are not stored in data files).
* :func:`partition_path` and :func:`partition_value` encode partition values
  the way Delta and Hive do (``col=value/`` directories, escaped like Spark does).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sinks.delta.column_mapping import ColumnMapping
from sinks.errors import ConfigError

NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"

# Characters Spark/Hive escape in partition directory names (%XX, upper-case hex).
_ESCAPED = frozenset("\"#%'*/:=?\\{[]^\x7f") | frozenset(chr(c) for c in range(0x20))


class DeltaSchemaError(ConfigError):
    """Data does not fit the Delta table's schema or partitioning; the message names
    the column (and the staged file, at commit) and what differs."""


def _unsupported(where: str, t: pa.DataType, why: str) -> DeltaSchemaError:
    return DeltaSchemaError(f"column {where}: Arrow type {t} cannot be written to Delta ({why})")


def check_names(names: Sequence[str], where: str) -> None:
    """Refuse column or struct field names Delta cannot hold side by side: names
    equal but for case (Delta resolves names case-insensitively) or holding NUL."""
    seen: dict[str, str] = {}
    for name in names:
        if "\0" in name:
            raise DeltaSchemaError(f"{where}: name {name!r} holds NUL (\\x00), which Delta refuses")
        other = seen.setdefault(name.lower(), name)
        if other is not name:
            raise DeltaSchemaError(
                f"{where}: {other!r} and {name!r} differ only in case (or are equal), but "
                "Delta column names are case-insensitive; rename one of them"
            )


def delta_arrow_type(t: pa.DataType, where: str = "?") -> pa.DataType:
    """The Arrow type of the Delta column that input of type ``t`` becomes."""
    if pa.types.is_dictionary(t):
        return delta_arrow_type(t.value_type, where)
    if pa.types.is_boolean(t) or pa.types.is_signed_integer(t):
        return t
    if pa.types.is_floating(t):
        if t.bit_width == 16:
            raise _unsupported(where, t, "Delta has no half-precision floats; cast to float")
        return t
    if pa.types.is_unsigned_integer(t):
        raise _unsupported(where, t, "Delta has no unsigned integers; cast to a wider signed type")
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        return pa.binary()
    if pa.types.is_date(t):
        return pa.date32()
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz="UTC" if t.tz else None)
    if pa.types.is_decimal(t):
        # Delta's scale is in [0, precision]: a negative scale s (whole multiples
        # of 10**-s) becomes scale 0 with -s more digits, a scale above the
        # precision (values below 10**(p-s)) precision s; both exactly
        p, s = max(t.precision - min(t.scale, 0), t.scale), max(t.scale, 0)
        if p > 38:
            raise _unsupported(where, t, "Delta decimals have at most 38 digits")
        return pa.decimal128(p, s)
    if pa.types.is_struct(t):
        if t.num_fields == 0:
            raise _unsupported(where, t, "a struct without fields cannot be stored in Parquet")
        check_names([f.name for f in t], f"the fields of struct column {where}")
        return pa.struct(
            [pa.field(f.name, delta_arrow_type(f.type, f"{where}.{f.name}"), f.nullable) for f in t]
        )
    if (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
    ):
        item = t.value_field
        return pa.list_(
            pa.field("element", delta_arrow_type(item.type, f"{where}[]"), item.nullable)
        )
    if pa.types.is_map(t):
        return pa.map_(
            pa.field("key", delta_arrow_type(t.key_type, f"{where}.key"), False),
            pa.field(
                "value", delta_arrow_type(t.item_type, f"{where}.value"), t.item_field.nullable
            ),
        )
    raise _unsupported(where, t, "no Delta type stores it")


def delta_type_name(t: pa.DataType) -> str:
    """The Delta (Spark SQL) name of Arrow type ``t``, for messages."""
    simple = {
        pa.bool_(): "boolean",
        pa.int8(): "byte",
        pa.int16(): "short",
        pa.int32(): "integer",
        pa.int64(): "long",
        pa.float32(): "float",
        pa.float64(): "double",
        pa.date32(): "date",
    }
    if t in simple:
        return simple[t]
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return "binary"
    if pa.types.is_timestamp(t):
        return ("timestamp" if t.tz else "timestamp_ntz") + (
            "" if t.unit == "us" else f"[{t.unit}]"
        )
    if pa.types.is_decimal(t):
        return f"decimal({t.precision},{t.scale})"
    if pa.types.is_struct(t):
        return "struct<" + ",".join(f"{f.name}:{delta_type_name(f.type)}" for f in t) + ">"
    if pa.types.is_map(t):
        return f"map<{delta_type_name(t.key_type)},{delta_type_name(t.item_type)}>"
    if hasattr(t, "value_type") and not pa.types.is_dictionary(t):
        return f"array<{delta_type_name(t.value_type)}>"
    return str(t)


def _widens(src: pa.DataType, dst: pa.DataType) -> bool:
    """True when every value of ``src`` is exactly representable in ``dst``."""
    if pa.types.is_signed_integer(src) and pa.types.is_signed_integer(dst):
        return src.bit_width <= dst.bit_width
    if pa.types.is_floating(src) and pa.types.is_floating(dst):
        return src.bit_width <= dst.bit_width
    if pa.types.is_decimal(src) and pa.types.is_decimal(dst):
        return src.scale == dst.scale and src.precision <= dst.precision
    return False


def incompatibility(src: pa.DataType, dst: pa.DataType, *, exact: bool = False) -> str | None:
    """Why values of type ``src`` cannot go into a Delta column of type ``dst``.

    Both are compared in their Delta form (:func:`delta_arrow_type`). Lossless
    widenings (int -> long, float -> double, decimal(p,s) -> decimal(p+k,s)) are
    accepted unless ``exact``. Nested fields must match by name and order; a
    nullable nested field cannot go into a NOT NULL one. Returns ``None`` when
    compatible."""
    try:
        s = delta_arrow_type(src)
        d = delta_arrow_type(dst)
    except DeltaSchemaError as e:
        return str(e)
    if s == d or (not exact and _widens(s, d)):
        return None
    if pa.types.is_struct(s) and pa.types.is_struct(d):
        if [f.name for f in s] != [f.name for f in d]:
            return (
                f"struct fields {[f.name for f in s]} do not match {[f.name for f in d]} "
                "(same names in the same order needed)"
            )
        for fs, fd in zip(s, d, strict=True):
            why = _field_incompatibility(fs, fd, exact)
            if why:
                return f"field {fs.name!r}: {why}"
        return None
    if pa.types.is_list(s) and pa.types.is_list(d):
        why = _field_incompatibility(s.value_field, d.value_field, exact)
        return f"array element: {why}" if why else None
    if pa.types.is_map(s) and pa.types.is_map(d):
        why = _field_incompatibility(s.key_field, d.key_field, exact) or _field_incompatibility(
            s.item_field, d.item_field, exact
        )
        return f"map: {why}" if why else None
    return f"{delta_type_name(s)} does not fit {delta_type_name(d)}"


def _field_incompatibility(s: pa.Field, d: pa.Field, exact: bool) -> str | None:
    if s.nullable and not d.nullable:
        return "nullable values cannot go into a NOT NULL field"
    return incompatibility(s.type, d.type, exact=exact)


# -- partitions ---------------------------------------------------------------------

PARTITION_TYPES = "string, byte, short, integer, long, boolean or date"


def is_partition_type(t: pa.DataType) -> bool:
    """Whether the sink can partition by a column of Delta type ``t``."""
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_signed_integer(t)
        or pa.types.is_boolean(t)
        or pa.types.is_date32(t)
    )


def partition_value(value: Any) -> str | None:
    """Serialise one partition value as Delta's ``partitionValues`` does.

    ``None`` is null. An empty string is stored as null too, as Spark does (Hive
    directories cannot hold an empty name)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, str):
        return value or None
    raise TypeError(f"unsupported partition value {value!r}")


def empty_as_null(arr: pa.Array) -> pa.Array:
    """A partition column's values as Delta stores them: an empty string is
    null (:func:`partition_value`), so that a key written with ``""`` matches the
    row an append or an earlier merge stored, and a NOT NULL partition column
    refuses it on every route."""
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        return arr
    return pc.if_else(pc.equal(arr, ""), pa.scalar(None, arr.type), arr)


def quoted(name: str) -> str:
    """A column name quoted for a Spark SQL expression (backticks)."""
    return "`" + name.replace("`", "``") + "`"


def escape_path_part(text: str) -> str:
    """Escape ``text`` for a Hive-style directory name, as Spark does."""
    return "".join(f"%{ord(c):02X}" if c in _ESCAPED else c for c in text)


def partition_path(columns: Sequence[str], values: Sequence[str | None]) -> str:
    """The relative directory of a partition, e.g. ``day=2024-01-01/kind=a%3Ab/``."""
    return "".join(
        f"{escape_path_part(c)}={NULL_PARTITION if v is None else escape_path_part(v)}/"
        for c, v in zip(columns, values, strict=True)
    )


# -- layout ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The table's columns (Delta form, table order) and partition columns."""

    schema: pa.Schema
    partition_by: tuple[str, ...]
    checked: str = ""
    """the digest of the table's row rules the writers' rows are checked
    against (:attr:`sinks.delta.constraints.RowRules.digest`; "" for none),
    recorded in each committable so that the commit can tell they still hold"""
    mapping: ColumnMapping | None = None
    """the table's column mapping (:mod:`sinks.delta.column_mapping`), if any"""

    @property
    def stored(self) -> Layout:
        """The layout as data files, stats and partition values name it: with
        column mapping, physical names and field ids; else this layout."""
        m = self.mapping
        if m is None:
            return self
        return Layout(m.schema, tuple(m.name(c) for c in self.partition_by), self.checked)

    def stamp(self) -> dict[str, str]:
        """What a committable records of the rules its rows were checked against."""
        return {"checked": self.checked} if self.checked else {}

    @property
    def file_schema(self) -> pa.Schema:
        """Arrow schema of the table's Parquet data files (no partition columns)."""
        return pa.schema([f for f in self.schema if f.name not in self.partition_by])

    @classmethod
    def of(cls, schema: pa.Schema, partition_by: Sequence[str]) -> Layout:
        """Build a layout from a table schema, normalising types to their Delta form."""
        check_names(schema.names, "the column names")
        fields = [pa.field(f.name, delta_arrow_type(f.type, f.name), f.nullable) for f in schema]
        return cls(pa.schema(fields), tuple(partition_by))

    def check_partitioning(self, where: str) -> None:
        """Refuse partition columns this sink cannot encode."""
        for c in self.partition_by:
            t = self.schema.field(c).type
            if not is_partition_type(t):
                raise DeltaSchemaError(
                    f"{where}: partition column {c!r} is {delta_type_name(t)}; DeltaSink "
                    f"partitions by {PARTITION_TYPES} columns only"
                )

    def check_input(
        self,
        schema: pa.Schema,
        where: str,
        *,
        merge: bool = False,
        derived: frozenset[str] = frozenset(),
    ) -> list[pa.Field]:
        """Refuse input of ``schema`` unless every column fits the table's column of
        the same name and the column sets are equal (order may differ), but for
        ``derived`` columns, which the input may lack (generated columns the sink
        computes). With ``merge`` (``schema_mode="merge"``), columns the table
        lacks are allowed: returned, as the nullable Delta columns to add."""
        have = {f.name for f in schema}
        want = set(self.schema.names)
        missing = [n for n in self.schema.names if n not in have and n not in derived]
        extra = [n for n in schema.names if n not in want]
        if missing or (extra and not merge):
            lower = {n.lower(): n for n in self.schema.names}
            hints = [
                f"{n!r} vs the table's {lower[n.lower()]!r}" for n in extra if n.lower() in lower
            ]
            raise DeltaSchemaError(
                f"{where}: the DataFrame's columns do not match the table's"
                + (f"; missing from the DataFrame: {missing}" if missing else "")
                + (f"; not in the table: {extra}" if extra else "")
                + (f" (column names are case-sensitive here: {', '.join(hints)})" if hints else "")
                + ("" if merge or not extra else "; schema_mode='merge' adds new columns")
            )
        for f in schema:
            if f.name not in want:
                continue
            target = self.schema.field(f.name)
            why = incompatibility(f.type, target.type)
            if why:
                advice = (
                    f"; schema_mode='merge' adds columns but never changes a column's type: "
                    f"cast {f.name!r} to {delta_type_name(target.type)} in the DataFrame, or "
                    "rewrite the table with the new type"
                    if merge
                    else ""
                )
                raise DeltaSchemaError(
                    f"{where}: column {f.name!r} is {delta_type_name(f.type)} in the DataFrame "
                    f"but {delta_type_name(target.type)} in the Delta table ({why}){advice}"
                )
        check_names([*self.schema.names, *extra], "the table's and the new column names")
        return [pa.field(n, delta_arrow_type(schema.field(n).type, n), True) for n in extra]


# -- data files -------------------------------------------------------------------


def check_file_schema(meta: pq.FileMetaData, layout: Layout, what: str) -> None:
    """Compare a staged file's Parquet schema with the table's data-file schema:
    the same columns (a nullable table column the file lacks reads as null) of
    exactly the table's types, no partition columns, no nulls in NOT NULL ones."""
    actual = meta.schema.to_arrow_schema()
    expected = layout.file_schema
    for f in actual:
        if f.name in layout.partition_by:
            raise DeltaSchemaError(
                f"{what} holds partition column {f.name!r} (Delta data files must not); "
                "nothing was committed"
            )
        if f.name not in expected.names:
            raise DeltaSchemaError(
                f"{what} has column {f.name!r}, which the table does not have; nothing was "
                "committed"
            )
    for f in expected:
        idx = actual.get_field_index(f.name)
        if idx < 0 and f.nullable:
            continue  # a column added to the table later: Delta reads it as null
        if idx < 0:
            raise DeltaSchemaError(
                f"{what} lacks column {f.name!r} of the table; nothing was committed"
            )
        have = actual.field(idx)
        why = incompatibility(have.type, f.type, exact=True)
        if why:
            raise DeltaSchemaError(
                f"{what}: column {f.name!r} is {delta_type_name(have.type)} in the file but "
                f"{delta_type_name(f.type)} in the table ({why}); nothing was committed"
            )
        if not f.nullable and have.nullable and _nulls(meta, f.name) != 0:
            raise DeltaSchemaError(
                f"{what}: column {f.name!r} is NOT NULL in the table but the file may hold "
                "nulls; nothing was committed"
            )


def _nulls(meta: pq.FileMetaData, name: str) -> int | None:
    """Nulls in the top-level primitive column ``name`` per the footer's
    statistics; ``None`` when unknown (nested column, no statistics)."""
    leaf = next((j for j in range(meta.num_columns) if meta.schema.column(j).path == name), None)
    if leaf is None:
        return None
    total = 0
    for rg in range(meta.num_row_groups):
        st = meta.row_group(rg).column(leaf).statistics
        if st is None or not st.has_null_count:
            return None
        total += st.null_count
    return total
