"""The PySpark binding: the pre-commit of a micro-batch (the barrier).

Spark calls the batch handler (a ``foreachBatch`` function, which runs in the
driver's Python process) once per micro-batch. For each sink it runs one Spark
job: ``mapInArrow`` over the batch, where every task writes its partition from
Arrow record batches and prepares it, returning one committable; ``collect()``
brings the committables back, and the coordinator records them in the ledger
before the handler returns, i.e. before Spark writes ``commits/<batch>``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql import DataFrame
from pyspark.sql.pandas.types import to_arrow_schema

from lifecycle._columns import column
from lifecycle.coordinator import Coordinator
from lifecycle.failures import TaskFailure
from lifecycle.partitioning import clustered_by
from sinks import _faults, capabilities
from sinks.base import Committable, JobScope, Sink, WriteContext
from sinks.capabilities import ExpiringWork, StagesThroughSpark

log = logging.getLogger("lifecycle.binding")

_OUT = pa.schema([pa.field("committable", pa.string())])
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
BatchHandler = Callable[[DataFrame, int], None]


class PrecommitTask:
    """The executor-side function of ``mapInArrow``: write a partition, prepare it.

    Picklable (it holds only the sink's configuration and ids)."""

    def __init__(
        self,
        sink: Sink,
        scope: JobScope,
        run: int,
        batch_id: int,
        schema: pa.Schema,
        lease: int | None = None,
        only: frozenset[int] | None = None,
    ):
        self.sink = sink
        self.scope = scope
        self.run = run
        self.batch_id = batch_id
        self.schema = schema
        self.lease = lease
        self.only = only

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        tc = TaskContext.get()
        assert tc is not None, "PrecommitTask runs inside a Spark task"
        if self.only is not None and tc.partitionId() not in self.only:
            return  # its share of the batch is committed already (a partial repayment)
        number = tc.attemptNumber()
        ctx = WriteContext(
            self.scope,
            self.run,
            self.batch_id,
            tc.partitionId(),
            tc.taskAttemptId(),
            number,
            self.lease,
        )
        writer = self.sink.open_writer(ctx, self.schema)
        failed = True
        try:
            names = self.schema.names
            for i, batch in enumerate(batches):
                writer.write(batch.rename_columns(names))  # see precommit()
                if i == 0:
                    _faults.hit("executor.write", batch=self.batch_id, attempt=number)
            committable = writer.prepare()
            if committable is not None:
                _faults.hit("executor.prepared", batch=self.batch_id, attempt=number)
            failed = False
        finally:
            writer.close(failed=failed)
        out = [json.dumps(committable)] if committable is not None else []
        yield pa.RecordBatch.from_arrays([pa.array(out, pa.string())], schema=_OUT)


def precommit(
    df: DataFrame,
    sink: Sink,
    scope: JobScope,
    run: int,
    batch_id: int,
    schema: pa.Schema,
    only: frozenset[int] | None = None,
) -> list[Committable]:
    """Write ``df`` through ``sink`` on the executors; return the committables.
    ``only``: write only these Spark partitions of the batch (the lost tasks'
    share of an owed batch, written again: :mod:`lifecycle.replay`)."""
    own = None
    if isinstance(sink, StagesThroughSpark):
        framed = sink.frame_for_write(df)
        if framed is not df:
            df, schema = framed, arrow_schema(framed)
        own = sink.precommit_frame(df, scope, run, batch_id)
    if own is not None:
        if only is not None:
            raise RuntimeError(
                f"{sink.describe()} stages its batches through Spark as a whole: it cannot "
                f"write only partitions {sorted(only)} of batch {batch_id} again"
            )
        return own
    cols = sink.partition_columns()
    if cols and not clustered_by(df, cols):
        df = df.repartition(*map(column, cols))
    order = sink.sort_columns()
    if order:
        df = df.sortWithinPartitions(*map(column, order))
    df = _plain_names(df)
    lease = capabilities.lease(sink.committer(), scope, batch_id)
    task = PrecommitTask(sink, scope, run, batch_id, schema, lease, only)
    rows = df.mapInArrow(task, "committable string").collect()
    return [json.loads(r[0]) for r in rows]


def arrow_schema(df: DataFrame) -> pa.Schema:
    """The Arrow schema of ``df``'s rows as ``mapInArrow`` hands them over
    (timestamps in the session's time zone)."""
    tz = df.sparkSession.conf.get("spark.sql.session.timeZone") or "UTC"
    return to_arrow_schema(df.schema, timezone=tz)


def _plain_names(df: DataFrame) -> DataFrame:
    """``df`` with column names ``mapInArrow`` finds as they are. It looks its
    input columns up by name, which Spark parses (a column called order.id would
    be field id of a struct order) and matches without case: unless every name
    is a plain identifier, unique without case, the columns get positional names
    (a Spark analysis, about 5 ms a batch), and the task gives the batches their
    own names back."""
    names = df.columns
    if all(_PLAIN_NAME.fullmatch(n) for n in names) and len({n.lower() for n in names}) == len(
        names
    ):
        return df
    return df.toDF(*(f"_{i}" for i in range(len(names))))


def precommit_order(sinks: list[Sink]) -> list[Sink]:
    """The order a batch pre-commits its sinks in: as given, except that sinks
    whose prepared work expires (Kafka transactions) come last, so that it is
    open for as short a time as possible before the checkpoint commits it."""
    return sorted(sinks, key=lambda s: isinstance(s, ExpiringWork))


def batch_handler(
    coordinator: Coordinator,
    pipeline: str,
    sinks: list[Sink],
    schema: pa.Schema,
    on_failure: Callable[[TaskFailure], None] | None = None,
    ending_input: bool = False,
) -> BatchHandler:
    """The ``foreachBatch`` function of one pipeline (``ending_input``: of the
    query that ends the pipeline's input; it only names fault points).

    When a batch fails, ``on_failure`` gets the structured failure (which sink,
    which batch, the cause in the user's terms, the full trace) before the
    exception goes on to Spark, which ends the query with it."""

    def handle(df: DataFrame, batch_id: int) -> None:
        if not coordinator.admit(pipeline, batch_id):
            return  # committed before: Spark may now write its commit-log entry
        coordinator.metrics.writing(pipeline, began=True)
        committables: dict[str, list[Committable]] = {}
        cached = len(sinks) > 1
        writing: Sink | None = None
        if cached:
            df = df.persist()  # every sink writes the same rows
        try:
            for sink in precommit_order(sinks):
                writing = sink
                scope = coordinator.scope(pipeline, sink.sink_id)
                committables[sink.sink_id] = precommit(
                    df, sink, scope, coordinator.run, batch_id, schema
                )
            writing = None
            _faults.hit("driver.before_record", batch=batch_id)
            if ending_input:
                _faults.hit("driver.before_record_ending_input", batch=batch_id)
            coordinator.register(pipeline, batch_id, committables)
        except BaseException as e:
            if on_failure is not None and isinstance(e, Exception):
                try:
                    on_failure(TaskFailure.of(pipeline, batch_id, writing, e))
                except Exception:
                    log.exception("could not describe the failure of batch %d", batch_id)
            coordinator.abort_unregistered(pipeline, committables)
            raise
        finally:
            coordinator.metrics.writing(pipeline, began=False)
            if cached:
                df.unpersist()
        _faults.hit("driver.after_record", batch=batch_id)

    return handle
