"""The rules of every keyed write (upserts and deletes, in every sink).

A keyed write keeps, per key, the state a dictionary would hold after applying
every input row in order (batch, then ``order_by``): the last write of a key
wins, a delete removes the key, a delete of a missing key is no error. Decided
once here, for every sink that writes by key (:class:`KeyedWrite`):

* **A null in a key column is an error.** The row cannot be placed: PostgreSQL
  treats every null as a distinct key (each such row would be a new row, on
  every run) unless the index says ``NULLS NOT DISTINCT`` (then all nulls are
  one key); a merge matches no null; a Kafka delete without a key deletes
  nothing. Neither is what a keyed write means, so the task refuses the batch
  before it prepares (:class:`NullKeyError`): nothing of the batch is
  committed, and the job fails with the column named.
* **Two different rows of one key in one batch** are an error without
  ``order_by`` (:class:`DuplicateKeyError`): Spark does not keep the input's
  order across a shuffle, so "the last row" is not defined. Rows that are equal
  in every column are one row, and so are two deletes of one key (whatever else
  they hold: either leaves the key deleted); a delete and a write of one key
  differ.
* **With ``order_by``**, the row with the greatest value of that column wins
  within a batch. A null in it is an error (it cannot be ranked), and so is a
  tie at the greatest value between rows that differ. Across batches the later
  batch wins, whatever its ``order_by`` values.
* **Deletes** (``delete_when``): a row is a delete when its ``delete_when``
  column is true (a boolean column), or equals the given value (``("op",
  "D")``). A null there is an error: the row is neither a write nor a delete.
  The column tells the sink what to do; it is not written (a table does not
  need it; a Kafka delete is a tombstone, the key and no value). So in a Kafka
  changelog a write whose ``value`` column is null is an error
  (:class:`NullValueError`, naming the key), never a tombstone: only
  ``delete_when`` deletes.

Every keyed sink repartitions its input by the key, so one key is written by
one task per batch. Preflight logs a warning for every key or ``order_by``
column the DataFrame declares nullable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sinks.errors import ConfigError, DataError, PreflightError

log = logging.getLogger("sinks.keys")


class NullKeyError(DataError):
    """A row of a keyed write has a null in a key, ``order_by`` or
    ``delete_when`` column."""


class NullValueError(DataError):
    """A Kafka record with a key would have a null value, a tombstone, where it
    would delete the key: a write (not a delete) of a Kafka changelog, where the
    other sinks keep the row, or an event written to a compacted topic
    (``cleanup.policy`` with ``compact``). The message names the key."""


class DuplicateKeyError(DataError):
    """One batch holds different rows of one key and nothing says which wins
    (no ``order_by``, or a tie at its greatest value)."""


@dataclass(frozen=True)
class DeleteWhen:
    """Which rows of a keyed write are deletes: those whose ``column`` equals
    ``value`` (``True`` for a boolean column)."""

    column: str
    value: Any = True

    @classmethod
    def of(cls, sink: str, spec: object) -> DeleteWhen | None:
        """``None``, a boolean column's name, or ``(column, value)``."""
        if spec is None or isinstance(spec, DeleteWhen):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str):
            value = spec[1]
            if value is None or not isinstance(value, (str, int, float, bool)):
                raise ConfigError(
                    f"{sink}: delete_when=({spec[0]!r}, {value!r}): the value that marks a "
                    "delete must be a string, number or boolean"
                )
            return cls(spec[0], value)
        raise ConfigError(
            f"{sink}: delete_when={spec!r} is neither a boolean column's name (e.g. "
            "'deleted') nor a column and the value that marks a delete (e.g. ('op', 'D'))"
        )

    def settings(self) -> list[Any]:
        return [self.column, self.value]

    def check_schema(self, sink: str, schema: pa.Schema) -> None:
        if self.column not in schema.names:
            raise PreflightError(
                f"{sink}: delete_when column {self.column!r} is not a column of the DataFrame "
                f"(its columns: {', '.join(schema.names)})"
            )
        t = schema.field(self.column).type
        if self.value is True and not pa.types.is_boolean(t):
            raise PreflightError(
                f"{sink}: delete_when={self.column!r} names a column of type {t}, not boolean; "
                f"pass the value that marks a delete too, e.g. delete_when=({self.column!r}, 'D')"
            )
        try:
            pa.scalar(self.value).cast(t)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise PreflightError(
                f"{sink}: delete_when value {self.value!r} cannot be compared with column "
                f"{self.column!r} of type {t}: {e}"
            ) from e

    def mask(self, column: pa.Array) -> pa.BooleanArray:
        """Which rows are deletes (``column`` holds no null)."""
        if self.value is True:
            return column
        return pc.equal(column, pa.scalar(self.value).cast(column.type))


@dataclass(frozen=True)
class KeyedWrite:
    """The keyed-write options of one sink, and the checks every sink runs."""

    sink: str
    """the sink's description, for messages"""
    key: tuple[str, ...]
    order_by: str | None = None
    delete_when: DeleteWhen | None = None

    @classmethod
    def of(
        cls, sink: str, key: Sequence[str] | None, order_by: str | None, delete_when: object
    ) -> KeyedWrite:
        """Check the options together: ``order_by`` and ``delete_when`` need a
        key and name other columns."""
        rules = cls(sink, tuple(key or ()), order_by, DeleteWhen.of(sink, delete_when))
        rules._check_config()
        return rules

    @property
    def keyed(self) -> bool:
        return bool(self.key)

    def _check_config(self) -> None:
        sink, key, order_by = self.sink, self.key, self.order_by
        if order_by is not None:
            if not key:
                raise ConfigError(
                    f"{sink}: order_by={order_by!r} needs key=[...] (it orders an upsert)"
                )
            if order_by in key:
                raise ConfigError(
                    f"{sink}: order_by={order_by!r} is a key column; rows of one key all hold "
                    "the same value there, so it cannot order them. Name another column"
                )
        d = self.delete_when
        if d is not None:
            if not key:
                raise ConfigError(
                    f"{sink}: delete_when={d.column!r} needs key=[...] (a delete removes a key)"
                )
            if d.column in key or d.column == order_by:
                raise ConfigError(
                    f"{sink}: delete_when column {d.column!r} is also a key or the order_by "
                    "column; it must be a column of its own"
                )

    def sort_columns(self) -> list[str]:
        """The order a task's input must come in for :mod:`sinks.last_write`."""
        return [*self.key, *([self.order_by] if self.order_by else [])]

    def written(self, schema: pa.Schema) -> pa.Schema:
        """``schema`` without the ``delete_when`` column (it is not written)."""
        if self.delete_when is None:
            return schema
        return schema.remove(schema.get_field_index(self.delete_when.column))

    def preflight(self, schema: pa.Schema) -> None:
        """Check the columns exist and warn about nullable ones."""
        wanted = self.sort_columns()
        missing = [c for c in wanted if c not in schema.names]
        if missing:
            role = "key" if missing[0] in self.key else "order_by"
            raise PreflightError(
                f"{self.sink}: {role} column {missing[0]!r} is not a column of the DataFrame "
                f"(its columns: {', '.join(schema.names)})"
            )
        if self.delete_when is not None:
            self.delete_when.check_schema(self.sink, schema)
        for name in wanted:
            if schema.field(name).nullable:
                role = "key" if name in self.key else "order_by"
                log.warning(
                    "%s: %s column %r is nullable in the DataFrame; a row with a null there "
                    "fails its batch (NullKeyError) and is never written. Filter or fill such "
                    "rows before the sink if they can occur",
                    self.sink,
                    role,
                    name,
                )

    def check_nulls(self, batch: pa.RecordBatch, batch_id: int) -> None:
        """Raise :class:`NullKeyError` if a key, ``order_by`` or ``delete_when``
        column of ``batch`` holds a null."""
        d = self.delete_when
        for name in [*self.sort_columns(), *([d.column] if d else [])]:
            nulls = batch.column(name).null_count
            if not nulls:
                continue
            if name in self.key:
                role, what = (
                    "key",
                    "a keyed write cannot place such a row (PostgreSQL would take every null "
                    "for a new key, or all nulls for one)",
                )
            elif name == self.order_by:
                role, what = (
                    "order_by",
                    "such a row cannot be ranked against the other rows of its key",
                )
            else:
                role, what = "delete_when", "such a row is neither a write nor a delete"
            raise NullKeyError(
                f"{self.sink}: {nulls} row(s) of batch {batch_id} have a null in {role} column "
                f"{name!r}: {what}. Nothing of the batch was committed; filter or fill those "
                f"rows before the sink (e.g. df.where(col('{name}').isNotNull()))"
            )

    def deletes(self, batch: pa.RecordBatch) -> pa.BooleanArray | None:
        """Which rows of ``batch`` are deletes (after :meth:`check_nulls`);
        ``None`` without ``delete_when``."""
        if self.delete_when is None:
            return None
        return self.delete_when.mask(batch.column(self.delete_when.column))

    def duplicate_error(self, values: Sequence[object], batch_id: int) -> DuplicateKeyError:
        """The error for different rows of the key ``values`` in one batch."""
        shown = ", ".join(f"{k}={v!r}" for k, v in zip(self.key, values, strict=True))
        if self.order_by is None:
            why = (
                "and nothing says which one wins (Spark does not keep the input order across "
                "its shuffle). Pass order_by='<column>' (the greatest value wins), or remove "
                "the duplicates before the sink"
            )
        else:
            why = (
                f"tied at their greatest {self.order_by!r}, so neither wins. Make "
                f"{self.order_by!r} unique per key, or remove the duplicates before the sink"
            )
        return DuplicateKeyError(
            f"{self.sink}: batch {batch_id} holds different rows of the key ({shown}), {why}. "
            "Nothing of the batch was committed"
        )
