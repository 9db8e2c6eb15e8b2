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
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger("lifecycle.control")


@dataclass(frozen=True)
class StopRequest:
    drain: bool
    requested_at: float
    source: str


def request_path(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / "control" / "stop.json"


def write_request(state_dir: str | os.PathLike[str], *, drain: bool, source: str) -> StopRequest:
    """Ask the job running on ``state_dir`` to stop (crash-safe file write)."""
    req = StopRequest(drain=drain, requested_at=time.time(), source=source)
    path = request_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(req.__dict__))
    tmp.rename(path)
    return req


def start_over_path(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / "control" / "start_over.json"


def request_start_over(state_dir: str | os.PathLike[str], incarnation: str, source: str) -> None:
    """Ask the next run on ``state_dir`` to start over from ``incarnation``."""
    path = start_over_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"from": incarnation, "at": time.time(), "source": source}))
    tmp.rename(path)


def start_over_request(state_dir: str | os.PathLike[str]) -> str | None:
    """The incarnation a ``twophase start-over`` asked the next run to take over."""
    try:
        return str(json.loads(start_over_path(state_dir).read_text())["from"])
    except FileNotFoundError:
        return None


def clear_start_over(state_dir: str | os.PathLike[str]) -> None:
    """Remove a start-over request once the claims are taken."""
    start_over_path(state_dir).unlink(missing_ok=True)


def take_request(state_dir: str | os.PathLike[str]) -> StopRequest | None:
    """Read and remove a pending stop request, if any."""
    path = request_path(state_dir)
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("ignoring an unreadable stop request %s", path)
        path.unlink(missing_ok=True)
        return None
    path.unlink(missing_ok=True)
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
