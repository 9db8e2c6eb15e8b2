"""Retry policy for driver-side commits and aborts (tenacity)."""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import tenacity

from sinks.errors import CommitError

T = TypeVar("T")
log = logging.getLogger("sinks.retry")

STORE_OUTAGE = 120.0
"""seconds a call to a file store (S3, HDFS) is tried again while the store
throttles it or is unreachable (a restart), before the error is raised"""

on_retry: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "twophase_on_retry", default=None
)
"""Called at every retry of :func:`retry_transient` in this context (the
coordinator counts a sink's commit retries with it; :func:`sinks._parallel.run_all`
carries it into its threads)."""


def retry_transient(
    fn: Callable[[], T],
    *,
    what: str,
    transient: tuple[type[BaseException], ...],
    deadline: float,
    in_flight: Callable[[], str | None] | None = None,
) -> T:
    """Call ``fn`` until it succeeds, retrying ``transient`` errors with
    exponential backoff for at most ``deadline`` seconds.

    Each retry is logged (a commit waiting for a restarting server shows
    progress). After the deadline a :class:`CommitError` names what failed; the
    caller's decision stays recorded and the next start finishes it.

    With ``in_flight`` (what ``fn`` is waiting for right now, e.g. the
    transaction being committed), a call that gets no answer at all is also
    bounded by the deadline: it runs in a thread of its own, which is left
    behind when the deadline passes (a server process that is stopped, not
    dead, keeps its connection alive and answers nothing; the call ends when it
    resumes). The :class:`CommitError` then names what it was waiting for."""
    call = fn
    if in_flight is not None:
        ends = time.monotonic() + deadline
        call = functools.partial(_answered_by, fn, ends, what, deadline, in_flight)

    def _log(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "%s failed (attempt %d, %.1fs so far): %s; retrying",
            what,
            state.attempt_number,
            state.seconds_since_start or 0.0,
            exc,
        )
        counted = on_retry.get()
        if counted is not None:
            counted()

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(transient),
        wait=tenacity.wait_exponential(multiplier=0.2, max=5.0),
        stop=tenacity.stop_after_delay(deadline),
        before_sleep=_log,
        reraise=False,
    )
    try:
        return retrying(call)
    except tenacity.RetryError as e:
        last = e.last_attempt.exception()
        raise CommitError(f"{what} did not succeed within {deadline:.0f}s: {last}") from last


def _answered_by(
    fn: Callable[[], T],
    ends: float,
    what: str,
    deadline: float,
    in_flight: Callable[[], str | None],
) -> T:
    """``fn()``, or :class:`CommitError` when it has not returned by ``ends``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed over to the caller
            box["error"] = e

    worker = threading.Thread(target=run, name=f"twophase: {what}", daemon=True)
    worker.start()
    worker.join(max(0.0, ends - time.monotonic()))
    if worker.is_alive():
        waiting = in_flight()
        raise CommitError(
            f"{what} got no answer within {deadline:.0f}s"
            + (f", waiting for {waiting}" if waiting else "")
            + ": the server holds the connection open but does not answer (a stopped or "
            "hung server process?). The decision stays recorded; the next start finishes it"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]
