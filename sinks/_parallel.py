"""Bounded concurrency for the driver's commits, in one place.

A checkpoint commits several sinks, and a sink many transactions; each commit
is a network round trip (an EndTxn, a ``COMMIT PREPARED`` and its WAL flush)
that waits on the target, not on this process. :func:`run_all` runs such calls
on a bounded pool of threads and waits for every one of them, also when some
fail: a decided checkpoint is final, so committing the rest is what a restart
would do anyway. The caller then sees every outcome and decides what to raise.
"""

from __future__ import annotations

import contextvars
import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, TypeVar

from sinks.errors import ConfigError

T = TypeVar("T")
C = TypeVar("C")

COMMIT_CONNECTIONS = 4
"""Connections a sink commits one checkpoint's transactions over, at most, by
default (the sinks' ``commit_connections``)."""

PER_CONNECTION = 4
"""Transactions a connection commits at least before another one is opened: a
connection costs about what a few commits do."""


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What one call of :func:`run_all` ended with: a value or an error."""

    value: T | None = None
    error: BaseException | None = None


def run_all(calls: Sequence[Callable[[], T]], *, limit: int, name: str) -> list[Outcome[T]]:
    """Run every call, at most ``limit`` at once, and return their outcomes in
    order. One call (or ``limit`` 1) runs in the caller's thread. Threads are
    named ``name`` (they show in stack dumps of a hung commit); each call runs in
    a copy of the caller's context variables (what counts retries goes along)."""
    if len(calls) <= 1 or limit <= 1:
        return [_call(c) for c in calls]
    contexts = [contextvars.copy_context() for _ in calls]
    with ThreadPoolExecutor(max_workers=min(limit, len(calls)), thread_name_prefix=name) as pool:
        return list(pool.map(lambda ctx, c: ctx.run(_call, c), contexts, calls))


def run_parts(
    parts: Sequence[list[str]],
    work: Callable[[C, list[str]], None],
    first: C,
    open_other: Callable[[], AbstractContextManager[C]],
    *,
    name: str,
) -> None:
    """``work(connection, part)`` for every part at once: the first part on
    ``first`` (a connection the caller holds), each other on a connection of its
    own from ``open_other()``; the first error is raised once every part has
    ended."""

    def run(part: list[str], own: C | None) -> None:
        if own is not None:
            work(own, part)
            return
        with open_other() as conn:
            work(conn, part)

    calls = [functools.partial(run, p, first if i == 0 else None) for i, p in enumerate(parts)]
    raise_first(run_all(calls, limit=len(calls), name=name))


def raise_first(outcomes: Sequence[Outcome[T]]) -> list[T | None]:
    """The values of ``outcomes``; the first error among them is raised."""
    for o in outcomes:
        if o.error is not None:
            raise o.error
    return [o.value for o in outcomes]


def slices(items: Sequence[T], *, most: int = COMMIT_CONNECTIONS) -> list[list[T]]:
    """``items`` dealt round-robin into at most ``most`` slices of at least
    :data:`PER_CONNECTION` items each (one slice for a few items), order kept
    within each slice."""
    if not items:
        return []
    n = max(1, min(most, math.floor(len(items) / PER_CONNECTION)))
    return [list(items[i::n]) for i in range(n)]


def check_connections(value: int) -> int:
    """``commit_connections`` as given, or :class:`ConfigError` when it is not a
    positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"commit_connections must be an integer >= 1, not {value!r}")
    return value


def _call(fn: Callable[[], T]) -> Outcome[T]:
    try:
        return Outcome(value=fn())
    except Exception as e:  # handed to the caller, who decides
        return Outcome(error=e)
