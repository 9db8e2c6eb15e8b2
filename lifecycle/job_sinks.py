"""A job's sinks as the coordinator reaches them: looked up by pipeline and sink
id (refusing work of a pipeline or sink the job no longer has), committed in
lanes (one per target: sinks of different targets at once, sinks of one target
one after another), and every move made on them told to the observer and the
metrics (see :data:`Observer`).

The coordinator (:mod:`lifecycle.coordinator`), its sweeps
(:mod:`lifecycle.sweep`), claims (:mod:`lifecycle.claims`) and debts
(:mod:`lifecycle.debts`) all reach the sinks through one :class:`JobSinks`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lifecycle.errors import RecoveryRefusedError
from lifecycle.metrics import JobMetrics
from lifecycle.spark_log import SparkCommitLog
from sinks import _retry
from sinks._parallel import run_all
from sinks.base import Committable, Committer, JobScope, Sink
from sinks.capabilities import LeasesIds


@dataclass
class PipelineSinks:
    """What the coordinator knows of one pipeline."""

    name: str
    sinks: dict[str, Sink]
    commit_log: SparkCommitLog

    @property
    def deferred(self) -> bool:
        """Whether the pipeline commits only at the checkpoint that finishes it
        (a sink of it replaces, :attr:`sinks.base.Sink.commits_at_finish`)."""
        return any(s.commits_at_finish for s in self.sinks.values())


def by_target(
    sinks: dict[tuple[str, str], Sink], keys: Iterable[tuple[str, str]]
) -> dict[str, list[tuple[str, str]]]:
    """``keys`` (pipeline, sink id) in lanes, one per target (``describe()``),
    in their order: what one lane holds is done one after another."""
    lanes: dict[str, list[tuple[str, str]]] = {}
    for key in keys:
        lanes.setdefault(sinks[key].describe(), []).append(key)
    return lanes


def sink_label(pipeline: str, sink_id: str) -> str:
    """How a sink is named in results, totals and the ledger."""
    return f"{pipeline}/{sink_id}"


def count_rows(committables: Iterable[Committable]) -> int:
    """The rows ``committables`` hold."""
    return sum(int(c.get("rows", 0)) for c in committables)


_RULES = {"aborted": "abort_replayed", "swept": "sweep_orphans", "skipped": "skip_abandoned"}
"""The recovery rule a move on a sink follows (see :mod:`lifecycle.metrics`).
Commits follow one only in recovery: ``commit_decided`` when a checkpoint
decided before a stop is finished, ``commit_completed`` in a checkpoint of kind
``recovery`` (see ``Coordinator._commit``)."""

Shares = dict[tuple[str, str], dict[int, list[Committable]]]
"""per (pipeline, sink id), the committables of each batch (ascending)"""

Observer = Callable[[str, str, list[str]], None]
"""Told ``(what, sink label, transaction names)`` of every move the coordinator
makes on a sink: ``committed``, ``aborted`` (pending work dropped),
``swept`` (orphans aborted) and ``skipped`` (abandoned by an operator)."""


class JobSinks:
    """The sinks of every pipeline of job ``job`` in incarnation ``incarnation``
    (module docstring). ``observer`` and ``metrics``: told of every move;
    ``commit_parallelism``: how many lanes (targets) are worked at once."""

    def __init__(
        self,
        job: str,
        incarnation: str,
        pipelines: Iterable[PipelineSinks],
        *,
        observer: Observer | None,
        metrics: JobMetrics,
        commit_parallelism: int,
    ) -> None:
        self.job = job
        self.incarnation = incarnation
        self.pipelines = {p.name: p for p in pipelines}
        self.metrics = metrics
        self.commit_parallelism = commit_parallelism
        self._observer = observer

    def scope(self, pipeline: str, sink_id: str) -> JobScope:
        """The scope of a sink of this job, in this incarnation."""
        return JobScope(self.job, pipeline, sink_id, self.incarnation)

    def every(self) -> dict[tuple[str, str], Sink]:
        """Every sink of the job, per (pipeline, sink id)."""
        return {(p, sid): s for p, ps in self.pipelines.items() for sid, s in ps.sinks.items()}

    def pipeline(self, p: str) -> PipelineSinks:
        try:
            return self.pipelines[p]
        except KeyError:
            raise RecoveryRefusedError(
                f"pipeline {p!r} has uncommitted work but is not in this job"
            ) from None

    def sink(self, p: str, sid: str) -> Sink:
        sinks = self.pipeline(p).sinks
        if sid not in sinks:
            raise RecoveryRefusedError(
                f"pipeline {p!r} has uncommitted work for sink {sid!r}, which it no longer has "
                f"(its sinks: {sorted(sinks)}); add the sink back (same sink_id) to commit it"
            )
        return sinks[sid]

    def committer(self, p: str, sid: str) -> Committer:
        """The committer of a sink of this job (:meth:`sink`'s refusals)."""
        return self.sink(p, sid).committer()

    def settled(self, p: str, sid: str, through_batch: int) -> None:
        """Tell a sink's committer that its batches up to ``through_batch`` are
        decided and swept, when it leases what they used
        (:class:`~sinks.capabilities.LeasesIds`)."""
        committer = self.committer(p, sid)
        if isinstance(committer, LeasesIds):
            committer.settled(self.scope(p, sid), through_batch)

    def tell(
        self,
        what: str,
        pipeline: str,
        sink_id: str,
        txns: Iterable[str],
        rule: str | None = None,
    ) -> None:
        """Tell the observer and the metrics of a move on a sink (nothing when
        ``txns`` is empty); ``rule``: the recovery rule it follows, by default
        the one of ``what`` (:data:`_RULES`)."""
        names = sorted(txns)
        if not names:
            return
        if self._observer is not None:
            self._observer(what, sink_label(pipeline, sink_id), names)
        if rule is None:
            rule = _RULES.get(what)
        if rule is not None:
            self.metrics.recovery_action(rule, pipeline, sink_id, len(names))

    def abort_batch(
        self, p: str, sinks: dict[str, list[Committable]], rule: str | None = None
    ) -> None:
        """Abort the work of one batch of ``p`` (sink id -> committables)."""
        for sid, cs in sinks.items():
            if cs:
                self.committer(p, sid).abort(cs)
                self.tell("aborted", p, sid, (c["txn"] for c in cs), rule)

    def commit_counted(
        self, pipeline: str, sid: str, sink: Sink, committables: list[Committable]
    ) -> None:
        """The commit of ``committables`` by ``sink``'s committer, its retries
        counted in the metrics."""
        counting = _retry.on_retry.set(self.metrics.retried(pipeline, sid))
        try:
            sink.committer().commit(committables)
        finally:
            _retry.on_retry.reset(counting)

    def commit_all(
        self,
        groups: dict[tuple[str, str], list[Committable]],
        sinks: dict[tuple[str, str], Sink],
    ) -> dict[tuple[str, str], Exception]:
        """Commit every group, sinks of different targets concurrently (a bounded
        pool) and sinks of one target one after another (two pipelines writing
        one Delta table must not race for its next version); every sink is
        committed even when another fails. Returns the failures."""
        lanes = by_target(sinks, groups)

        def lane(keys: list[tuple[str, str]]) -> dict[tuple[str, str], Exception]:
            failed: dict[tuple[str, str], Exception] = {}
            for key in keys:
                try:
                    self.commit_counted(*key, sinks[key], groups[key])
                except Exception as e:
                    failed[key] = e
            return failed

        failed: dict[tuple[str, str], Exception] = {}
        calls = [functools.partial(lane, keys) for keys in lanes.values()]
        for done in run_all(calls, limit=self.commit_parallelism, name="twophase-commit"):
            assert done.value is not None  # a lane catches its sinks' errors
            failed.update(done.value)
        return {key: failed[key] for key in groups if key in failed}  # in the groups' order
