"""The rewrite of a keyed Delta merge: one Spark job applies the changes to the planned files.

It reads the change files, keeping the last batch's row of each key
(:func:`winning_changes`), and the candidate files of the plan
(:mod:`sinks.delta.merge_plan`) with their partition values; keeps the
candidates' rows whose key is not changed, adds the rows the changes write,
and hands the result to a stager (:func:`rewrite`), which writes it with
Spark's Parquet writer (:class:`~sinks.delta.spark_stage.SparkStage`). The
commit of what it staged is :mod:`sinks.delta.merge`'s. On an object store
the files are read, and the result staged, by the tasks themselves through the
sink's store (:mod:`sinks.delta.task_io`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from sinks.base import Committable
from sinks.delta.changes import DELETE_COLUMN, change_schema
from sinks.delta.layout import Layout, quoted
from sinks.delta.merge_plan import Candidate, Change
from sinks.delta.storage import TableStorage
from sinks.delta.task_io import read_files
from sinks.keys import KeyedWrite

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("sinks.delta")

_BATCH = "_twophase_batch"
_RANK = "_twophase_rank"


def _spark_type(t: pa.DataType) -> Any:
    from pyspark.sql.pandas.types import from_arrow_type

    return from_arrow_type(t, prefer_timestamp_ntz=True)


def _spark_schema(schema: pa.Schema) -> Any:
    from pyspark.sql.types import StructField, StructType

    return StructType([StructField(f.name, _spark_type(f.type), True) for f in schema])


def _read(
    spark: SparkSession, storage: TableStorage, paths: Sequence[str], schema: pa.Schema
) -> DataFrame:
    """The rows of the Parquet files ``paths``: Spark's reader on a local or
    shared-filesystem table, the tasks' own on an object store."""
    if storage.root is None:
        return read_files(spark, storage, paths, schema)
    return spark.read.schema(_spark_schema(schema)).parquet(*(storage.path(p) for p in paths))


def as_stored(df: DataFrame, layout: Layout) -> DataFrame:
    """``df`` with its string partition columns as Delta stores them: an empty
    string is null (:func:`sinks.delta.layout.partition_value`)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    for c in layout.partition_by:
        if isinstance(df.schema[c].dataType, StringType):
            col = F.col(quoted(c))
            df = df.withColumn(c, F.when(col == F.lit(""), F.lit(None)).otherwise(col))
    return df


def winning_changes(
    spark: SparkSession,
    storage: TableStorage,
    layout: Layout,
    rules: KeyedWrite,
    changes: Sequence[Change],
) -> DataFrame:
    """The changes of every batch, the last batch's row per key."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    schema = change_schema(layout)
    frames = []
    for batch in sorted({ch.batch for ch in changes}):
        paths = [ch.path for ch in changes if ch.batch == batch]
        frames.append(_read(spark, storage, paths, schema).withColumn(_BATCH, F.lit(batch)))
    # change files of an earlier version may hold "" in a partition key column
    df = as_stored(functools.reduce(lambda a, b: a.unionByName(b), frames), layout)
    if len(frames) == 1:
        return df.drop(_BATCH)  # one row per key already (one task per key)
    w = Window.partitionBy(*[F.col(quoted(k)) for k in rules.key]).orderBy(F.col(_BATCH).desc())
    return df.withColumn(_RANK, F.row_number().over(w)).where(F.col(_RANK) == 1).drop(_RANK, _BATCH)


def _targets(
    spark: SparkSession, storage: TableStorage, layout: Layout, candidates: Sequence[Candidate]
) -> DataFrame | None:
    """The candidates' rows, with their partition values, in table order."""
    from pyspark.sql import functions as F

    if not candidates:
        return None
    groups: dict[tuple[str | None, ...], list[str]] = {}
    for c in candidates:
        key = tuple(c.partition_values[p] for p in layout.partition_by)
        groups.setdefault(key, []).append(c.path)
    frames = []
    for values, paths in groups.items():
        df = _read(spark, storage, paths, layout.file_schema)
        for col, value in zip(layout.partition_by, values, strict=True):
            t = _spark_type(layout.schema.field(col).type)
            df = df.withColumn(col, F.lit(value).cast(t))
        frames.append(df.select(*[F.col(quoted(n)) for n in layout.schema.names]))
    return functools.reduce(lambda a, b: a.unionByName(b), frames)


def rewrite(
    spark: SparkSession,
    storage: TableStorage,
    layout: Layout,
    rules: KeyedWrite,
    candidates: Sequence[Candidate],
    changes: Sequence[Change],
    where: str,
    stage: Callable[[DataFrame], Committable | None],
) -> Committable | None:
    """Stage (through ``stage``) the candidates' rows with ``changes`` applied."""
    from pyspark.sql import functions as F

    winners = winning_changes(spark, storage, layout, rules, changes)
    upserts = winners.where(~F.col(DELETE_COLUMN)).drop(DELETE_COLUMN)
    targets = _targets(spark, storage, layout, candidates)
    if targets is None:
        result = upserts
    else:
        keys = winners.select(*[F.col(quoted(k)).alias(f"_k{i}") for i, k in enumerate(rules.key)])
        match = functools.reduce(
            lambda a, b: a & b,
            # null-safe: a partition key column's "" is stored (and staged) as null
            [targets[quoted(k)].eqNullSafe(keys[f"_k{i}"]) for i, k in enumerate(rules.key)],
        )
        kept = targets.join(keys, match, "left_anti")
        result = kept.unionByName(upserts)
    log.debug(
        "%s: merging %d change file(s) into %d candidate file(s)",
        where,
        len(changes),
        len(candidates),
    )
    return stage(result)
