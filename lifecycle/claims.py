"""Claims on the sinks, read from and recorded in the targets themselves
(:mod:`sinks.progress`; when they are taken: :mod:`lifecycle.coordinator`):
this incarnation takes every sink's scope, or the job refuses when another
incarnation owns one; and after recovery, a sink that holds more of this
incarnation's batches than the ledger recorded refuses the start.
"""

from __future__ import annotations

import logging

from lifecycle.errors import RecoveryRefusedError
from lifecycle.job_sinks import JobSinks
from lifecycle.ledger import Ledger
from sinks.base import JobScope
from sinks.progress import SinkProgress, claim_order, conflict

log = logging.getLogger("lifecycle.coordinator")  # the coordinator's own messages


def claim_sinks(sinks: JobSinks, start_over_from: str | None = None) -> None:
    """Make this incarnation the owner of every sink's scope, in the target
    systems, before anything is written or committed (see :mod:`sinks.progress`).

    Every sink is read first: when one is held by another incarnation (and
    it is not ``start_over_from``), the job refuses and nothing is claimed,
    written or committed. Claims are then taken in one global order. A
    start-over aborts what the old incarnation left prepared in the sink."""
    order = sorted(
        ((p, sid, sink) for p, ps in sinks.pipelines.items() for sid, sink in ps.sinks.items()),
        key=lambda t: claim_order(t[2].describe(), sinks.scope(t[0], t[1]).key()),
    )
    for p, sid, sink in order:
        scope = sinks.scope(p, sid)
        found = sink.committer().progress(scope)
        if found.owner not in (None, sinks.incarnation, start_over_from):
            raise conflict(sink.describe(), scope.key(), found, sinks.incarnation)
    for p, sid, sink in order:
        scope = sinks.scope(p, sid)
        claimed = sink.committer().claim(scope, start_over_from=start_over_from)
        if claimed.previous is not None and claimed.previous == start_over_from:
            old = JobScope(sinks.job, p, sid, start_over_from)
            aborted = sink.committer().sweep(old, lambda n: n.incarnation == start_over_from)
            sinks.tell("swept", p, sid, aborted)
            log.warning(
                "%s: started over from incarnation %s (an operator's choice, recorded "
                "in the target); aborted %d transaction(s) it left prepared",
                sink.describe(),
                start_over_from,
                len(aborted),
            )


def check_sinks_behind_ledger(sinks: JobSinks, ledger: Ledger, new_state: str) -> None:
    """After recovery, no sink may hold more of this incarnation's batches
    than the ledger recorded as committed: if one does, the ledger is older
    than the target (restored from an older copy) and would replay batches
    the target holds. ``new_state``: how the job gets a new state (see
    :func:`lifecycle.ledger.new_state_advice`)."""
    for p, ps in sinks.pipelines.items():
        cut = ledger.committed_cut(p)
        for sid, sink in ps.sinks.items():
            found: SinkProgress = sink.committer().progress(sinks.scope(p, sid))
            if found.held_by(sinks.incarnation) and found.batch > cut:
                raise RecoveryRefusedError(
                    f"{sink.describe()} holds batch {found.batch} of pipeline {p!r} "
                    f"committed by this job's incarnation {sinks.incarnation}, but the "
                    f"ledger records commits only up to batch {cut}: the state_dir (or "
                    "ledger) was restored from an older copy, and Spark would replay "
                    "batches the target holds. Restore the newest state, or start over "
                    f"with {new_state} and Job(start_over_from="
                    f"{sinks.incarnation!r})."
                )
