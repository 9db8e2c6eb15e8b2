"""The checkpoint coordinator: registers committables, takes checkpoints,
commits, and recovers. This module is where the recovery rules live.

Commit path: ``register`` (from the batch handler, before Spark may write its
commit-log entry) -> ``checkpoint`` (cut = highest Spark-completed pending
batch per pipeline; the decision is written to the ledger) -> each sink's
``commit`` (idempotent, retried; sinks of different targets at once, each
sink's transactions over a few connections) -> ``ledger.complete`` -> ``forget``
and a sweep of orphans at or below the cut. One checkpoint at a time: every
commit of checkpoint N has returned before any of N+1 starts.

Before recovery, ``claim_sinks`` makes this incarnation (the ledger's random
id) the owner of every sink's scope in the target itself, or refuses when
another incarnation owns one (see :mod:`sinks.progress`); nothing is written or
committed before.

Recovery rules (``recover``, run at every start before any query starts):

1. A decided checkpoint is finished first: its decision is final.
2. Pending batches that Spark completed (``commits/N`` exists, or the ledger
   recorded that it did: Spark writes ``commits/N`` without an fsync) commit,
   in a checkpoint of kind ``recovery``: Spark will never replay them.
3. Pending batches Spark did not complete are aborted and dropped: Spark
   replays them with the same batch id and the same rows.
4. Every prepared transaction of this job's sinks that no ledger entry owns is
   aborted (failed or speculative task attempts, a crash between prepare and
   registration, zombies of an earlier run).
5. Lost work is written again, never dropped. Before rules 1 and 2 commit
   any of a sink's share, the sink checks every transaction of it
   (``Sink.classify``). When one was lost before it committed (a Kafka
   transaction the broker aborted at its timeout, a prepared transaction
   someone rolled back, staged files a VACUUM removed), none of that sink's
   share from the first batch with a loss on commits: its surviving
   transactions are aborted, and those batches are recorded in the ledger as
   *owed* to the sink. The rest of the checkpoint commits, so the decision is
   final for every other sink, and for this one up to the loss. The job then
   writes each owed batch again, to the owing sinks only, from its source
   with its original offsets, before any new batch (:mod:`lifecycle.replay`).
   A loss found when part of the owed batches committed already stops the job
   as before (a ``CheckpointCommitError`` whose cause is
   ``TransactionLostError``): writing them again would duplicate that part.
   Only a coordinator made with ``replay_lost`` (the job's) applies this rule;
   ``twophase recover``, which cannot run the source, reports the loss.

During a run, each checkpoint also sweeps orphans of batches at or below its
cut, and of earlier runs, so late zombies do not linger until the next start.
When a drain stops a query and starts it again in the same run,
``reset_pipeline`` applies rules 3 and 4 to that pipeline alone.

History is guarded (``admit``, ``register``): a batch at or below the last
committed cut of its pipeline is never registered or committed again; when
Spark plans one again, it is recognised as done if its source offsets match the
digest the ledger recorded, and refused otherwise.

Abandonments: a transaction of the decided checkpoint that is lost (its commit
raises ``TransactionLostError``) makes every commit of that checkpoint fail,
so the job cannot run again. An operator may abandon it (``twophase abandon``,
recorded in the ledger with ``record_abandoned``); committing that checkpoint
then skips the abandoned transactions, so the rest commits and it completes.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from lifecycle.errors import CheckpointCommitError, RecoveryRefusedError
from lifecycle.failures import cause_of, full_trace
from lifecycle.ledger import Checkpoint, Ledger
from lifecycle.metrics import JobMetrics
from lifecycle.spark_log import SparkCommitLog
from sinks import _faults, _retry
from sinks._parallel import raise_first, run_all
from sinks.base import COMMITTED, LOST, PREPARED, Committable, JobScope, Sink
from sinks.errors import CommitRefusedError, ConfigError, TransactionLostError
from sinks.naming import TxnName
from sinks.progress import SinkProgress, claim_order, conflict

log = logging.getLogger("lifecycle.coordinator")


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


def _by_target(
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


class Coordinator:
    """Lives in the driver; one per job run. ``observer``: told of every move on a
    sink (see :data:`Observer`). ``new_state``: how the job gets a new state, for
    refusals that suggest one (see :func:`lifecycle.ledger.new_state_advice`).
    ``commit_parallelism``: how many sinks (of different targets) a checkpoint
    commits at once. ``metrics``: told of registrations, checkpoints, retries and
    recovery actions. ``replay_lost``: apply recovery rule 5 (the job writes owed
    batches again; without it a loss fails the commit)."""

    def __init__(
        self,
        job: str,
        ledger: Ledger,
        pipelines: Iterable[PipelineSinks],
        *,
        observer: Observer | None = None,
        new_state: str = "a new state_dir",
        commit_parallelism: int = 4,
        metrics: JobMetrics | None = None,
        replay_lost: bool = False,
    ) -> None:
        self.job = job
        self.replay_lost = replay_lost
        self.commit_parallelism = commit_parallelism
        self.ledger = ledger
        self.new_state = new_state
        self.pipelines = {p.name: p for p in pipelines}
        self.run = ledger.run
        self.incarnation = ledger.incarnation
        self._checkpointing = threading.Lock()  # one checkpoint at a time
        self.checkpoints_taken: list[Checkpoint] = []
        self._observer = observer
        self._early: str | None = None  # why the next checkpoint should not wait
        self.metrics = metrics or JobMetrics(job)
        self.progress_note: Callable[[], str] | None = None
        self._retired: dict[str, int] = {}  # sink label -> the last floor told (retire)
        """what the checkpoint log line adds (the progress of bounded pipelines)"""

    def _tell(
        self,
        what: str,
        pipeline: str,
        sink_id: str,
        txns: Iterable[str],
        rule: str | None = None,
    ) -> None:
        names = sorted(txns)
        if not names:
            return
        if self._observer is not None:
            self._observer(what, sink_label(pipeline, sink_id), names)
        if rule is None:
            rule = _RULES.get(what)
        if rule is not None:
            self.metrics.recovery_action(rule, pipeline, sink_id, len(names))

    def scope(self, pipeline: str, sink_id: str) -> JobScope:
        """The scope of a sink of this job, in this incarnation."""
        return JobScope(self.job, pipeline, sink_id, self.incarnation)

    # -- claims (at start, before any data moves) -----------------------------------

    def claim_sinks(self, start_over_from: str | None = None) -> None:
        """Make this incarnation the owner of every sink's scope, in the target
        systems, before anything is written or committed (see :mod:`sinks.progress`).

        Every sink is read first: when one is held by another incarnation (and
        it is not ``start_over_from``), the job refuses and nothing is claimed,
        written or committed. Claims are then taken in one global order. A
        start-over aborts what the old incarnation left prepared in the sink."""
        order = sorted(
            ((p, sid, sink) for p, ps in self.pipelines.items() for sid, sink in ps.sinks.items()),
            key=lambda t: claim_order(t[2].describe(), self.scope(t[0], t[1]).key()),
        )
        for p, sid, sink in order:
            scope = self.scope(p, sid)
            found = sink.progress(scope)
            if found.owner not in (None, self.incarnation, start_over_from):
                raise conflict(sink.describe(), scope.key(), found, self.incarnation)
        for p, sid, sink in order:
            scope = self.scope(p, sid)
            claimed = sink.claim(scope, start_over_from=start_over_from)
            if claimed.previous is not None and claimed.previous == start_over_from:
                old = JobScope(self.job, p, sid, start_over_from)
                aborted = sink.abort_lingering(old, lambda n: n.incarnation == start_over_from)
                self._tell("swept", p, sid, aborted)
                log.warning(
                    "%s: started over from incarnation %s (an operator's choice, recorded "
                    "in the target); aborted %d transaction(s) it left prepared",
                    sink.describe(),
                    start_over_from,
                    len(aborted),
                )

    def check_sinks_behind_ledger(self) -> None:
        """After recovery, no sink may hold more of this incarnation's batches
        than the ledger recorded as committed: if one does, the ledger is older
        than the target (restored from an older copy) and would replay batches
        the target holds."""
        for p, ps in self.pipelines.items():
            cut = self.ledger.committed_cut(p)
            for sid, sink in ps.sinks.items():
                found: SinkProgress = sink.progress(self.scope(p, sid))
                if found.held_by(self.incarnation) and found.batch > cut:
                    raise RecoveryRefusedError(
                        f"{sink.describe()} holds batch {found.batch} of pipeline {p!r} "
                        f"committed by this job's incarnation {self.incarnation}, but the "
                        f"ledger records commits only up to batch {cut}: the state_dir (or "
                        "ledger) was restored from an older copy, and Spark would replay "
                        "batches the target holds. Restore the newest state, or start over "
                        f"with {self.new_state} and Job(start_over_from="
                        f"{self.incarnation!r})."
                    )

    # -- registration (batch handler threads) -------------------------------------

    def admit(self, pipeline: str, batch_id: int) -> bool:
        """Whether Spark's batch ``batch_id`` of ``pipeline`` is new work.

        False when this job committed the batch already and Spark plans it again
        with the same offsets (its ``commits/N`` was lost, or an older Spark
        checkpoint was restored): the batch is recognised as done and not
        written. Raises :class:`RecoveryRefusedError` when the batch was
        committed with other offsets, or its offsets are no longer known."""
        cut = self.ledger.committed_cut(pipeline)
        if batch_id > cut:
            return True
        planned = self._pipeline(pipeline).commit_log.offsets_digest(batch_id)
        recorded = self.ledger.committed_digest(pipeline, batch_id)
        if recorded is not None and planned == recorded:
            log.warning(
                "batch %d of %s was committed before (Spark lost its commit-log entry, or "
                "an older Spark checkpoint was restored) and is planned with the same "
                "offsets: recognised as done, not written again",
                batch_id,
                pipeline,
            )
            return False
        why = (
            "with other source offsets than the committed one"
            if recorded is not None
            else "and the ledger no longer knows its offsets to compare"
        )
        raise RecoveryRefusedError(
            f"Spark plans batch {batch_id} of pipeline {pipeline!r} again, {why}, but this "
            f"job committed batches up to {cut} already: its Spark checkpoint was restored "
            "from an older copy or replaced. Writing it would duplicate or mix output. "
            "Restore the pipeline's newest Spark checkpoint (under the state_dir), or start "
            f"over with {self.new_state}."
        )

    def register(
        self, pipeline: str, batch_id: int, committables: dict[str, list[Committable]]
    ) -> None:
        """Durably record every committable of (pipeline, batch) before the batch
        handler returns, i.e. before Spark writes ``commits/<batch_id>``."""
        if batch_id <= self.ledger.committed_cut(pipeline):
            raise RecoveryRefusedError(
                f"batch {batch_id} of {pipeline!r} is at or below the last committed batch "
                f"({self.ledger.committed_cut(pipeline)}); it is never registered again"
            )
        stale = self.ledger.pending_batch(pipeline, batch_id)
        if stale:
            # Spark re-ran a batch we already registered: the earlier attempt's
            # work is superseded (Spark never completed it).
            log.warning(
                "batch %d of %s re-run by Spark: aborting its earlier attempt", batch_id, pipeline
            )
            self._abort_batch(pipeline, stale, rule="abort_rerun")
        digest = self._pipeline(pipeline).commit_log.offsets_digest(batch_id)
        at = round(time.time(), 3)
        for cs in committables.values():
            for c in cs:
                c["registered_at"] = at  # the age of pending work (status, metrics)
        self.ledger.record_batch(pipeline, batch_id, committables, digest)
        self.metrics.prepared(pipeline, committables)
        self._pending_changed()
        for sid, cs in committables.items():
            reason = self._sink(pipeline, sid).checkpoint_pressure(cs)
            if reason is not None:
                self._early = reason

    def take_early_checkpoint(self) -> str | None:
        """Why a sink asked for the next checkpoint now (see
        :meth:`sinks.base.Sink.checkpoint_pressure`), once; None if none did."""
        reason, self._early = self._early, None
        return reason

    def abort_unregistered(self, pipeline: str, committables: dict[str, list[Committable]]) -> None:
        """Abort work of a batch that failed before registration (best effort)."""
        try:
            self._abort_batch(pipeline, committables)
        except Exception:
            log.exception(
                "could not abort the work of a failed batch of %s; the next "
                "checkpoint or start sweeps it",
                pipeline,
            )

    # -- checkpoints ----------------------------------------------------------------

    def completed_cut(
        self, only: Iterable[str] | None = None, finishing: Collection[str] = ()
    ) -> dict[str, int]:
        """Per pipeline (of ``only``, default all), the highest pending batch that
        Spark has completed. A deferred pipeline (:attr:`PipelineSinks.deferred`)
        is in the cut only when the checkpoint finishes it (``finishing``): until
        then its batches stay pending, also across restarts."""
        keep = set(only) if only is not None else None
        cut: dict[str, int] = {}
        for p in self.ledger.pending_pipelines():
            if keep is not None and p not in keep:
                continue
            if p in self.pipelines and self.pipelines[p].deferred and p not in finishing:
                continue
            latest = self._spark_completed(p)
            done = [b for b in self.ledger.pending_batch_ids(p) if b <= latest]
            if done:
                cut[p] = max(done)
        return cut

    def checkpoint(
        self,
        kind: str = "periodic",
        finished: Iterable[str] = (),
        only: Iterable[str] | None = None,
    ) -> Checkpoint | None:
        """Take a checkpoint of everything Spark has completed (in the pipelines
        ``only``, default all) and commit it; ``finished`` pipelines are recorded
        as finished by it.

        Returns None when a periodic or recovery checkpoint would commit nothing
        and finish nothing (then nothing is recorded); final and savepoint
        checkpoints are always recorded."""
        finished = sorted(set(finished) - self.ledger.finished())
        with self._checkpointing:
            cut = self.completed_cut(only, finishing=finished)
            if not cut and not finished and kind in ("periodic", "recovery"):
                return None
            started = time.monotonic()
            cp = self.ledger.decide(kind, cut, finished)
            return self._commit(cp, started)

    def shares(self, cp: Checkpoint, *, abandoned: bool = False) -> Shares:
        """The pending committables checkpoint ``cp`` commits, per (pipeline,
        sink id) and batch: those of every pending batch at or below its cut,
        without the transactions abandoned in it (only those, with
        ``abandoned``) and without the batches a sink owes from (rule 5: from
        its first owed batch on, a sink commits nothing before it is paid)."""
        skip = self.ledger.abandoned_txns(cp.id)
        owes_from = self._owes_from()
        shares: Shares = {}
        for p, last in cp.cut.items():
            for b in self.ledger.pending_batch_ids(p):  # ascending
                if b > last:
                    break
                for sid, cs in (self.ledger.pending_batch(p, b) or {}).items():
                    share = shares.setdefault((p, sid), {})
                    if b >= owes_from.get((p, sid), b + 1) and not abandoned:
                        continue
                    share[b] = [c for c in cs if (c.get("txn") in skip) == abandoned]
        return shares

    def _owes_from(self) -> dict[tuple[str, str], int]:
        """Per (pipeline, sink id) that owes batches, its lowest owed batch."""
        first: dict[tuple[str, str], int] = {}
        for p, batches in self.ledger.owed().items():
            for b, sinks in batches.items():
                for sid in sinks:
                    first[(p, sid)] = min(first.get((p, sid), b), b)
        return first

    def committables_of(
        self, cp: Checkpoint, *, abandoned: bool = False
    ) -> dict[tuple[str, str], list[Committable]]:
        """The committables of :meth:`shares`, per (pipeline, sink id)."""
        return {
            key: [c for cs in batches.values() for c in cs]
            for key, batches in self.shares(cp, abandoned=abandoned).items()
        }

    def _commit(
        self, cp: Checkpoint, started: float | None = None, rule: str | None = None
    ) -> Checkpoint:
        """Commit a decided checkpoint. Safe to call again after a crash.
        ``rule``: the recovery rule the commits follow (metrics), by default
        ``commit_completed`` for a checkpoint of kind ``recovery``, else none.

        Every sink is committed even when one fails (the decision is final, so
        committing the others is what a restart would do anyway); then
        :class:`CheckpointCommitError` names the sinks that failed, and the
        checkpoint stays decided in the ledger for the next start. Transactions
        an operator abandoned in this checkpoint are skipped."""
        if rule is None and cp.kind == "recovery":
            rule = "commit_completed"
        self._extend_debts(cp)
        if rule is not None and self.replay_lost:
            self._owe_lost(cp)  # rule 5
        groups = self.committables_of(cp)
        abandoned = (
            self.committables_of(cp, abandoned=True) if self.ledger.abandoned_txns(cp.id) else {}
        )
        for (p, sid), cs in abandoned.items():
            if cs:
                log.warning(
                    "checkpoint %d: skipping %d transaction(s) of %s abandoned by an operator "
                    "(twophase abandon): %s",
                    cp.id,
                    len(cs),
                    sink_label(p, sid),
                    [c["txn"] for c in cs][:5],
                )
                self._tell("skipped", p, sid, (c["txn"] for c in cs))
        started = time.monotonic() if started is None else started
        sinks = {key: self._sink(*key) for key in groups}
        _faults.hit("driver.before_commit", batch=max(cp.cut.values(), default=None))
        failed = self._commit_sinks(groups, sinks)
        rows: dict[str, int] = {}
        for (p, sid), cs in groups.items():
            if (p, sid) not in failed:
                rows[sink_label(p, sid)] = _rows(cs)
                self._tell("committed", p, sid, (c["txn"] for c in cs), rule)
        if failed:
            self.metrics.checkpoint_failed(cp.kind, time.monotonic() - started)
            raise self._commit_error(cp, failed, sinks)
        evidence = {
            sink_label(p, sid): [sinks[(p, sid)].evidence(c) for c in cs]
            for (p, sid), cs in groups.items()
            if cs
        }
        done = self.ledger.complete(cp, rows, evidence)
        self.checkpoints_taken.append(done)
        self.metrics.checkpoint_committed(
            cp.kind, time.monotonic() - started, groups, done.committed_at or time.time()
        )
        self._pending_changed()
        note = self.progress_note() if self.progress_note is not None else ""
        log.info(
            "checkpoint %d (%s) committed: cut %s, rows %s%s",
            cp.id,
            cp.kind,
            cp.cut,
            rows,
            f"; {note}" if note else "",
        )
        self._forget_and_sweep(groups, cp.cut)
        return done

    def _extend_debts(self, cp: Checkpoint) -> None:
        """Rule 5, kept: a sink that owes batches commits none after its first
        owed one before it is paid (its progress would then hold the owed
        batches, and the sink would refuse them as replays). Its work of later
        batches of ``cp`` is aborted and those batches are owed too."""
        for (p, sid), first in sorted(self._owes_from().items()):
            owed = self.ledger.owed().get(p, {})
            later: dict[int, list[Committable]] = {}
            for b in self.ledger.pending_batch_ids(p):
                if first < b <= cp.cut.get(p, -1) and sid not in owed.get(b, {}):
                    later[b] = (self.ledger.pending_batch(p, b) or {}).get(sid, [])
            if not later:
                continue
            self.ledger.record_owed(p, {b: {sid: _rows(cs)} for b, cs in later.items()})
            work = [c for cs in later.values() for c in cs]
            if work:
                self._sink(p, sid).abort(work)
            self.metrics.recovery_action("owe_lost", p, sid, len(work))
            log.warning(
                "%s owes batch %d of pipeline %s: its later batch(es) %s are owed too, "
                "written again after it",
                self._sink(p, sid).describe(),
                first,
                p,
                sorted(later),
            )

    def _owe_lost(self, cp: Checkpoint) -> None:
        """Rule 5 for decided checkpoint ``cp``: per sink, when a transaction of
        its share was lost before it committed, record the batches from the
        first one with a loss on as owed to the sink and abort the rest of its
        work of them, unless any of it committed already or an operator
        abandoned some of it (the commit then reports the loss)."""
        abandoned = self.ledger.abandoned_txns(cp.id)
        for (p, sid), batches in self.shares(cp).items():
            sink = self._sink(p, sid)
            work = [c for cs in batches.values() for c in cs]
            if sink.commits_at_finish or not work or sink.cannot_have_lost(work):
                continue  # a replace commits its whole backfill at once: no batch to owe
            try:
                verdicts = sink.classify(work)
            except NotImplementedError:
                continue  # the commit finds a loss out
            lost = [
                b for b, cs in batches.items() if any(verdicts.get(c["txn"]) == LOST for c in cs)
            ]
            if not lost:
                continue
            owed = [b for b in batches if b >= min(lost)]
            work = [c for b in owed for c in batches[b]]
            done = [c["txn"] for c in work if verdicts.get(c["txn"]) == COMMITTED]
            given_up = [
                t
                for b in owed
                for c in (self.ledger.pending_batch(p, b) or {}).get(sid, [])
                if (t := c.get("txn")) in abandoned
            ]
            if done or given_up:
                log.error(
                    "%s: transactions of batch(es) %s of %s were lost, and %s: writing them "
                    "again would duplicate or restore that, so the loss stops the job",
                    sink.describe(),
                    lost,
                    p,
                    f"{len(done)} of that work committed already ({done[:3]})"
                    if done
                    else f"an operator abandoned {len(given_up)} transaction(s) of it",
                )
                continue
            self.ledger.record_owed(p, {b: {sid: _rows(batches[b])} for b in owed})
            alive = [c for c in work if verdicts.get(c["txn"]) == PREPARED]
            if alive:
                sink.abort(alive)
            self.metrics.recovery_action("owe_lost", p, sid, len(work))
            log.warning(
                "%s lost its transaction(s) of batch(es) %s of pipeline %s before they "
                "committed (%s); batch(es) %s (%d row(s)) are owed to it: written again from "
                "the source before any new batch",
                sink.describe(),
                lost,
                p,
                ", ".join(c["txn"] for c in work if verdicts.get(c["txn"]) == LOST)[:300],
                owed,
                _rows(work),
            )

    def repay(self, pipeline: str, batch_id: int, work: dict[str, list[Committable]]) -> None:
        """Commit ``work`` (sink id -> committables), the owed batch
        ``batch_id`` of ``pipeline`` written again (rule 5), recorded in the
        ledger first (so that after a crash its commit is finished, never run
        twice); then record it repaid, and the sinks forget their bookkeeping."""
        with self._checkpointing:
            self.ledger.record_repaying(pipeline, batch_id, work)
            _faults.hit("driver.before_repay", batch=batch_id)
            self._finish_repay(pipeline, batch_id, work)

    def finish_repay(self, pipeline: str, batch_id: int) -> bool:
        """After a restart: settle the work recorded as writing owed batch
        ``batch_id`` of ``pipeline`` again. Returns True when every owing sink
        holds the batch now (its work committed, or committed here); False when
        none of the work is kept (it was swept or lost) and the batch is to be
        written again. Raises :class:`TransactionLostError` when part of it
        committed and part is lost."""
        with self._checkpointing:
            work = self.ledger.owed_work(pipeline, batch_id)
            owing = self.ledger.owed().get(pipeline, {}).get(batch_id, {})
            if not work or set(work) != set(owing):
                return False
            verdicts: dict[str, str] = {}
            for sid, cs in work.items():
                verdicts.update(self._sink(pipeline, sid).classify(cs) if cs else {})
            if LOST in verdicts.values():
                if COMMITTED in verdicts.values():
                    raise TransactionLostError(
                        f"batch {batch_id} of pipeline {pipeline!r}, written again for sink(s) "
                        f"{sorted(work)}, committed in part and lost in part: writing it again "
                        "would duplicate the committed part"
                    )
                for sid, cs in work.items():
                    self._sink(pipeline, sid).abort(cs)
                return False
            self._finish_repay(pipeline, batch_id, work)
            return True

    def _finish_repay(
        self, pipeline: str, batch_id: int, work: dict[str, list[Committable]]
    ) -> None:
        for sid, cs in work.items():
            self._commit_counted(pipeline, sid, self._sink(pipeline, sid), cs)
            self._tell("committed", pipeline, sid, (c["txn"] for c in cs), "repay_owed")
        self.ledger.record_repaid(pipeline, batch_id, {sid: _rows(cs) for sid, cs in work.items()})
        for sid, cs in work.items():
            self._sink(pipeline, sid).forget(cs)
            self._sink(pipeline, sid).settled(self.scope(pipeline, sid), batch_id)

    def _commit_sinks(
        self,
        groups: dict[tuple[str, str], list[Committable]],
        sinks: dict[tuple[str, str], Sink],
    ) -> dict[tuple[str, str], Exception]:
        """Commit every group, sinks of different targets concurrently (a bounded
        pool) and sinks of one target one after another (two pipelines writing
        one Delta table must not race for its next version); every sink is
        committed even when another fails. Returns the failures."""
        lanes = _by_target(sinks, groups)

        def lane(keys: list[tuple[str, str]]) -> dict[tuple[str, str], Exception]:
            failed: dict[tuple[str, str], Exception] = {}
            for key in keys:
                try:
                    self._commit_counted(*key, sinks[key], groups[key])
                except Exception as e:
                    failed[key] = e
            return failed

        failed: dict[tuple[str, str], Exception] = {}
        calls = [functools.partial(lane, keys) for keys in lanes.values()]
        for done in run_all(calls, limit=self.commit_parallelism, name="twophase-commit"):
            assert done.value is not None  # a lane catches its sinks' errors
            failed.update(done.value)
        return {key: failed[key] for key in groups if key in failed}  # in the groups' order

    def _commit_counted(
        self, pipeline: str, sid: str, sink: Sink, committables: list[Committable]
    ) -> None:
        """``sink.commit(committables)``, its retries counted in the metrics."""
        counting = _retry.on_retry.set(self.metrics.retried(pipeline, sid))
        try:
            sink.commit(committables)
        finally:
            _retry.on_retry.reset(counting)

    def _commit_error(
        self,
        cp: Checkpoint,
        failed: dict[tuple[str, str], Exception],
        sinks: dict[tuple[str, str], Sink],
    ) -> CheckpointCommitError:
        causes = {sink_label(*k): cause_of(e, sinks[k]) for k, e in failed.items()}
        trace = "\n\n".join(f"{sink_label(*k)}:\n{full_trace(e)}" for k, e in failed.items())
        # a target that refuses for good, or a table that no longer fits (a
        # ConfigError at commit): retrying as it is cannot pass
        refused = all(isinstance(e, (CommitRefusedError, ConfigError)) for e in failed.values())
        error = CheckpointCommitError(
            self.job, cp.id, cp.kind, causes, trace=trace, refused=refused
        )
        error.__cause__ = next(iter(failed.values()))
        return error

    def _forget_and_sweep(
        self, groups: dict[tuple[str, str], list[Committable]], cut: dict[str, int]
    ) -> None:
        """After a commit: each sink forgets what it committed, then every sink
        aborts its orphans of batches at or below ``cut`` and of earlier runs,
        and learns that those batches are settled (``Sink.settled``: the Kafka
        sink's pooled ids of them may be reused); sinks of different targets at
        once, like the commit."""
        owned = self.ledger.is_owned
        run = self.run
        sinks = {(p, sid): s for p, ps in self.pipelines.items() for sid, s in ps.sinks.items()}

        def settle(key: tuple[str, str]) -> list[str]:
            p, sid = key
            if key in groups:
                sinks[key].forget(groups[key])
            self._retire_evidence(p, sid, sinks[key])
            last = cut.get(p, -1)

            def is_orphan(n: TxnName) -> bool:
                return not owned(str(n)) and (n.run < run or n.batch_id <= last)

            swept = sinks[key].abort_lingering(self.scope(p, sid), is_orphan)
            sinks[key].settled(self.scope(p, sid), last)
            return swept

        def lane(keys: list[tuple[str, str]]) -> list[list[str]]:
            return [settle(k) for k in keys]  # an error ends the lane, as it ended the sweep

        lanes = list(_by_target(sinks, sinks).values())
        calls = [functools.partial(lane, keys) for keys in lanes]
        outcomes = run_all(calls, limit=self.commit_parallelism, name="twophase-sweep")
        for keys, done in zip(lanes, outcomes, strict=True):
            for (p, sid), swept in zip(keys, done.value or [], strict=False):
                self._tell("swept", p, sid, swept)
        raise_first(outcomes)

    def _retire_evidence(self, p: str, sid: str, sink: Sink) -> None:
        """Tell ``sink`` which of its batches the ledger no longer keeps audit
        evidence of (once per change of that floor)."""
        label = sink_label(p, sid)
        floor = self.ledger.evidence_floor(label)
        kept_from = floor if floor is not None else self.ledger.committed_cut(p) + 1
        if self._retired.get(label) != kept_from:
            sink.retire_evidence(self.scope(p, sid), kept_from)
            self._retired[label] = kept_from

    # -- recovery ---------------------------------------------------------------------

    def recover(self) -> None:
        """Apply the recovery rules (module docstring). Idempotent."""
        decided = self.ledger.decided()
        if decided is not None:
            log.warning(
                "finishing checkpoint %d (%s) decided before the last stop",
                decided.id,
                decided.kind,
            )
            with self._checkpointing:
                self._commit(decided, rule="commit_decided")
        self.settle(kind="recovery")

    def settle(self, kind: str) -> None:
        """Commit what Spark completed, abort what it did not, sweep everything
        unowned. Used at start (recovery) and when a run ends or fails."""
        unknown = set(self.ledger.pending_pipelines()) - set(self.pipelines)
        if unknown:
            raise RecoveryRefusedError(
                f"the ledger holds uncommitted work of pipeline(s) {sorted(unknown)} that "
                "this job does not define; add them back so their work can be committed"
            )
        self.checkpoint(kind)
        self._abort_uncompleted(self.pipelines, "Spark did not complete it and replays it")

    def reset_pipeline(self, pipeline: str) -> None:
        """The query of ``pipeline`` was stopped in this run and is about to start
        again (a drain): Spark replays the batch it interrupted, in this run. Abort
        that batch's pending work and every transaction of the pipeline no ledger
        entry owns (the interrupted tasks' prepared work), so the replay is not
        blocked by it (keys it holds) and it is never committed. Batches Spark
        completed stay pending for the next checkpoint. Other pipelines, which may
        be mid-batch, are not touched."""
        with self._checkpointing:
            self._abort_uncompleted([pipeline], "its query was stopped before it completed")

    def _abort_uncompleted(self, pipelines: Collection[str], why: str) -> None:
        """Rules 3 and 4 for ``pipelines``: abort and drop their pending batches
        that Spark has not completed, then every transaction of theirs that no
        ledger entry owns."""
        for p in pipelines:
            latest = self._spark_completed(p)
            for b in self.ledger.pending_batch_ids(p):
                sinks = self.ledger.pending_batch(p, b) if b > latest else None
                if sinks is not None:
                    log.info("aborting batch %d of %s: %s", b, p, why)
                    self._abort_batch(p, sinks)
                    self.ledger.drop_batches(p, [b])
                    self._pending_changed()
        owned = self.ledger.is_owned
        for p in pipelines:
            for sid, sink in self._pipeline(p).sinks.items():
                swept = sink.abort_lingering(self.scope(p, sid), lambda n: not owned(str(n)))
                self._tell("swept", p, sid, swept)

    # -- helpers ----------------------------------------------------------------------

    def _pending_changed(self) -> None:
        """Tell the metrics what the ledger holds pending now."""
        self.ledger.read_pending(self.metrics.pending_changed)

    def _spark_completed(self, p: str) -> int:
        """The highest batch of ``p`` Spark completed: its commit log, or what the
        ledger recorded of it (Spark writes ``commits/N`` without an fsync, so the
        file can vanish in a host crash; the ledger's record cannot)."""
        latest = self._pipeline(p).commit_log.latest()
        recorded = self.ledger.spark_completed(p)
        if latest > recorded:
            self.ledger.record_spark_completed(p, latest)
        return max(latest, recorded)

    def _pipeline(self, p: str) -> PipelineSinks:
        try:
            return self.pipelines[p]
        except KeyError:
            raise RecoveryRefusedError(
                f"pipeline {p!r} has uncommitted work but is not in this job"
            ) from None

    def _sink(self, p: str, sid: str) -> Sink:
        sinks = self._pipeline(p).sinks
        if sid not in sinks:
            raise RecoveryRefusedError(
                f"pipeline {p!r} has uncommitted work for sink {sid!r}, which it no longer has "
                f"(its sinks: {sorted(sinks)}); add the sink back (same sink_id) to commit it"
            )
        return sinks[sid]

    def _abort_batch(
        self, p: str, sinks: dict[str, list[Committable]], rule: str | None = None
    ) -> None:
        for sid, cs in sinks.items():
            if cs:
                self._sink(p, sid).abort(cs)
                self._tell("aborted", p, sid, (c["txn"] for c in cs), rule)


def _rows(committables: Iterable[Committable]) -> int:
    return sum(int(c.get("rows", 0)) for c in committables)
