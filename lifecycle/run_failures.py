"""How a run of a job fails: the failed batches its batch handlers report (from
Spark's threads), the error a pipeline's terminated query ends the run with,
and what a failure that ends the run becomes: one line for the caller and the
heartbeat, its full trace logged once, at ERROR, by the ``lifecycle.job``
logger (see :mod:`lifecycle.errors`). How a failure is described (its cause in
one line, its trace) is :mod:`lifecycle.failures`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn

from lifecycle.coordinator import Coordinator
from lifecycle.errors import JobFailedError, PipelineFailedError
from lifecycle.failures import TaskFailure, cause_of, full_trace
from sinks.errors import ConfigError, PreflightError, TwoPhaseError

log = logging.getLogger("lifecycle.job")  # the job's own messages


class RunFailures:
    """The failures of the runs of job ``job`` (module docstring)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._failed: dict[str, TaskFailure] = {}  # pipeline -> its failed batch
        self.error: str | None = None
        """the failure that ended the last run, as the heartbeat shows it (None:
        it did not fail)"""

    def remember(self, failure: TaskFailure) -> None:
        """Called by a batch handler (Spark's thread) when a batch failed."""
        self._failed[failure.pipeline] = failure

    def forget(self, pipeline: str) -> None:
        """The query of ``pipeline`` starts (again): a failure of its last one is moot."""
        self._failed.pop(pipeline, None)

    def fail(
        self,
        coord: Coordinator,
        pipeline: str,
        exc: BaseException | None,
        stop_queries: Callable[[], None],
    ) -> NoReturn:
        """``pipeline``'s query terminated (``exc``: with that error): stop the
        others (``stop_queries``), commit what Spark completed, and raise the
        failure: the batch handler's record of it when there is one, else what
        the query says."""
        failure = self._failed.pop(pipeline, None)
        error: PipelineFailedError
        if failure is not None:
            error = failure.error(self.job)
        elif exc is not None:
            error = PipelineFailedError(
                self.job, pipeline, cause_of(exc, None), trace=full_trace(exc)
            )
        else:
            error = PipelineFailedError(self.job, pipeline, "its query stopped unexpectedly")
        stop_queries()
        try:
            coord.settle(kind="recovery")
        except Exception:
            log.exception("could not settle after the failure; the next start recovers")
        raise error from None

    def ended_by(self, e: BaseException) -> JobFailedError | None:
        """Record ``e``, which ended a run (in ``error``), logging a failure of
        the job once. Returns the :class:`JobFailedError` to raise instead of
        ``e`` (from ``e``): a sink's :class:`TwoPhaseError` becomes one; None:
        ``e`` itself is raised (a job's failure, a refusal of its
        configuration, or an error that is not the job's)."""
        if isinstance(e, JobFailedError):
            self.error = str(e)
            log_failure(e)
            return None
        if isinstance(e, (ConfigError, PreflightError)):
            self.error = str(e)
            return None
        if isinstance(e, TwoPhaseError):
            error = JobFailedError(f"job {self.job!r} failed: {e}", trace=full_trace(e))
            self.error = str(error)
            log_failure(error)
            return error
        self.error = f"{type(e).__name__}: {e}"
        return None


def log_failure(e: JobFailedError) -> None:
    """Log a failure once, at ERROR: its one line, then its full trace."""
    first = str(e).split("\n", 1)[0]
    if e.trace:
        log.error("%s\n%s", first, e.trace)
    else:
        log.error("%s", first)
