"""The kinds of error a job raises, each starting with one line in the user's terms.

Four kinds of failure reach the caller of ``Job.run()``:

* :class:`sinks.PreflightError`: before any data moves, a sink cannot give
  exactly-once as configured (raised as is, not a :class:`JobFailedError`);
* :class:`RecoveryRefusedError`: recovery at start refuses to go on (a Spark
  checkpoint vanished after its pipeline committed output, the ledger holds
  work of a pipeline or sink the job no longer defines);
* :class:`TaskFailedError` (a :class:`PipelineFailedError`): a Spark task of
  pipeline P writing sink S in batch N failed, so the pipeline's query ended;
* :class:`CheckpointCommitError`: a checkpoint (which spans every pipeline's
  completed batches, not one batch) could not commit one or more sinks.

Every :class:`JobFailedError` message is one line naming where it failed and
the cause (translated by :mod:`sinks.explain`), ending with a pointer to the
log: the full trace is logged once, at ERROR, by the ``lifecycle.job`` logger,
and kept in the error's ``trace``. What Spark completed is committed
where possible, every decision stays in the ledger, and running the job again
with the same ``state_dir`` recovers.
"""

from __future__ import annotations

from sinks.errors import ConfigError, TwoPhaseError

POINTER = "(full trace in the log)"


class JobFailedError(TwoPhaseError):
    """A pipeline, a commit or the recovery of a job failed.

    ``str(error)`` is one line (plus the pointer to the log); ``trace``
    holds the full trace (Python, executor and Spark text) that was logged."""

    def __init__(self, message: str, *, trace: str = "") -> None:
        super().__init__(message)
        self.trace = trace


class PipelineFailedError(JobFailedError):
    """A pipeline's Spark query failed (or stopped when it should not have).

    Attributes: ``job``, ``pipeline``, ``batch`` (None when unknown), ``cause``
    (one line in the user's terms)."""

    def __init__(
        self, job: str, pipeline: str, cause: str, *, batch: int | None = None, trace: str = ""
    ) -> None:
        self.job = job
        self.pipeline = pipeline
        self.batch = batch
        self.cause = cause
        pointer = f" {POINTER}" if trace else ""
        super().__init__(f"{self._where()}: {cause}{pointer}", trace=trace)

    def _where(self) -> str:
        batch = f", batch {self.batch}" if self.batch is not None else ""
        return f"job {self.job!r}, pipeline {self.pipeline!r}{batch} failed"


class TaskFailedError(PipelineFailedError):
    """A Spark task of ``pipeline`` writing ``sink`` in ``batch`` failed (after
    Spark's task retries), so the pipeline's query ended.

    Attributes: ``job``, ``pipeline``, ``sink`` (the sink id), ``target`` (what
    the sink writes to, e.g. ``PostgreSQL table public.orders at host:5432/db``),
    ``batch``, ``cause`` (one line in the user's terms: for a known error the
    column and the target table, or the size limit and the setting that changes
    it; for our own errors their message; else the last exception line of the
    trace)."""

    def __init__(
        self,
        job: str,
        pipeline: str,
        sink: str,
        batch: int,
        cause: str,
        *,
        target: str = "",
        trace: str = "",
    ) -> None:
        self.sink = sink
        self.target = target
        super().__init__(job, pipeline, cause, batch=batch, trace=trace)

    def _where(self) -> str:
        target = f" ({self.target})" if self.target else ""
        return (
            f"job {self.job!r}, pipeline {self.pipeline!r}, sink {self.sink!r}{target}, "
            f"batch {self.batch}: a task failed"
        )


class CheckpointCommitError(JobFailedError):
    """Checkpoint ``checkpoint`` could not commit one or more sinks after all
    retries. A checkpoint spans every pipeline's completed batches, not one
    batch. Its decision stays in the ledger: the next start finishes it (or,
    for a transaction that was lost, fails again rather than hide it).

    Attributes: ``job``, ``checkpoint`` (its id), ``kind`` (periodic, final,
    savepoint, recovery), ``failed`` (``{"pipeline/sink_id": cause}``, one line
    each), ``cause`` (that of the first failed sink)."""

    def __init__(
        self,
        job: str,
        checkpoint: int,
        kind: str,
        failed: dict[str, str],
        *,
        trace: str,
        refused: bool = False,
    ) -> None:
        self.job = job
        self.checkpoint = checkpoint
        self.kind = kind
        self.failed = dict(failed)
        self.cause = next(iter(failed.values()), "")
        sinks = ", ".join(failed)
        causes = "; ".join(f"{label}: {why}" for label, why in failed.items())
        then = (
            "no retry can pass that: its decision stays in the ledger, and the next start "
            "finishes it once what the cause names is changed"
            if refused
            else "its decision stays in the ledger and the next start finishes it"
        )
        super().__init__(
            f"job {job!r}: checkpoint {checkpoint} ({kind}) could not commit "
            f"{len(failed)} sink(s) [{sinks}]: {causes}; {then} {POINTER}",
            trace=trace,
        )


class BatchLostError(PipelineFailedError):
    """A batch owed to sinks (their transactions of it were lost before they
    committed: a Kafka transaction the broker aborted at its timeout, a
    prepared transaction someone rolled back, staged files a VACUUM removed)
    could not be written again from its source: the source no longer has the
    data (retention, a deleted file), or gave other rows than the lost work
    held (a transform that is not deterministic). Nothing of the batch was
    committed to those sinks, the ledger still owes it, and the job does not
    run on until it is written: restore the source and run the job again.

    Attributes: ``job``, ``pipeline``, ``batch``, ``sinks`` (sink id -> the
    rows lost), ``rows`` (their sum), ``offsets`` (the batch's source offsets
    as Spark recorded them), ``cause``."""

    def __init__(
        self,
        job: str,
        pipeline: str,
        batch: int,
        sinks: dict[str, int],
        offsets: str,
        cause: str,
        *,
        trace: str = "",
    ) -> None:
        self.sinks = dict(sinks)
        self.rows = sum(sinks.values())
        self.offsets = offsets
        self.why = cause
        owed = ", ".join(f"{sid} ({n} row(s))" for sid, n in sorted(sinks.items()))
        super().__init__(
            job,
            pipeline,
            f"its work for sink(s) {owed} was lost before it committed, and writing it "
            f"again from the source (offsets {offsets or 'unknown'}) failed: {cause}; "
            f"{self.rows} row(s) are missing from those sinks until the source has that data "
            "again and the job runs again",
            batch=batch,
            trace=trace,
        )


class RecoveryRefusedError(JobFailedError, ConfigError):
    """Recovery at start refuses to go on: going on could write input twice or
    leave recorded work uncommitted. Nothing was started. The message says what
    to restore or change. Also a :class:`sinks.ConfigError` (the state or the
    job's definition does not match), so code catching that still does."""
