"""A partition replace in Delta (``DeltaSink(replace_where=...)``), as delta-spark's
``replaceWhere`` over partition columns, exactly once.

The pipeline is deferred (``Sink.commits_at_finish``): its batches stage files
as appends do, and they stay staged, across restarts, until the checkpoint that
finishes the pipeline. That commit is one Delta version: it removes every file
of the snapshot whose partition values match the predicate and adds every
staged file, with the app transaction of the highest batch (a retried commit is
recognised and skipped). The predicate is Spark SQL over partition columns,
checked at preflight; each batch checks its rows against it before staging
anything (:func:`check_rows`), so a row outside the slice fails the backfill
with nothing committed. Both evaluate it on values as Delta stores them: an
empty string in a partition column is null, so ``region = ''`` matches no row
(say ``region IS NULL``), and a batch row the commit would not find again is
refused instead of piling up on every re-run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.transaction import RemoveAction

from sinks.delta import merge_plan, merge_rewrite
from sinks.delta.layout import DeltaSchemaError, Layout, quoted
from sinks.delta.merge_plan import Candidate
from sinks.errors import DataError
from sinks.predicates import changes_between_evaluations, time_words

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


class ReplaceError(DataError):
    """A row of a replacing pipeline does not match its ``replace_where``."""


def _spark() -> Any:
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()


def _partition_schema(layout: Layout) -> Any:
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import StringType, StructField, StructType

    fields = [StructField("path", StringType(), False)]
    for c in layout.partition_by:
        t = from_arrow_type(layout.schema.field(c).type, prefer_timestamp_ntz=True)
        fields.append(StructField(c, t, True))
    return StructType(fields)


def check_predicate(predicate: str, layout: Layout, where: str) -> None:
    """Refuse a predicate that names anything but partition columns."""
    from pyspark.errors import AnalysisException, ParseException
    from pyspark.sql import functions as F

    if not layout.partition_by:
        raise DeltaSchemaError(
            f"{where} has no partition columns: replace_where replaces partitions, so the "
            "table must be partitioned (partition_by=...)"
        )
    empty = _spark().createDataFrame([], _partition_schema(layout)).drop("path")
    try:
        filtered = empty.where(F.expr(predicate))
        filtered.schema  # noqa: B018  (analysis only)
    except (AnalysisException, ParseException) as e:
        first = str(e).strip().splitlines()[0]
        raise DeltaSchemaError(
            f"{where}: replace_where {predicate!r} must be a Spark SQL predicate over the "
            f"partition columns {list(layout.partition_by)} only ({first})"
        ) from e
    condition = filtered._jdf.queryExecution().analyzed().condition()
    varying = _varying(condition) + time_words(predicate)
    if varying:
        raise DeltaSchemaError(changes_between_evaluations(", ".join(varying), predicate, where))
    if _has_empty_string(condition):
        raise DeltaSchemaError(
            f"{where}: replace_where {predicate!r} compares with '', which no partition of "
            "a Delta table holds: Delta stores an empty string in a partition column as null "
            "(as the sink's batches are stored). Say IS NULL for that slice"
        )


_CURRENT_TIME = frozenset(
    {"CurrentDate", "CurrentTimestamp", "Now", "LocalTimestamp", "CurrentTime"}
)
"""Spark's expressions of the current time: deterministic within one query (Spark
fixes them when it plans it), different in the next"""


def _nodes(condition: Any) -> list[Any]:
    """Every expression of an analyzed Spark condition (a JVM object)."""
    found, stack = [], [condition]
    while stack:
        e = stack.pop()
        found.append(e)
        stack.extend(e.children().apply(i) for i in range(e.children().size()))
    return found


def _varying(condition: Any) -> list[str]:
    """The expressions of an analyzed Spark condition that may give another value
    when it is evaluated again: the current time, the innermost non-deterministic
    ones (``rand()``, ``uuid()``), and subqueries (of tables that change; Spark
    calls them deterministic and keeps their plans out of ``children``)."""
    found: set[str] = set()
    for e in _nodes(condition):
        kids = [e.children().apply(i) for i in range(e.children().size())]
        source = not e.deterministic() and all(k.deterministic() for k in kids)
        name = str(e.getClass().getSimpleName())
        if source or name in _CURRENT_TIME:
            found.add(f"{e.prettyName()}()")
        elif "Subquery" in name or name in ("Exists", "ListQuery"):
            found.add("a subquery")
    return sorted(found)


def _has_empty_string(condition: Any) -> bool:
    """Whether the condition holds the string literal ''."""
    return any(
        str(e.getClass().getSimpleName()) == "Literal"
        and str(e.dataType().typeName()) == "string"
        and e.value() is not None
        and str(e.value().toString()) == ""
        for e in _nodes(condition)
    )


def check_rows(df: DataFrame, predicate: str, layout: Layout, where: str, batch_id: int) -> None:
    """Raise :class:`ReplaceError` when a row of the batch is outside the slice.

    The predicate is evaluated on the rows as they will be stored (an empty
    partition value is null), as the commit evaluates it on the table's
    partition values: a row the slice would not remove again is refused."""
    from pyspark.sql import functions as F

    parts = list(layout.partition_by)
    raw = [f"_twophase_raw{i}" for i in range(len(parts))]
    with_raw = df.select("*", *[F.col(quoted(c)).alias(r) for c, r in zip(parts, raw, strict=True)])
    outside = (
        merge_rewrite.as_stored(with_raw, layout)
        .where(~F.coalesce(F.expr(predicate), F.lit(False)))
        .limit(1)
        .collect()
    )
    if outside:
        row = outside[0].asDict()
        empty = [c for c, r in zip(parts, raw, strict=True) if row.pop(r) == ""]
        hint = (
            " (Delta stores an empty string in a partition column as null: "
            f"{', '.join(empty)} is null here; say `{empty[0]} IS NULL` to replace that slice)"
            if empty
            else ""
        )
        raise ReplaceError(
            f"{where}: batch {batch_id} holds a row that does not match replace_where "
            f"{predicate!r} (e.g. {row}){hint}: a replace writes only inside the slice it "
            "replaces. Nothing of the backfill was committed; filter the rows, or widen the "
            "predicate"
        )


def removes(dt: DeltaTable, layout: Layout, predicate: str) -> list[RemoveAction]:
    """The remove actions of every file of ``dt``'s snapshot in the slice."""
    from pyspark.sql import functions as F

    actions = pa.table(dt.get_add_actions(flatten=True))
    if actions.num_rows == 0:
        return []
    rows = actions.to_pylist()
    parts = layout.partition_by
    data = [(str(a["path"]), *(a.get(f"partition.{c}") for c in parts)) for a in rows]
    spark = _spark()
    matched = {
        r[0]
        for r in spark.createDataFrame(data, _partition_schema(layout))
        .where(F.expr(predicate))
        .select("path")
        .collect()
    }
    return merge_plan.removes([Candidate.of(a, parts) for a in rows if str(a["path"]) in matched])
