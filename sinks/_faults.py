"""Fault injection for crash tests. A no-op unless a test enables it.

Crash tests name a point in the commit protocol and what happens there, in the
environment of the process under test (inherited by Spark's Python workers)::

    TWOPHASE_FAULT="driver.after_record@2=kill"       # SIGKILL the driver in batch 2
    TWOPHASE_FAULT="executor.write=kill-driver"       # an executor kills the driver
    TWOPHASE_FAULT="executor.prepared#0=raise"        # first task attempt fails after PREPARE
    TWOPHASE_FAULT="executor.prepared@1=stall:20"     # tasks of batch 1 hang 20 s after PREPARE

Syntax: ``point[@batch][#attempt_number]=action`` (several joined by ``;``);
actions: ``kill`` (SIGKILL this process), ``kill-driver`` (SIGKILL the process
in ``TWOPHASE_DRIVER_PID``, then go on as a zombie would), ``raise``
(:class:`InjectedFault`), ``stall:SECONDS`` (sleep, e.g. to be caught in flight
by a stop). In-process tests can instead ``register`` a callback.

Points: ``executor.write``, ``executor.prepared``, ``driver.before_record``,
``driver.after_record``, ``driver.before_commit``, ``driver.mid_commit``,
``driver.ending_input`` (a pipeline has recorded that its input ends).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

ENV = "TWOPHASE_FAULT"
_callbacks: dict[str, Callable[[], None]] = {}


class InjectedFault(RuntimeError):
    """Raised at a fault point by the ``raise`` action."""


def register(point: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` (in this process) the next time ``point`` is hit."""
    _callbacks[point] = fn


def clear() -> None:
    _callbacks.clear()


def _matches(spec: str, point: str, batch: int | None, attempt: int | None) -> str | None:
    where, _, action = spec.partition("=")
    where, _, attempt_s = where.partition("#")
    name, _, batch_s = where.partition("@")
    if name.strip() != point:
        return None
    if batch_s and (batch is None or int(batch_s) != batch):
        return None
    if attempt_s and (attempt is None or int(attempt_s) != attempt):
        return None
    return action.strip() or "kill"


def hit(point: str, *, batch: int | None = None, attempt: int | None = None) -> None:
    """Called by the protocol at ``point``; does nothing unless a fault is set."""
    cb = _callbacks.pop(point, None)
    if cb is not None:
        cb()
    specs = os.environ.get(ENV)
    if not specs:
        return
    for spec in specs.split(";"):
        action = _matches(spec, point, batch, attempt)
        if action is None:
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "kill-driver":
            os.kill(int(os.environ["TWOPHASE_DRIVER_PID"]), signal.SIGKILL)
        elif action.startswith("stall:"):
            time.sleep(float(action.removeprefix("stall:")))
        elif action == "raise":
            raise InjectedFault(f"injected fault at {point} (batch {batch}, attempt {attempt})")
        else:
            raise ValueError(f"unknown fault action {action!r} in {ENV}")
