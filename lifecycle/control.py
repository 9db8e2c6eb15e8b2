"""Stopping a running job: from code, from another terminal, or by a signal.

* ``Job.stop(drain=...)`` from another thread of the driver.
* ``twophase stop [--drain] STATE_DIR`` from another terminal writes a request
  file, ``STATE_DIR/control/stop.json``, which the run loop picks up within
  half a second; the command then waits for the job to exit and reads the
  ledger to tell whether the final or savepoint checkpoint committed.
* Signals (installed by ``Job.run`` when it runs in the main thread):
  SIGTERM drains; the first SIGINT (Ctrl-C) drains, the second stops without
  draining (a savepoint), the third interrupts at once, leaving what is
  pre-committed undecided for the next start to settle (and saying so).

Starting over is asked the same way: ``twophase start-over STATE_DIR --from ID``
writes ``STATE_DIR/control/start_over.json``; the next ``Job.run`` on that
state_dir takes every sink's claim over from incarnation ``ID`` (see
:mod:`sinks.progress`) and removes the file.

Both files are read and written through the job's state store
(:mod:`lifecycle.state.store`), so they live wherever ``state_dir`` does, a
Hadoop-compatible URI included.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from lifecycle.state.store_interface import StateStore

log = logging.getLogger("lifecycle.control")

STOP = "control/stop.json"
"""the stop request, in the job's state store"""
START_OVER = "control/start_over.json"
"""the start-over request, in the job's state store"""


@dataclass(frozen=True)
class StopRequest:
    drain: bool
    requested_at: float
    source: str


def write_request(store: StateStore, *, drain: bool, source: str) -> StopRequest:
    """Ask the job running on ``store``'s state_dir to stop (crash-safe write)."""
    req = StopRequest(drain=drain, requested_at=time.time(), source=source)
    store.write_atomic(STOP, json.dumps(req.__dict__).encode())
    return req


def request_start_over(store: StateStore, incarnation: str, source: str) -> None:
    """Ask the next run on ``store``'s state_dir to start over from ``incarnation``."""
    doc = {"from": incarnation, "at": time.time(), "source": source}
    store.write_atomic(START_OVER, json.dumps(doc).encode())


def start_over_request(store: StateStore) -> str | None:
    """The incarnation a ``twophase start-over`` asked the next run to take over."""
    data = store.read(START_OVER)
    return None if data is None else str(json.loads(data)["from"])


def clear_start_over(store: StateStore) -> None:
    """Remove a start-over request once the claims are taken."""
    store.delete(START_OVER)


def take_request(store: StateStore) -> StopRequest | None:
    """Read and remove a pending stop request, if any."""
    raw = store.read(STOP)
    if raw is None:
        return None
    try:
        data: dict[str, Any] = json.loads(raw)
    except ValueError:
        log.warning("ignoring an unreadable stop request %s", store.uri(STOP))
        store.delete(STOP)
        return None
    store.delete(STOP)
    return StopRequest(
        drain=bool(data.get("drain")),
        requested_at=float(data.get("requested_at", time.time())),
        source=str(data.get("source", "file")),
    )


class SignalHandlers:
    """Installs the documented SIGTERM/SIGINT behaviour for the duration of a run."""

    def __init__(self, stop: Callable[[bool], None]) -> None:
        self._stop = stop
        self._sigints = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalHandlers:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM:
            log.warning("SIGTERM: draining (every pipeline ends its input, one final checkpoint)")
            self._stop(True)
            return
        self._sigints += 1
        if self._sigints == 1:
            log.warning("SIGINT: draining; press Ctrl-C again to stop without draining")
            self._stop(True)
        elif self._sigints == 2:
            log.warning(
                "SIGINT again: stopping without draining (savepoint); Ctrl-C once more "
                "to interrupt at once"
            )
            self._stop(False)
        else:
            raise KeyboardInterrupt
