"""Column mapping (``delta.columnMapping.mode`` = ``name`` or ``id``): the names
and ids a column-mapped table's data files carry.

In such a table (delta-spark makes them to rename and drop columns) a
column's name in the schema is its *logical* name; its data files name it by
its ``delta.columnMapping.physicalName`` and carry its
``delta.columnMapping.id`` as the Parquet field id, at every level of nesting
(struct fields have their own). Readers resolve columns by physical name
(``name`` mode) or field id (``id`` mode), so a file with logical names reads
as nulls. The add action's ``partitionValues`` and ``stats`` are keyed by
physical names too.

DeltaSink writes both, whichever the mode: :attr:`ColumnMapping.schema`
is the table's layout in physical names with field ids (what files, stats and
partition values say), :meth:`ColumnMapping.to_stored` renames a batch of
table rows (logical names, table order) to it. Appends are honoured this way.
A keyed merge reads and writes such a table through delta-spark
(:mod:`sinks.delta.spark_rewrite`), a replace stages appends this way and
removes through delta-spark; ``schema_mode="merge"``, which adds columns (new
physical names and ids), is refused on such tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

MODE_KEY = "delta.columnMapping.mode"
PHYSICAL_KEY = "delta.columnMapping.physicalName"
ID_KEY = "delta.columnMapping.id"
FIELD_ID = b"PARQUET:field_id"


@dataclass(frozen=True)
class ColumnMapping:
    """A column-mapped table's physical schema."""

    mode: str
    schema: pa.Schema
    """the table's columns in table order, by physical name, with field ids"""
    names: tuple[tuple[str, str], ...]
    """(logical, physical) of each top-level column"""

    @classmethod
    def of(cls, schema_json: str, logical: pa.Schema, mode: str | None) -> ColumnMapping | None:
        """The mapping of a table whose Delta schema is ``schema_json`` and
        whose Arrow schema (logical names) is ``logical``; None without column
        mapping."""
        if mode in (None, "none"):
            return None
        fields = json.loads(schema_json)["fields"]
        stored = [_field(f, logical.field(f["name"])) for f in fields]
        names = tuple((f["name"], _physical(f)) for f in fields)
        return cls(str(mode), pa.schema(stored), names)

    def name(self, logical: str) -> str:
        """The physical name of a top-level column."""
        return dict(self.names)[logical]

    def to_stored(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` (table columns by logical name, any subset, table types) with
        physical names and field ids, nested levels included."""
        fields = [self.schema.field(self.name(n)) for n in batch.schema.names]
        arrays = [_renamed(a, f.type) for a, f in zip(batch.columns, fields, strict=True)]
        return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))


def _physical(f: dict[str, Any]) -> str:
    meta = f.get("metadata") or {}
    name = meta.get(PHYSICAL_KEY)
    if not name:
        raise ValueError(f"column {f['name']!r} of a column-mapped table has no {PHYSICAL_KEY}")
    return str(name)


def _field(f: dict[str, Any], logical: pa.Field) -> pa.Field:
    meta = f.get("metadata") or {}
    out = pa.field(_physical(f), _type(f["type"], logical.type), logical.nullable)
    if ID_KEY in meta:
        out = out.with_metadata({FIELD_ID: str(int(meta[ID_KEY])).encode()})
    return out


def _type(delta: Any, arrow: pa.DataType) -> pa.DataType:
    """``arrow`` with the physical names and ids of the Delta type ``delta``."""
    if not isinstance(delta, dict):
        return arrow
    kind = delta.get("type")
    if kind == "struct":
        by_name = {arrow.field(i).name: arrow.field(i) for i in range(arrow.num_fields)}
        return pa.struct([_field(f, by_name[f["name"]]) for f in delta["fields"]])
    if kind == "array":
        item = _type(delta["elementType"], arrow.value_type)
        return (pa.large_list if pa.types.is_large_list(arrow) else pa.list_)(
            arrow.value_field.with_type(item)
        )
    if kind == "map":
        key = _type(delta["keyType"], arrow.key_type)
        value = _type(delta["valueType"], arrow.item_type)
        return pa.map_(arrow.key_field.with_type(key), arrow.item_field.with_type(value))
    return arrow


def _renamed(arr: pa.Array, to: pa.DataType) -> pa.Array:
    """``arr`` as type ``to``, which differs from its type in field names and
    metadata only."""
    if arr.type == to and not _nested(to):
        return arr
    if arr.offset and (pa.types.is_map(to) or pa.types.is_list(to) or pa.types.is_large_list(to)):
        arr = pa.concat_arrays([arr])  # a copy from offset 0: Arrow rebuilds no sliced list
    mask = arr.is_null() if arr.null_count else None
    if pa.types.is_struct(to):
        children = [_renamed(arr.field(i), to.field(i).type) for i in range(to.num_fields)]
        return pa.StructArray.from_arrays(children, fields=list(to), mask=mask)
    if pa.types.is_map(to):
        return pa.MapArray.from_arrays(
            arr.offsets,
            _renamed(arr.keys, to.key_type),
            _renamed(arr.items, to.item_type),
            type=to,
            mask=mask,
        )
    if pa.types.is_list(to) or pa.types.is_large_list(to):
        cls = pa.LargeListArray if pa.types.is_large_list(to) else pa.ListArray
        return cls.from_arrays(arr.offsets, _renamed(arr.values, to.value_type), type=to, mask=mask)
    return arr


def _nested(t: pa.DataType) -> bool:
    return (
        pa.types.is_struct(t)
        or pa.types.is_map(t)
        or pa.types.is_list(t)
        or (pa.types.is_large_list(t))
    )
