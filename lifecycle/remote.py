"""A job as another process sees and steers it (``twophase status``, ``stop``
and ``start-over``), through its state_dir and its ledger: how it is (its
ledger's lock, its heartbeat), a stop request and the wait for the job's exit
(the requests themselves: :mod:`lifecycle.control`), and a start-over request
for its next run.

The ledger is found as :func:`lifecycle.ledger.locate` says (``ledger``: the
job's ``ledger=``, else the state_dir's record). A URI state_dir is read and
written through the state store, in a JVM of the command's own that starts only
when a file of the state_dir is needed (:func:`lifecycle.state.store.open_store`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle import control, heartbeat
from lifecycle import status as status_view
from lifecycle.ledger import (
    check_location,
    is_locked,
    locate,
    new_state_advice,
    read_ledger,
    stored_location,
)
from lifecycle.state.pg_location import PgLocation
from lifecycle.state.store import open_store
from lifecycle.state.store_interface import StateStore
from sinks.errors import ConfigError
from sinks.naming import check_incarnation


def shown_location(ledger: str) -> str:
    """A ``--ledger`` value (the job's ``ledger=``) as messages show it: a
    PostgreSQL URI without its password, or a directory."""
    where = check_location(ledger)
    return PgLocation.parse(where).display() if isinstance(where, str) else str(where)


def current_status(
    state_dir: str | None,
    ledger: str | None,
    doc: Mapping[str, Any],
    *,
    stuck_after: float | None = None,
) -> dict[str, Any]:
    """The status (:func:`lifecycle.status.job_status`) of the job whose ledger
    document is ``doc``: with its heartbeat (from ``state_dir``, when given)
    and whether a job holds its ledger now."""
    beat = heartbeat.read(open_store(state_dir, None)) if state_dir is not None else None
    try:
        locked = is_locked(state_dir, ledger)
    except Exception:  # a ledger this command cannot lock-test (e.g. on another host)
        locked = False
    return status_view.job_status(doc, beat, locked=locked, stuck_after=stuck_after)


@dataclass(frozen=True)
class StopAsked:
    """A stop asked of the job running on a state_dir."""

    where: str | Path | StateStore
    """where the job's ledger is (:func:`lifecycle.ledger.locate`)"""
    request: control.StopRequest

    @property
    def kind(self) -> str:
        """The kind of checkpoint the stop commits: ``final`` (a drain) or
        ``savepoint``."""
        return "final" if self.request.drain else "savepoint"


def ask_to_stop(state_dir: str, ledger: str | None, *, drain: bool) -> StopAsked | None:
    """Ask the job running on ``state_dir`` to stop (a request file); None when
    no job runs there (found before any JVM a URI state_dir needs)."""
    where = locate(state_dir, ledger)
    if not is_locked(location=where):
        return None
    req = control.write_request(
        open_store(state_dir, None), drain=drain, source=f"twophase stop (pid {os.getpid()})"
    )
    return StopAsked(where, req)


def wait_for_exit(asked: StopAsked, timeout: float) -> bool:
    """Wait until the job asked to stop lets its ledger go; False when it did
    not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while is_locked(location=asked.where):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def stop_checkpoint(asked: StopAsked) -> dict[str, Any] | None:
    """The checkpoint the stop committed, from the exited job's ledger: its last
    one when it is of the stop's kind (or final), committed after the request,
    with nothing left pending or decided; None when the job exited without."""
    doc = read_ledger(location=asked.where) or {}
    last: dict[str, Any] | None = (doc.get("history") or [None])[-1]
    ok = (
        last is not None
        and last["kind"] in (asked.kind, "final")
        and (last.get("committed_at") or 0) >= asked.request.requested_at
        and not doc.get("pending")
        and doc.get("decided") is None
    )
    return last if ok else None


def request_start_over(state_dir: str, incarnation: str, ledger: str | None = None) -> None:
    """Record an operator's choice: the next run on ``state_dir`` takes every
    sink over from incarnation ``incarnation``. Raises :class:`ConfigError`
    when that is not an incarnation id, or is the state's own."""
    check_incarnation(incarnation)
    doc = read_ledger(state_dir, ledger)
    if doc is not None and doc.get("incarnation") == incarnation:
        advice = new_state_advice(ledger or stored_location(state_dir))
        raise ConfigError(
            f"{incarnation} is the incarnation of {state_dir} itself; starting "
            f"over from it needs {advice}"
        )
    control.request_start_over(
        open_store(state_dir, None), incarnation, source=f"twophase (pid {os.getpid()})"
    )
