"""What a Delta table asks of the rows written to it, enforced as delta-spark does.

delta-spark's writer enforces a table's row rules; DeltaSink enforces the same
rules in each micro-batch's Spark plan, before anything is staged
(:meth:`RowRules.frame`):

* **Generated columns** (``GENERATED ALWAYS AS (expr)``): a column the
  DataFrame lacks is computed from its expression and cast to the column's
  type; a column the DataFrame has must equal it, null-safely
  (``col <=> (expr)``: delta-spark's own check).
* **CHECK constraints** (``delta.constraints.<name>``) and **column
  invariants** (``delta.invariants``, the legacy form): a row for which one is
  false *or null* fails its batch (delta-spark refuses such a row too, unlike
  the SQL standard), with the constraint's name, its expression and the row.
  A keyed sink's delete row (``delete_when``) writes no row and is not checked.
  Every other row of a keyed batch is, also one a later row of its key
  replaces within the batch (stricter than the rows that land: such a batch
  fails where delta-spark's MERGE of its winners would pass).

A violation fails the batch before it is recorded: nothing of it is
committed, the job stops with the constraint named, as delta-spark's write
would.

**Rules changed under staged rows.** Each committable records the
:attr:`RowRules.digest` its rows were checked against. The commit compares it
with the table's rules on the snapshot it commits on; when they differ (an
``ALTER TABLE ... ADD CONSTRAINT`` or a new generated column since the rows
were staged), the rows are not committed: :class:`~sinks.errors.TransactionLostError`,
and the restart writes them again from the source, checked against the rules
the table has then (recovery rule 5).

**Refused**: identity columns (``GENERATED ... AS IDENTITY``). Their values
come from a high-water mark in the table's metadata that each writer advances
in its commit; staged rows would need their values before the commit that
allots them, and a replay would allot new ones. Invariants and constraints on
nested fields are refused too (:meth:`RowRules.of` names them).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sinks.delta.layout import DeltaSchemaError, Layout, quoted

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import Column, DataFrame

CONSTRAINT_PREFIX = "delta.constraints."
GENERATION_KEY = "delta.generationExpression"
INVARIANTS_KEY = "delta.invariants"
IDENTITY_PREFIX = "delta.identity"


@dataclass(frozen=True)
class RowRules:
    """A table's CHECK constraints, column invariants and generated columns."""

    checks: tuple[tuple[str, str], ...] = ()
    """(name, SQL expression) of each CHECK constraint and column invariant"""
    generated: tuple[tuple[str, str], ...] = ()
    """(column, SQL expression) of each generated column"""

    @classmethod
    def of(cls, dt: DeltaTable, where: str) -> RowRules:
        """The rules of ``dt``'s snapshot; :class:`DeltaSchemaError` for the
        ones DeltaSink cannot honour (identity columns, nested invariants)."""
        config = dt.metadata().configuration or {}
        checks = [
            (k.removeprefix(CONSTRAINT_PREFIX), v)
            for k, v in sorted(config.items())
            if k.startswith(CONSTRAINT_PREFIX)
        ]
        generated = []
        for field in json.loads(dt.schema().to_json())["fields"]:
            meta = field.get("metadata") or {}
            name = field["name"]
            identity = sorted(k for k in meta if k.startswith(IDENTITY_PREFIX))
            if identity:
                raise DeltaSchemaError(
                    f"{where}: column {name!r} is an identity column ({identity[0]}); its "
                    "values come from a high-water mark each writer's commit advances, so "
                    "rows staged before their commit cannot hold them and a replay would "
                    "allot new ones: DeltaSink refuses such a table. Generate the ids in the "
                    "job (e.g. from the source's key or offset), or write to a table without "
                    "an identity column"
                )
            if GENERATION_KEY in meta:
                generated.append((name, str(meta[GENERATION_KEY])))
            if INVARIANTS_KEY in meta:
                checks.append((f"invariant on {name}", _invariant(meta[INVARIANTS_KEY])))
            nested = _nested_rules(field.get("type"))
            if nested:
                raise DeltaSchemaError(
                    f"{where}: column {name!r} has {nested} on a nested field, which "
                    "DeltaSink does not enforce; it refuses to write the table"
                )
        return cls(tuple(checks), tuple(generated))

    def __bool__(self) -> bool:
        return bool(self.checks or self.generated)

    @property
    def digest(self) -> str:
        """A short fingerprint of the rules ("" when there are none)."""
        if not self:
            return ""
        text = json.dumps([self.checks, self.generated])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def generated_columns(self) -> frozenset[str]:
        """The columns the sink computes when the DataFrame lacks them."""
        return frozenset(c for c, _ in self.generated)

    def frame(
        self,
        df: DataFrame,
        layout: Layout,
        where: str,
        is_delete: Column | None = None,
    ) -> DataFrame:
        """``df`` with the generated columns it lacks computed and a filter that
        fails the batch at the first row breaking a rule (``is_delete``: the
        rows a keyed sink deletes, which are not checked)."""
        if not self:
            return df
        from pyspark.sql import functions as F
        from pyspark.sql.pandas.types import from_arrow_type

        tests: list[tuple[str, Column]] = []
        for column, expr in self.generated:
            t = from_arrow_type(layout.schema.field(column).type, prefer_timestamp_ntz=True)
            computed = F.expr(expr).cast(t)
            if column in df.columns:
                test = F.col(quoted(column)).eqNullSafe(computed)
                tests.append((f"Generated Column ({column} <=> ({expr}))", test))
            else:
                df = df.withColumn(column, computed)
        tests += [(f"{name} ({expr})", F.expr(expr)) for name, expr in self.checks]
        if not tests:
            return df
        row = F.to_json(
            F.struct(*[F.col(quoted(c)) for c in df.columns]), {"ignoreNullFields": "false"}
        )
        first, *rest = tests
        verdict = functools.reduce(
            lambda acc, t: acc.when(~F.coalesce(t[1], F.lit(False)), _fail(where, t[0], row)),
            rest,
            F.when(~F.coalesce(first[1], F.lit(False)), _fail(where, first[0], row)),
        ).otherwise(F.lit(True))
        if is_delete is not None:
            verdict = F.when(is_delete, F.lit(True)).otherwise(verdict)
        return df.where(verdict)

    def check_staged(self, committables: Sequence[dict[str, Any]], where: str) -> None:
        """Refuse to commit rows checked against other rules than the table's now."""
        from sinks.errors import REWRITE_ADVICE, TransactionLostError

        stale = [c["txn"] for c in committables if c.get("checked", "") != self.digest]
        if stale:
            raise TransactionLostError(
                f"{where}: the table's CHECK constraints or generated columns changed since "
                f"the rows of {len(stale)} staged transaction(s) (e.g. {stale[0]}) were "
                "checked against them; they are not committed. " + REWRITE_ADVICE
            )


def _fail(where: str, what: str, row: Column) -> Column:
    from pyspark.sql import functions as F

    return F.raise_error(
        F.concat(
            F.lit(
                f"{where}: CHECK constraint {what} is violated (false or null) by a row; "
                "nothing of the batch is committed. The row: "
            ),
            row,
        )
    )


def _invariant(value: Any) -> str:
    """The SQL expression of a ``delta.invariants`` value
    (``{"expression": {"expression": "<sql>"}}``, JSON-encoded)."""
    parsed = json.loads(value) if isinstance(value, str) else value
    return str(parsed["expression"]["expression"])


def _nested_rules(dtype: Any) -> list[str]:
    """The rule keys found on fields nested in ``dtype`` (a Delta schema type)."""
    found: list[str] = []
    if isinstance(dtype, dict):
        for f in dtype.get("fields", ()):
            meta = f.get("metadata") or {}
            found += [k for k in meta if k in (INVARIANTS_KEY, GENERATION_KEY)]
            found += _nested_rules(f.get("type"))
        for k in ("elementType", "valueType", "keyType"):
            found += _nested_rules(dtype.get(k))
    return sorted(set(found))
