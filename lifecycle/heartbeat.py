"""The running job's heartbeat: how ``twophase status`` tells a running job from
a stopped one, on any host.

While ``Job.run`` runs, a thread renews ``STATE_DIR/control/heartbeat.json``
every :data:`EVERY_S` seconds through the job's state store (so it lives
wherever ``state_dir`` does: a shared file system or a Hadoop URI, seen from
any machine). The file names the job, its incarnation and run, the driver's
pid and host, when the run began and when it was last renewed, and the job's
state (:data:`lifecycle.metrics.JOB_STATES`). When the run ends, a last write
records how it ended (``finished``, ``stopped`` or ``failed``, with the error's
first line).

The file carries ``"schema": 1`` (:data:`SCHEMA`; one without is of 1 too).
:func:`read` refuses a heartbeat of a later schema, which a newer twophase
wrote (:class:`~sinks.versions.NewerVersionError`, naming the schema and the
file), rather than judge it by rules it may no longer follow.

A reader judges it with :func:`judge`: a heartbeat whose state is running (or
recovering, draining...) and that was renewed within :data:`LAPSE_FACTOR`
periods is alive; an older one means the driver died without a word (killed,
or its host went down): ``lost``. On the driver's own machine (same host name,
boot and pid namespace) a dead pid says ``lost`` at once. Hosts must keep
their clocks within a few seconds of each other (NTP): a heartbeat is judged
by the reader's clock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle.state.store_interface import StateStore
from sinks.versions import check_version

log = logging.getLogger("lifecycle.heartbeat")

PATH = "control/heartbeat.json"
"""the heartbeat, in the job's state store"""
SCHEMA = 1
"""the schema of the heartbeat this version writes, and the newest it reads"""
EVERY_S = 5.0
"""seconds between two renewals"""
LAPSE_FACTOR = 3.0
"""a heartbeat not renewed for this many periods is lost"""
ENDED = ("finished", "stopped", "failed")
"""the states a run ends in (the last write)"""


class Heartbeat:
    """Renews the heartbeat of one run until :meth:`end`."""

    def __init__(
        self,
        store: StateStore,
        identity: dict[str, Any],
        state: Callable[[], str],
        every: float = EVERY_S,
    ) -> None:
        self._store = store
        self._state = state
        self._every = every
        now = time.time()
        self._doc: dict[str, Any] = {
            "schema": SCHEMA,
            **identity,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "machine": machine(),
            "started_at": round(now, 3),
            "every_s": every,
        }
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="twophase-heartbeat", daemon=True)

    def start(self) -> None:
        self._write(self._state())
        self._thread.start()

    def beat(self) -> None:
        """Renew now (the state changed), from the heartbeat's own thread."""
        self._wake.set()

    def end(self, state: str, error: str | None = None, *, write: bool = True) -> None:
        """The run ended in ``state`` (one of :data:`ENDED`): stop renewing and
        say so (``write=False``: stop without writing)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(self._every + 5)
        if not write:
            return
        extra: dict[str, float | str] = {"ended_at": round(time.time(), 3)}
        if error:
            extra["error"] = error.split("\n", 1)[0]
        with contextlib.suppress(Exception):  # the job's outcome is not the heartbeat's
            self._write(state, extra)

    def _renew(self) -> None:
        while True:
            self._wake.wait(self._every)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._write(self._state())
            except Exception as e:  # a store that fails now may work at the next beat
                log.warning("could not renew the heartbeat in %s: %s", self._store.uri(PATH), e)

    def _write(self, state: str, extra: dict[str, Any] | None = None) -> None:
        doc = {**self._doc, "state": state, "renewed_at": round(time.time(), 3), **(extra or {})}
        self._store.write_atomic(PATH, json.dumps(doc, sort_keys=True).encode())


def read(store: StateStore) -> dict[str, Any] | None:
    """The last heartbeat written on ``store``, or None (no run yet, or a run of
    a version that wrote none). A heartbeat of a later :data:`SCHEMA` raises
    :class:`~sinks.versions.NewerVersionError`."""
    data = store.read(PATH)
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    check_version(doc.get("schema"), SCHEMA, f"the heartbeat {store.uri(PATH)}")
    return doc


@dataclass(frozen=True)
class Liveness:
    """What a heartbeat says: ``state`` is the job's state when alive, how the
    last run ended (:data:`ENDED`), ``lost``, or ``unknown`` (no heartbeat)."""

    state: str
    alive: bool
    why: str


def judge(doc: dict[str, Any] | None, now: float | None = None) -> Liveness:
    """Whether the job that wrote heartbeat ``doc`` is running (module docstring)."""
    if doc is None:
        return Liveness("unknown", False, "no heartbeat: the job never ran with this version")
    now = time.time() if now is None else now
    state = str(doc.get("state", "unknown"))
    where = f"pid {doc.get('pid')} on {doc.get('host')}"
    if state in ENDED:
        return Liveness(state, False, f"the run of {where} ended {_ago(now, doc.get('ended_at'))}")
    renewed = float(doc.get("renewed_at", 0))
    every = float(doc.get("every_s", EVERY_S))
    same_machine = doc.get("host") == socket.gethostname() and doc.get("machine") == machine()
    if same_machine and not _pid_alive(int(doc.get("pid", 0))):
        return Liveness(
            "lost", False, f"{where} is gone (killed?); last heartbeat {_ago(now, renewed)}"
        )
    if now - renewed > LAPSE_FACTOR * every:
        return Liveness(
            "lost",
            False,
            f"the heartbeat of {where} lapsed {_ago(now, renewed)} (killed, or its host is down)",
        )
    return Liveness(state, True, f"{where}, heartbeat {_ago(now, renewed)}")


def machine() -> str:
    """What tells this machine and pid namespace from another with the same host
    name (a container sharing it): the boot id and the pid namespace, where
    Linux tells them; "" elsewhere (then pids are never compared)."""
    parts = []
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        return ""
    return " ".join(parts)


def _ago(now: float, at: Any) -> str:
    if not at:
        return "at an unknown time"
    return f"{max(0.0, now - float(at)):.0f}s ago"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
