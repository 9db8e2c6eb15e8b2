"""The PySpark binding: the pre-commit of a micro-batch (the barrier).

Spark calls the batch handler (a ``foreachBatch`` function, which runs in the
driver's Python process) once per micro-batch. It runs one Spark job per step
of the pipeline's :func:`write_plan`: ``mapInArrow`` over the batch, where
every task writes its partition from Arrow record batches to each sink of the
step and prepares each, returning one committable per sink; ``collect()``
brings the committables back, and the coordinator records them in the ledger
before the handler returns, i.e. before Spark writes ``commits/<batch>``.
Sinks that need the same of the batch share a step (one pass over it), so a
pipeline whose sinks need nothing special reads each batch once, in one job;
a sink that stages through a Spark job of its own
(:class:`~sinks.capabilities.StagesThroughSpark`) runs that job instead
unless it joins.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql import DataFrame
from pyspark.sql.pandas.types import to_arrow_schema

from lifecycle._columns import column
from lifecycle.coordinator import Coordinator
from lifecycle.failures import TaskFailure, full_trace
from lifecycle.partitioning import clustered_by
from sinks import _faults, capabilities
from sinks.base import Committable, JobScope, Sink, SinkWriter, WriteContext
from sinks.capabilities import ExpiringWork, HoldsPreparedWork, StagesThroughSpark

log = logging.getLogger("lifecycle.binding")

_OUT = pa.schema([pa.field("sink", pa.int32()), pa.field("committable", pa.string())])
_CULPRIT = "twophase: while writing sink "
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
BatchHandler = Callable[[DataFrame, int], None]


class PrecommitTask:
    """The executor-side function of ``mapInArrow``: write a partition to each
    of its sinks (one, or several sharing the job: :func:`precommit_shared`),
    then prepare each, in order.

    Picklable (it holds only the sinks' configuration and ids). A failure while
    a shared job writes one of its sinks carries a note naming that sink
    (:func:`culprit`); every writer of the task is closed as failed."""

    def __init__(
        self,
        sinks: Sequence[tuple[Sink, JobScope, int | None]],
        run: int,
        batch_id: int,
        schema: pa.Schema,
        only: frozenset[int] | None = None,
    ):
        self.sinks = list(sinks)  # (sink, scope, lease)
        self.run = run
        self.batch_id = batch_id
        self.schema = schema
        self.only = only

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        tc = TaskContext.get()
        assert tc is not None, "PrecommitTask runs inside a Spark task"
        if self.only is not None and tc.partitionId() not in self.only:
            return  # its share of the batch is committed already (a partial repayment)
        number = tc.attemptNumber()
        writers: list[SinkWriter] = []
        out: list[tuple[int, str]] = []
        at: int | None = None  # the sink being written (None: reading the batch)
        failed = True
        try:
            part, task = tc.partitionId(), tc.taskAttemptId()
            for at in range(len(self.sinks)):
                sink, scope, lease = self.sinks[at]
                ctx = WriteContext(scope, self.run, self.batch_id, part, task, number, lease)
                writers.append(sink.open_writer(ctx, self.schema))
            at = None
            names = self.schema.names
            for i, batch in enumerate(batches):
                batch = batch.rename_columns(names)  # see precommit()
                for at in range(len(writers)):
                    writers[at].write(batch)
                at = None
                if i == 0:
                    _faults.hit("executor.write", batch=self.batch_id, attempt=number)
            for at, writer in enumerate(writers):
                committable = writer.prepare()
                if committable is not None:
                    out.append((at, json.dumps(committable)))
            at = None
            if out:  # every sink of the task holds its prepared work
                _faults.hit("executor.prepared", batch=self.batch_id, attempt=number)
            failed = False
        except BaseException as e:
            if len(self.sinks) > 1 and at is not None:
                _note(e, self.sinks[at][0])
            raise
        finally:
            _close_all(writers, failed)
        yield pa.RecordBatch.from_arrays(
            [pa.array([i for i, _ in out], pa.int32()), pa.array([c for _, c in out], pa.string())],
            schema=_OUT,
        )


def _close_all(writers: list[SinkWriter], failed: bool) -> None:
    """Close every writer, even when one's close raises (the first error is raised)."""
    error: BaseException | None = None
    for writer in writers:
        try:
            writer.close(failed=failed)
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


def _note(exc: BaseException, sink: Sink) -> None:
    """Name ``sink`` in ``exc``'s trace (Python 3.11 and later: a note)."""
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(_CULPRIT + sink.sink_id)


def culprit(exc: BaseException, sinks: Sequence[Sink]) -> Sink | None:
    """The sink of ``sinks`` whose writer a failed shared job was writing, as
    the task's note names it (in the Python worker's trace Spark hands back;
    Python 3.11 and later: before, the caller blames the step's first sink)."""
    named = set(re.findall("^" + re.escape(_CULPRIT) + r"(\S+)\s*$", full_trace(exc), re.M))
    return next((s for s in sinks if s.sink_id in named), None)


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
    return _run_tasks(_arranged(df, sink), [(sink, scope)], run, batch_id, schema, only)[
        sink.sink_id
    ]


def _arranged(df: DataFrame, sink: Sink) -> DataFrame:
    """``df`` partitioned and sorted as ``sink`` needs it (no shuffle when the
    batch is partitioned by its columns already: :func:`clustered_by`)."""
    cols = sink.partition_columns()
    if cols and not clustered_by(df, cols):
        df = df.repartition(*map(column, cols))
    order = sink.sort_columns()
    if order:
        df = df.sortWithinPartitions(*map(column, order))
    return df


def precommit_shared(
    df: DataFrame,
    sinks: Sequence[Sink],
    scopes: Callable[[str], JobScope],
    run: int,
    batch_id: int,
    schema: pa.Schema,
) -> dict[str, list[Committable]]:
    """Write ``df`` through every sink of ``sinks`` in ONE Spark job (each
    task writes its partition to every sink, then prepares each in order);
    the committables per sink id. ``sinks`` are a step of :func:`write_plan`:
    they need the same partitioning and order of the batch (the first's is
    applied), and those that stage through Spark join (they check the batch,
    stage nothing). A failure names the sink being written in a note
    (:func:`culprit`)."""
    out: dict[str, list[Committable]] = {}
    joined: list[Sink] = []
    for sink in sinks:
        if isinstance(sink, StagesThroughSpark):
            try:
                own = sink.precommit_frame(df, scopes(sink.sink_id), run, batch_id, shared=True)
            except BaseException as e:
                _note(e, sink)
                raise
            if own is not None:  # it staged the batch itself after all
                out[sink.sink_id] = own
                continue
        joined.append(sink)
    joined_scopes = [(s, scopes(s.sink_id)) for s in joined]
    out.update(_run_tasks(_arranged(df, sinks[0]), joined_scopes, run, batch_id, schema, None))
    return out


def write_plan(sinks: Sequence[Sink]) -> list[list[Sink]]:
    """The Spark jobs that pre-commit each batch of a pipeline with ``sinks``,
    in the order they run: sinks that need the same of the batch (the same
    ``partition_columns`` and ``sort_columns``) share one job, whose tasks
    write their partition to each (one pass over the batch; the batch is
    persisted only when several jobs read it). A sink that stages batches
    with a Spark job of its own (:class:`StagesThroughSpark`) joins only when
    it says so (:meth:`~sinks.capabilities.StagesThroughSpark.joins_shared_jobs`),
    and only a job that some sink without such a job of its own needs anyway.
    In each job the sinks prepare in :func:`precommit_order`, and jobs with a
    sink whose prepared work expires run last. A sink whose prepare may wait
    for an earlier batch's commit (a keyed PostgreSQL sink: the rows it
    updates are locked until then,
    :meth:`~sinks.capabilities.HoldsPreparedWork.prepare_waits_for_commits`)
    shares no job with expiring work, which would stay open meanwhile."""
    groups: dict[tuple[tuple[str, ...], tuple[str, ...]], list[Sink]] = {}
    alone: list[list[Sink]] = []
    for sink in precommit_order(list(sinks)):
        if isinstance(sink, StagesThroughSpark) and not sink.joins_shared_jobs():
            alone.append([sink])
            continue
        need = (tuple(sink.partition_columns() or ()), tuple(sink.sort_columns() or ()))
        groups.setdefault(need, []).append(sink)
    for group in groups.values():
        expiring: list[Sink] = [s for s in group if isinstance(s, ExpiringWork)]
        if expiring and any(_waits(s) for s in group):
            group = [s for s in group if s not in expiring]
            alone.append(expiring)
        if all(isinstance(s, StagesThroughSpark) for s in group):
            alone += [[s] for s in group]  # no job they must share: each its own
        elif group:
            alone.append(group)
    return sorted(alone, key=lambda step: any(isinstance(s, ExpiringWork) for s in step))


def _waits(sink: Sink) -> bool:
    return isinstance(sink, HoldsPreparedWork) and sink.prepare_waits_for_commits()


def _run_tasks(
    df: DataFrame,
    sinks: Sequence[tuple[Sink, JobScope]],
    run: int,
    batch_id: int,
    schema: pa.Schema,
    only: frozenset[int] | None,
) -> dict[str, list[Committable]]:
    leased = [(s, scope, capabilities.lease(s.committer(), scope, batch_id)) for s, scope in sinks]
    task = PrecommitTask(leased, run, batch_id, schema, only)
    rows = _plain_names(df).mapInArrow(task, "sink int, committable string").collect()
    out: dict[str, list[Committable]] = {s.sink_id: [] for s, _ in sinks}
    for r in rows:
        out[sinks[r[0]][0].sink_id].append(json.loads(r[1]))
    return out


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

    steps = write_plan(sinks)

    def handle(df: DataFrame, batch_id: int) -> None:
        if not coordinator.admit(pipeline, batch_id):
            return  # committed before: Spark may now write its commit-log entry
        coordinator.metrics.writing(pipeline, began=True)
        committables: dict[str, list[Committable]] = {}
        cached = len(steps) > 1
        writing: list[Sink] = []
        if cached:
            df = df.persist()  # every job reads the same rows
        try:
            for step in steps:
                writing = step
                if len(step) == 1:
                    sink = step[0]
                    scope = coordinator.scope(pipeline, sink.sink_id)
                    committables[sink.sink_id] = precommit(
                        df, sink, scope, coordinator.run, batch_id, schema
                    )
                else:
                    committables.update(
                        precommit_shared(
                            df,
                            step,
                            functools.partial(coordinator.scope, pipeline),
                            coordinator.run,
                            batch_id,
                            schema,
                        )
                    )
            writing = []
            _faults.hit("driver.before_record", batch=batch_id)
            if ending_input:
                _faults.hit("driver.before_record_ending_input", batch=batch_id)
            coordinator.register(pipeline, batch_id, committables)
        except BaseException as e:
            if on_failure is not None and isinstance(e, Exception):
                try:
                    failed = (culprit(e, writing) or writing[0]) if writing else None
                    on_failure(TaskFailure.of(pipeline, batch_id, failed, e))
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
