"""Reading and staging a keyed merge's files in Spark's tasks, through the
table's own store: the route for object-store tables (``s3://``, ...).

A keyed merge (:mod:`sinks.delta.merge`) reads change files and the table's
candidate files and stages its rewrite. On a local or shared-filesystem table
Spark does both itself (``spark.read.parquet``, then
:class:`~sinks.delta.spark_stage.SparkStage`, which moves Spark's files into
place). On an object store neither fits: Spark's Hadoop file system for it
(S3A) may not be on the job's classpath, and SparkStage's moves would be
renames, which an object store does not have. So:

* :func:`read_files` makes a DataFrame of the files' rows whose tasks open
  each file with the sink's :class:`~sinks.delta.storage.TableStorage` (the
  same client and ``storage_options`` as the rest of the sink) and read it
  with pyarrow. A column a file lacks (written before the table gained it)
  reads as nulls, as Spark's reader does;
* :class:`TaskStage` writes a DataFrame with the sink's own writer in each
  task (:class:`~sinks.delta.writer.DeltaWriter`: each file announced by its
  staging marker before it is created, under a name of the sink's scope, so
  a sweep finds whatever a crash leaves), then hands the driver one
  committable holding every task's add actions. Nothing is renamed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from sinks.base import Committable, WriteContext
from sinks.delta.layout import Layout
from sinks.delta.storage import TableStorage
from sinks.delta.writer import DeltaWriter
from sinks.scope import JobScope

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_OUT = pa.schema([pa.field("committable", pa.string())])


class _ReadTask:
    """The tasks of :func:`read_files`: each reads the files named in its rows."""

    def __init__(self, storage: TableStorage, schema: pa.Schema) -> None:
        self.storage = storage
        self.schema = schema

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for rel in batch.column(0).to_pylist():
                with self.storage.fs.open_input_file(self.storage.path(rel)) as f:
                    t = pq.read_table(f)
                yield from _conformed(t, self.schema).to_batches()


def _conformed(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """``t``'s columns of ``schema``, in its order, cast to its types; nulls for
    a column ``t`` lacks."""
    columns = [
        t.column(f.name).cast(f.type) if f.name in t.column_names else pa.nulls(len(t), f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def read_files(
    spark: SparkSession, storage: TableStorage, paths: Sequence[str], schema: pa.Schema
) -> DataFrame:
    """The rows of the Parquet files ``paths`` (relative to the table), with the
    columns of ``schema`` (module docstring)."""
    from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
    from pyspark.sql.types import StructField, StructType

    spark_schema = StructType(
        [StructField(f.name, from_arrow_type(f.type, prefer_timestamp_ntz=True)) for f in schema]
    )
    tz = spark.conf.get("spark.sql.session.timeZone") or "UTC"
    handed = to_arrow_schema(spark_schema, timezone=tz, prefers_large_types=False)
    names = spark.createDataFrame([(p,) for p in paths], "path string")
    tasks = max(1, min(len(paths), spark.sparkContext.defaultParallelism))
    return names.repartition(tasks).mapInArrow(_ReadTask(storage, handed), spark_schema)


class _StageTask:
    """The tasks of :meth:`TaskStage.stage`: each stages its partition."""

    def __init__(
        self,
        storage: TableStorage,
        layout: Layout,
        scope: JobScope,
        run: int,
        batch_id: int,
        names: list[str],
    ) -> None:
        self.storage = storage
        self.layout = layout
        self.scope = scope
        self.run = run
        self.batch_id = batch_id
        self.names = names

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        tc = TaskContext.get()
        assert tc is not None, "a staging task runs inside a Spark task"
        ctx = WriteContext(
            self.scope,
            self.run,
            self.batch_id,
            tc.partitionId(),
            tc.taskAttemptId(),
            tc.attemptNumber(),
        )
        writer = DeltaWriter(self.storage, self.layout, ctx)
        failed = True
        try:
            for batch in batches:
                writer.write(batch.rename_columns(self.names))
            committable = writer.prepare()
            failed = False
        finally:
            writer.close(failed=failed)
        out = [json.dumps(committable)] if committable is not None else []
        yield pa.RecordBatch.from_arrays([pa.array(out, pa.string())], schema=_OUT)


class TaskStage:
    """Stages a DataFrame as one transaction's files with the sink's writer in
    each task (module docstring); the counterpart of
    :class:`~sinks.delta.spark_stage.SparkStage` for object stores."""

    def __init__(self, storage: TableStorage, layout: Layout, where: str) -> None:
        self._storage = storage
        self._layout = layout
        self._where = where

    def stage(
        self, df: DataFrame, scope: JobScope, run: int, batch_id: int, attempt: int | None = None
    ) -> Committable | None:
        """Write ``df``; one committable of every task's files (``None``: no
        rows). ``attempt`` is unused: each task names its files after its own
        Spark task attempt, which no other attempt shares."""
        names = df.columns
        # positional names: mapInArrow parses and case-folds the names it looks up
        # (lifecycle.binding._plain_names); each task gives the batches theirs back
        plain = df.toDF(*(f"_{i}" for i in range(len(names))))
        task = _StageTask(self._storage, self._layout, scope, run, batch_id, names)
        rows = [json.loads(r[0]) for r in plain.mapInArrow(task, "committable string").collect()]
        if not rows:
            return None
        first: dict[str, Any] = rows[0]
        return {
            **first,
            "rows": sum(int(c["rows"]) for c in rows),
            "adds": [a for c in rows for a in c["adds"]],
        }
