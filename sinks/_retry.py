"""Retry policy for driver-side commits and aborts (tenacity)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import tenacity

from sinks.errors import CommitError

T = TypeVar("T")
log = logging.getLogger("sinks.retry")


def retry_transient(
    fn: Callable[[], T],
    *,
    what: str,
    transient: tuple[type[BaseException], ...],
    deadline: float,
) -> T:
    """Call ``fn`` until it succeeds, retrying ``transient`` errors with
    exponential backoff for at most ``deadline`` seconds.

    Each retry is logged (a commit waiting for a restarting server shows
    progress). After the deadline a :class:`CommitError` names what failed; the
    caller's decision stays recorded and the next start finishes it."""

    def _log(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "%s failed (attempt %d, %.1fs so far): %s; retrying",
            what,
            state.attempt_number,
            state.seconds_since_start or 0.0,
            exc,
        )

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(transient),
        wait=tenacity.wait_exponential(multiplier=0.2, max=5.0),
        stop=tenacity.stop_after_delay(deadline),
        before_sleep=_log,
        reraise=False,
    )
    try:
        return retrying(fn)
    except tenacity.RetryError as e:
        last = e.last_attempt.exception()
        raise CommitError(f"{what} did not succeed within {deadline:.0f}s: {last}") from last
