"""Sweeps, the mechanism of recovery rule 4 and of the sweep after each
checkpoint (both stated in :mod:`lifecycle.coordinator`): the sinks abort the
transactions no ledger entry owns. :meth:`Sweeper.after_commit` runs after
each commit, where each sink also forgets what it committed and learns which
batches are settled and which audit evidence the ledger no longer keeps;
:meth:`Sweeper.unowned` runs at recovery and when a drain restarts a query.
"""

from __future__ import annotations

import functools
from collections.abc import Collection

from lifecycle.job_sinks import JobSinks, by_target, sink_label
from lifecycle.ledger import Ledger
from sinks._parallel import raise_first, run_all
from sinks.base import Committable, Committer
from sinks.capabilities import RetiresEvidence
from sinks.naming import TxnName


class Sweeper:
    """Sweeps the sinks of ``sinks`` in run ``run`` (module docstring)."""

    def __init__(self, ledger: Ledger, sinks: JobSinks, run: int) -> None:
        self.ledger = ledger
        self.run = run
        self._sinks = sinks
        self._retired: dict[str, int] = {}  # sink label -> the last floor told (retire)

    def after_commit(
        self,
        groups: dict[tuple[str, str], list[Committable]],
        cut: dict[str, int],
        finished: Collection[str] = (),
    ) -> None:
        """After a commit: each sink forgets what it committed, then every sink
        aborts its orphans of batches at or below ``cut`` and of earlier runs,
        and learns that those batches are settled (``LeasesIds.settled``: the
        Kafka sink's pooled ids of them may be reused); sinks of different targets at
        once, like the commit. Sinks of ``finished`` pipelines (their last
        checkpoint in this run) are not told: their queries lease nothing any
        more, so asking the broker which ids to give back would only delay the
        end of the run (a lease that comes anyway, for a batch written again,
        takes a lane of its own; every lane is free again at the next start)."""
        owned = self.ledger.is_owned
        run = self.run
        job_sinks = self._sinks
        sinks = job_sinks.every()

        def settle(key: tuple[str, str]) -> list[str]:
            p, sid = key
            committer = sinks[key].committer()
            if key in groups:
                committer.forget(groups[key])
            self._retire_evidence(p, sid, committer)
            last = cut.get(p, -1)

            def is_orphan(n: TxnName) -> bool:
                return not owned(str(n)) and (n.run < run or n.batch_id <= last)

            swept = committer.sweep(job_sinks.scope(p, sid), is_orphan)
            if p not in finished:
                job_sinks.settled(p, sid, last)
            return swept

        def lane(keys: list[tuple[str, str]]) -> list[list[str]]:
            return [settle(k) for k in keys]  # an error ends the lane, as it ended the sweep

        lanes = list(by_target(sinks, sinks).values())
        calls = [functools.partial(lane, keys) for keys in lanes]
        outcomes = run_all(calls, limit=job_sinks.commit_parallelism, name="twophase-sweep")
        for keys, done in zip(lanes, outcomes, strict=True):
            for (p, sid), swept in zip(keys, done.value or [], strict=False):
                job_sinks.tell("swept", p, sid, swept)
        raise_first(outcomes)

    def _retire_evidence(self, p: str, sid: str, committer: Committer) -> None:
        """Tell ``committer`` which of its batches the ledger no longer keeps
        audit evidence of (once per change of that floor), when it keeps
        records for audits (:class:`~sinks.capabilities.RetiresEvidence`)."""
        if not isinstance(committer, RetiresEvidence):
            return
        label = sink_label(p, sid)
        floor = self.ledger.evidence_floor(label)
        kept_from = floor if floor is not None else self.ledger.committed_cut(p) + 1
        if self._retired.get(label) != kept_from:
            committer.retire_evidence(self._sinks.scope(p, sid), kept_from)
            self._retired[label] = kept_from

    def unowned(self, pipelines: Collection[str]) -> None:
        """Rule 4 for ``pipelines``: abort every transaction of theirs that no
        ledger entry owns."""
        owned = self.ledger.is_owned
        for p in pipelines:
            for sid, sink in self._sinks.pipeline(p).sinks.items():
                scope = self._sinks.scope(p, sid)
                swept = sink.committer().sweep(scope, lambda n: not owned(str(n)))
                self._sinks.tell("swept", p, sid, swept)
