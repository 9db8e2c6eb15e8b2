"""Writing owed batches again from their source (recovery rule 5 of
:mod:`lifecycle.coordinator`).

A batch is *owed* to a sink when the sink's transactions of it were lost
before they committed: Apache Kafka aborted them at ``transaction.timeout.ms``
(a long pause, a slow commit of another sink, a driver that was down),
someone rolled a prepared transaction back, a VACUUM removed staged files. The
sink's commit reported the loss, the coordinator recorded the debt in the
ledger and committed the rest of the checkpoint (rule 5 of
:mod:`lifecycle.coordinator`). The job pays it at start, after recovery and
before any query runs, and during a run right after the checkpoint that found
the loss, with the owing pipeline's query stopped (:meth:`lifecycle.job.Job`'s
run loop), one batch at a time in ascending order per pipeline:

1. Work recorded as writing the batch again before a stop is settled first:
   committed where it is kept (then the debt is paid), aborted where part is
   gone (then this runs again). A sink whose own progress record
   (:meth:`sinks.committer.Committer.progress`) holds the batch was paid before a crash
   (a sink that owes a batch commits none after it): the debt is recorded as
   paid. Spark's checkpoint must still hold the offsets the batch committed
   with (the ledger's digest), else the job refuses.
2. Spark's checkpoint of the pipeline is copied to ``<pipeline>/replay``
   with batch ``b`` as its last, uncompleted batch: its metadata, the offset
   log entries of ``b - 1`` and ``b``, the commit log entry of ``b - 1``, and
   the sources' and the state store's files. Spark's own checkpoint is never
   changed, so a crash at any instant leaves it as it was; the copy is made
   anew by every attempt.
3. The pipeline's query runs on the copy with a once trigger: Spark re-runs
   batch ``b`` with exactly its recorded offsets (and its state, for a
   stateful query, while the state store keeps that version), then stops.
   Its batch handler writes to the owing sinks only (where a sink owes only
   the lost tasks' share of the batch, because the rest of its work committed,
   only those Spark partitions: a deterministic batch gives each partition the
   same rows again), checks that each got the rows the lost work held, marks
   the work as a repayment (:data:`sinks.base.REPAYS`: committed though the
   sink holds the batch in part) and has the coordinator record that work,
   commit it and record the debt paid
   (:meth:`lifecycle.coordinator.Coordinator.repay`). A crash in between
   leaves the recorded work for step 1.
4. The copy is removed.

When the source no longer has the batch (retention, a deleted file), or gives
other rows (a transform that is not deterministic), nothing of the batch is
committed to the owing sinks and the job stops with
:class:`~lifecycle.errors.BatchLostError`, which names the pipeline, the
batch, its offsets and the rows missing; the debt stays in the ledger for the
next start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from pyspark.sql import DataFrame

from lifecycle.binding import precommit, precommit_order
from lifecycle.coordinator import Coordinator
from lifecycle.errors import BatchLostError, JobFailedError
from lifecycle.failures import cause_of, full_trace
from lifecycle.pipeline import Pipeline
from lifecycle.spark_log import SparkCommitLog
from sinks.base import REPAYS, Committable, Sink

log = logging.getLogger("lifecycle.replay")

_SPARK_TREES = ("sources", "state")
"""what of a Spark checkpoint a re-run batch reads besides its logs"""


def pay_owed(
    job: str,
    coord: Coordinator,
    pipelines: dict[str, Pipeline],
    only: Collection[str] | None = None,
) -> None:
    """Write every batch the ledger owes to sinks of ``pipelines`` (of the
    pipelines ``only``, default all) again (module docstring). Raises
    :class:`BatchLostError` when one cannot be."""
    owed = coord.ledger.owed()
    for name, p in pipelines.items():
        if name not in owed and (only is None or name in only):
            p.store.delete(f"{p.location}/replay")  # a copy a crash left after its payment
    for name, batches in sorted(owed.items()):
        if only is not None and name not in only:
            continue
        if name not in pipelines:
            raise JobFailedError(
                f"job {job!r}: the ledger owes batch(es) {sorted(batches)} of pipeline {name!r}, "
                "which this job does not define: add it back so they can be written again"
            )
        for b, owing in sorted(batches.items()):
            _pay(job, coord, pipelines[name], b, owing)


def _pay(job: str, coord: Coordinator, p: Pipeline, b: int, owing: dict[str, int]) -> None:
    sinks = {s.sink_id: s for s in p.sinks}
    missing = sorted(set(owing) - set(sinks))
    if missing:
        raise JobFailedError(
            f"job {job!r}: batch {b} of pipeline {p.name!r} is owed to sink(s) {missing}, "
            "which the pipeline no longer has: add them back (same sink_id)"
        )
    if coord.finish_repay(p.name, b):  # written again before a stop: its commit finished
        log.info("batch %d of %s: written again before the last stop, now committed", b, p.name)
        return
    parts = coord.ledger.owed_parts(p.name, b)
    held = {
        sid: n
        for sid, n in owing.items()
        if sid not in parts  # the rest of a partly owed batch is held: no proof of payment
        and (found := sinks[sid].committer().progress(coord.scope(p.name, sid))).held_by(
            coord.incarnation
        )
        and found.batch >= b
    }
    if held:
        # a sink that owes a batch commits none after it (rule 5), so holding it means
        # its payment committed and the record of that was lost
        log.info("batch %d of %s: %s hold it already (paid before a stop)", b, p.name, sorted(held))
        coord.ledger.record_repaid(p.name, b, held)
    owing = {sid: n for sid, n in owing.items() if sid not in held}
    if not owing:
        return
    offsets = _offsets(p, b)
    log.warning(
        "writing batch %d of pipeline %s again from its source (offsets %s) for %s",
        b,
        p.name,
        offsets,
        ", ".join(
            f"{sid} ({n} row(s)"
            + (f" of Spark partition(s) {parts[sid]}" if sid in parts else "")
            + ")"
            for sid, n in sorted(owing.items())
        ),
    )
    location = f"{p.location}/replay"
    ran: list[int] = []
    failed: list[BaseException] = []  # a failure to commit, not to read the source
    only = {sid: frozenset(parts[sid]) for sid in owing if sid in parts}
    handler = _handler(coord, p, b, [sinks[sid] for sid in sorted(owing)], owing, only, ran, failed)
    try:
        _check_offsets(coord, p, b)
        p.store.delete(location)
        _copy_checkpoint(p, b, location)
        query = p.start_replay(job, location, handler)
        query.awaitTermination()
    except Exception as e:
        if failed:
            raise failed[0] from e
        raise BatchLostError(
            job, p.name, b, owing, offsets, cause_of(e, None), trace=full_trace(e)
        ) from e
    if ran != [b]:
        raise BatchLostError(
            job,
            p.name,
            b,
            owing,
            offsets,
            f"Spark ran batch(es) {ran} on the copy of its checkpoint, not batch {b}",
        )
    p.store.delete(location)


def _check_offsets(coord: Coordinator, p: Pipeline, b: int) -> None:
    """Refuse to write batch ``b`` again when Spark's checkpoint now holds other
    offsets for it than the batch committed with (the checkpoint was replaced)."""
    planned = SparkCommitLog(p.store, p.spark_location).offsets_digest(b)
    recorded = coord.ledger.committed_digest(p.name, b)
    if recorded is not None and planned != recorded:
        raise RuntimeError(
            f"the pipeline's Spark checkpoint {p.store.uri(p.spark_location)} holds other "
            f"offsets for batch {b} than the batch had (it was restored from an older copy or "
            "replaced): restore the pipeline's newest Spark checkpoint"
        )


def _handler(
    coord: Coordinator,
    p: Pipeline,
    b: int,
    sinks: list[Sink],
    owing: dict[str, int],
    only: dict[str, frozenset[int]],
    ran: list[int],
    failed: list[BaseException],
) -> Callable[[DataFrame, int], None]:
    def handle(df: DataFrame, batch_id: int) -> None:
        ran.append(batch_id)
        if batch_id != b:
            raise RuntimeError(f"Spark ran batch {batch_id} instead of batch {b}")
        work: dict[str, list[Committable]] = {}
        cached = len(sinks) > 1
        if cached:
            df = df.persist()
        try:
            for sink in precommit_order(sinks):
                scope = coord.scope(p.name, sink.sink_id)
                work[sink.sink_id] = precommit(
                    df, sink, scope, coord.run, b, p.schema, only.get(sink.sink_id)
                )
            for cs in work.values():
                for c in cs:
                    c[REPAYS] = True  # commits though the sink may hold the batch in part
            got = {sid: sum(int(c.get("rows", 0)) for c in cs) for sid, cs in work.items()}
            other = {sid: (got[sid], n) for sid, n in owing.items() if got.get(sid) != n}
            if other:
                raise RuntimeError(
                    "the source gave other rows than the lost work held ("
                    + ", ".join(f"{sid}: {g} row(s), lost {n}" for sid, (g, n) in other.items())
                    + "): its input changed, or the pipeline's transform is not "
                    "deterministic; nothing of it was committed"
                )
        except BaseException:
            coord.abort_unregistered(p.name, work)
            raise
        finally:
            if cached:
                df.unpersist()
        try:
            coord.repay(p.name, b, work)
        except BaseException as e:
            failed.append(e)  # the target's failure: the ledger keeps the work for the next start
            raise

    return handle


def _copy_checkpoint(p: Pipeline, b: int, to: str) -> None:
    """Copy what Spark needs to re-run batch ``b`` of ``p`` to ``to`` (module
    docstring, step 2)."""
    store, spark = p.store, p.spark_location
    names = ["metadata", f"offsets/{b}"] + ([f"offsets/{b - 1}"] if b > 0 else [])
    for name in names:
        if not store.exists(f"{spark}/{name}"):
            raise RuntimeError(
                f"the Spark checkpoint {store.uri(spark)} no longer holds {name} (Spark keeps "
                "the logs of its last spark.sql.streaming.minBatchesToRetain batches)"
            )
        store.copy(f"{spark}/{name}", f"{to}/{name}")
    if b > 0 and store.exists(f"{spark}/commits/{b - 1}"):
        # (Spark re-runs the last batch without it too; it carries the watermark)
        store.copy(f"{spark}/commits/{b - 1}", f"{to}/commits/{b - 1}")
    for tree in _SPARK_TREES:
        if store.exists(f"{spark}/{tree}"):
            store.copy(f"{spark}/{tree}", f"{to}/{tree}")


def _offsets(p: Pipeline, b: int) -> str:
    """The source offsets Spark recorded for batch ``b``, or ''."""
    return " ".join(SparkCommitLog(p.store, p.spark_location).planned_offsets(b) or [])
