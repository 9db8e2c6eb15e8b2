"""The rules of every keyed write (upsert; later deletes and keyed Delta writes).

Decided once here, for every sink that writes by key:

* **A null in a key column is an error.** The row cannot be placed: PostgreSQL
  treats every null as a distinct key (each such row would be a new row, on
  every run) unless the index says ``NULLS NOT DISTINCT`` (then all nulls are
  one key); a Delta merge matches no null. Neither is what an upsert means, so
  the task refuses the batch before it prepares (:class:`NullKeyError`): nothing
  of the batch is committed, and the job fails with the column named.
* **Two different rows of one key in one batch** are an error without
  ``order_by`` (:class:`DuplicateKeyError`): Spark does not keep the input's
  order across a shuffle, so "the last row" is not defined. Rows that are equal
  in every column are one row.
* **With ``order_by``**, the row with the greatest value of that column wins
  within a batch. A null in it is an error (it cannot be ranked), and so is a
  tie at the greatest value between rows that differ. Across batches the later
  batch wins, whatever its ``order_by`` values.

Preflight logs a warning for every key or ``order_by`` column the DataFrame
declares nullable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pyarrow as pa

from sinks.errors import ConfigError, DataError, PreflightError

log = logging.getLogger("sinks.keys")


class NullKeyError(DataError):
    """A row of a keyed write has a null in a key or ``order_by`` column."""


class DuplicateKeyError(DataError):
    """One batch holds different rows of one key and nothing says which wins
    (no ``order_by``, or a tie at its greatest value)."""


def check_config(sink: str, key: Sequence[str], order_by: str | None) -> None:
    """Refuse an ``order_by`` without a key, or one that is a key column."""
    if order_by is None:
        return
    if not key:
        raise ConfigError(f"{sink}: order_by={order_by!r} needs key=[...] (it orders an upsert)")
    if order_by in key:
        raise ConfigError(
            f"{sink}: order_by={order_by!r} is a key column; rows of one key all hold the "
            "same value there, so it cannot order them. Name another column"
        )


def preflight(sink: str, schema: pa.Schema, key: Sequence[str], order_by: str | None) -> None:
    """Check the columns exist and warn about nullable ones."""
    wanted = [*key, *([order_by] if order_by else [])]
    missing = [c for c in wanted if c not in schema.names]
    if missing:
        raise PreflightError(
            f"{sink}: {'key' if missing[0] in key else 'order_by'} column {missing[0]!r} is not "
            f"a column of the DataFrame (its columns: {', '.join(schema.names)})"
        )
    for name in wanted:
        if schema.field(name).nullable:
            role = "key" if name in key else "order_by"
            log.warning(
                "%s: %s column %r is nullable in the DataFrame; a row with a null there fails "
                "its batch (NullKeyError) and is never written. Filter or fill such rows "
                "before the sink if they can occur",
                sink,
                role,
                name,
            )


def check_nulls(
    sink: str, batch: pa.RecordBatch, key: Sequence[str], order_by: str | None, batch_id: int
) -> None:
    """Raise :class:`NullKeyError` if a key or ``order_by`` column of
    ``batch`` holds a null."""
    for name in [*key, *([order_by] if order_by else [])]:
        nulls = batch.column(name).null_count
        if nulls:
            role = "key" if name in key else "order_by"
            what = (
                "a keyed write cannot place such a row (PostgreSQL would take every null for a "
                "new key, or all nulls for one)"
                if role == "key"
                else "such a row cannot be ranked against the other rows of its key"
            )
            raise NullKeyError(
                f"{sink}: {nulls} row(s) of batch {batch_id} have a null in {role} column "
                f"{name!r}: {what}. Nothing of the batch was committed; filter or fill those "
                f"rows before the sink (e.g. df.where(col('{name}').isNotNull()))"
            )


def duplicate_error(
    sink: str, key: Sequence[str], values: Sequence[object], batch_id: int, order_by: str | None
) -> DuplicateKeyError:
    """The error for different rows of one key in one batch."""
    shown = ", ".join(f"{k}={v!r}" for k, v in zip(key, values, strict=True))
    if order_by is None:
        why = (
            "and nothing says which one wins (Spark does not keep the input order across "
            "its shuffle). Pass order_by='<column>' (the greatest value wins), or remove "
            "the duplicates before the sink"
        )
    else:
        why = (
            f"tied at their greatest {order_by!r}, so neither wins. Make {order_by!r} "
            "unique per key, or remove the duplicates before the sink"
        )
    return DuplicateKeyError(
        f"{sink}: batch {batch_id} holds different rows of the key ({shown}), {why}. "
        "Nothing of the batch was committed"
    )
