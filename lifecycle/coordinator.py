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
5. Lost work is written again, never dropped, whether it is found at a
   start or during a run. A sink's commit asks the target about every
   transaction of its share first (the Kafka sink asks the broker, never a
   clock) and, when one was lost before it committed (a Kafka transaction the
   broker aborted at its timeout, a prepared transaction someone rolled back,
   staged files a VACUUM removed), commits none of it and raises
   ``TransactionLostError``. Then (the committer's ``classify``, :mod:`lifecycle.debts`)
   that sink's share from the first batch with a loss on is recorded in the
   ledger as *owed* to the sink, its surviving transactions of those batches
   are aborted, and the rest of its share commits, so the decision is final
   for every other sink, and for this one up to the loss. Where the loss came
   in the middle of the sink's commit (part of the first batch with a loss
   committed already; the Kafka sink commits batch by batch), only the lost
   tasks' share of that batch, their Spark partitions, is owed. The job then
   writes each owed batch again, to the owing sinks only, from its source with
   its original offsets, before any new batch of it commits: at a start before
   any query runs, and during a run right after the checkpoint that found the
   loss, with the owing pipeline's query stopped (:mod:`lifecycle.replay`).
   The loss stops the job (a ``CheckpointCommitError`` whose cause is
   ``TransactionLostError``) only when part of a later batch of the sink
   committed already, or an operator abandoned part of the work: writing it
   again would then break the batches' order or restore what was given up.
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

The mechanisms are in modules of their own; the rules are stated here only. A
job's sinks as the coordinator reaches them (lookup, commit lanes, the
observer): :mod:`lifecycle.job_sinks`; the claims: :mod:`lifecycle.claims`;
the sweeps of rule 4: :mod:`lifecycle.sweep`; the debts of rule 5:
:mod:`lifecycle.debts` (their writing again: :mod:`lifecycle.replay`).

Longer than 450 lines because this docstring is the one place the recovery
rules are stated (some 65 lines), beside the commit path and recovery that
apply them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable

from lifecycle import claims
from lifecycle.debts import Debts
from lifecycle.errors import CheckpointCommitError, RecoveryRefusedError
from lifecycle.failures import cause_of, full_trace
from lifecycle.job_sinks import (
    JobSinks,
    Observer,
    PipelineSinks,
    Shares,
    count_rows,
    sink_label,
)
from lifecycle.ledger import Checkpoint, Ledger
from lifecycle.metrics import JobMetrics
from lifecycle.sweep import Sweeper
from sinks import _faults, capabilities
from sinks.base import Committable, JobScope, Sink
from sinks.capabilities import HoldsPreparedWork
from sinks.errors import CommitRefusedError, ConfigError, TransactionLostError
from sinks.naming import TxnName

log = logging.getLogger("lifecycle.coordinator")


class Coordinator:
    """Lives in the driver; one per job run. ``observer``: told of every move on
    a sink (see :data:`~lifecycle.job_sinks.Observer`). ``new_state``: how the
    job gets a new state, for refusals that suggest one (see
    :func:`lifecycle.ledger.new_state_advice`).
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
        self.ledger = ledger
        self.new_state = new_state
        self.run = ledger.run
        self.incarnation = ledger.incarnation
        self.metrics = metrics or JobMetrics(job)
        self._sinks = JobSinks(
            job,
            self.incarnation,
            pipelines,
            observer=observer,
            metrics=self.metrics,
            commit_parallelism=commit_parallelism,
        )
        self.pipelines = self._sinks.pipelines
        self._debts = Debts(ledger, self._sinks)
        self._sweeper = Sweeper(ledger, self._sinks, self.run)
        self._checkpointing = threading.Lock()  # one checkpoint at a time
        self.checkpoints_taken: list[Checkpoint] = []
        self._early: str | None = None  # why the next checkpoint should not wait
        self.progress_note: Callable[[], str] | None = None
        """what the checkpoint log line adds (the progress of bounded pipelines)"""
        self.completed: Callable[[Checkpoint], None] | None = None
        """told of each checkpoint once the ledger recorded it complete; returns
        at once and never raises (the job's :mod:`lifecycle.source_offsets`)"""

    def scope(self, pipeline: str, sink_id: str) -> JobScope:
        """The scope of a sink of this job, in this incarnation."""
        return self._sinks.scope(pipeline, sink_id)

    # -- claims (at start, before any data moves) -----------------------------------

    def claim_sinks(self, start_over_from: str | None = None) -> None:
        """Make this incarnation the owner of every sink's scope, or refuse
        (:func:`lifecycle.claims.claim_sinks`)."""
        claims.claim_sinks(self._sinks, start_over_from)

    def check_sinks_behind_ledger(self) -> None:
        """Refuse when a sink holds more of this incarnation's batches than the
        ledger recorded (:func:`lifecycle.claims.check_sinks_behind_ledger`)."""
        claims.check_sinks_behind_ledger(self._sinks, self.ledger, self.new_state)

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
        planned = self._sinks.pipeline(pipeline).commit_log.offsets_digest(batch_id)
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
            self._sinks.abort_batch(pipeline, stale, rule="abort_rerun")
        digest = self._sinks.pipeline(pipeline).commit_log.offsets_digest(batch_id)
        at = round(time.time(), 3)
        for cs in committables.values():
            for c in cs:
                c["registered_at"] = at  # the age of pending work (status, metrics)
        self.ledger.record_batch(pipeline, batch_id, committables, digest)
        self.metrics.prepared(pipeline, committables)
        self._pending_changed()
        for sid, cs in committables.items():
            sink = self._sinks.sink(pipeline, sid)
            reason = sink.checkpoint_pressure(cs) if isinstance(sink, HoldsPreparedWork) else None
            if reason is not None:
                self._early = reason

    def take_early_checkpoint(self) -> str | None:
        """Why a sink asked for the next checkpoint now (see
        :meth:`sinks.capabilities.HoldsPreparedWork.checkpoint_pressure`), once;
        None if none did."""
        reason, self._early = self._early, None
        return reason

    def abort_unregistered(self, pipeline: str, committables: dict[str, list[Committable]]) -> None:
        """Abort work of a batch that failed before registration (best effort)."""
        try:
            self._sinks.abort_batch(pipeline, committables)
        except Exception:
            log.exception(
                "could not abort the work of a failed batch of %s; the next "
                "checkpoint or start sweeps it",
                pipeline,
            )

    # -- checkpoints ----------------------------------------------------------------

    def _completed_cut(
        self, only: Iterable[str] | None = None, finishing: Collection[str] = ()
    ) -> dict[str, int]:
        """Per pipeline (of ``only``, default all), the highest pending batch that
        Spark has completed. A deferred pipeline
        (:attr:`~lifecycle.job_sinks.PipelineSinks.deferred`) is in the cut only
        when the checkpoint finishes it (``finishing``): until then its batches
        stay pending, also across restarts."""
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
            cut = self._completed_cut(only, finishing=finished)
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
        owes_from = self._debts.owes_from()
        shares: Shares = {}
        for p, last in cp.cut.items():
            for b in self.ledger.pending_batch_ids(p):  # ascending
                if b > last:
                    break
                for sid, cs in (self.ledger.pending_batch(p, b) or {}).items():
                    share = shares.setdefault((p, sid), {})
                    first = owes_from.get((p, sid), b + 1)
                    if b >= first and not abandoned:
                        owed = self._debts.owes_part(p, sid, b) if b == first else None
                        if owed is None:
                            continue
                        # only the lost tasks' share is owed: the rest commits
                        cs = [c for c in cs if TxnName.require(c["txn"]).partition not in owed]
                    share[b] = [c for c in cs if (c.get("txn") in skip) == abandoned]
        return shares

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
        self._debts.extend(cp)
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
                self._sinks.tell("skipped", p, sid, (c["txn"] for c in cs))
        started = time.monotonic() if started is None else started
        sinks = {key: self._sinks.sink(*key) for key in groups}
        _faults.hit("driver.before_commit", batch=max(cp.cut.values(), default=None))
        failed = self._sinks.commit_all(groups, sinks)
        if failed and self.replay_lost:
            self._owe_lost(cp, groups, sinks, failed)  # rule 5
        rows: dict[str, int] = {}
        for (p, sid), cs in groups.items():
            if (p, sid) not in failed:
                rows[sink_label(p, sid)] = count_rows(cs)
                self._sinks.tell("committed", p, sid, (c["txn"] for c in cs), rule)
        if failed:
            self.metrics.checkpoint_failed(cp.kind, time.monotonic() - started)
            raise self._commit_error(cp, failed, sinks)
        _faults.hit("driver.after_commit", batch=max(cp.cut.values(), default=None))
        evidence = {
            sink_label(p, sid): [capabilities.evidence(sinks[(p, sid)].committer(), c) for c in cs]
            for (p, sid), cs in groups.items()
            if cs
        }
        done = self.ledger.complete(cp, rows, evidence)
        self.checkpoints_taken.append(done)
        if self.completed is not None:
            self.completed(done)
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
        self._sweeper.after_commit(groups, cp.cut, cp.finished)
        return done

    def _owe_lost(
        self,
        cp: Checkpoint,
        groups: dict[tuple[str, str], list[Committable]],
        sinks: dict[tuple[str, str], Sink],
        failed: dict[tuple[str, str], Exception],
    ) -> None:
        """Rule 5 where a sink's commit of checkpoint ``cp`` reported lost work
        (a :class:`TransactionLostError`): record what that sink owes
        (:meth:`lifecycle.debts.Debts.owe_lost`), then commit what is left of
        its share. ``groups`` and ``failed`` are updated in place: the work
        each sink committed, and the sinks that still failed."""
        losing = [k for k, e in failed.items() if _reports_loss(e)]
        if not losing:
            return
        shares = self.shares(cp)
        owing = self._debts.owe_lost(cp, {k: shares.get(k, {}) for k in losing})
        if not owing:
            return  # the loss stops the job: the commit's error says why
        left = {k: cs for k, cs in self.committables_of(cp).items() if k in owing}
        for k in owing:
            del failed[k]
        groups.update(left)
        failed.update(self._sinks.commit_all(left, {k: sinks[k] for k in left}))

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

    # -- debts (rule 5) ---------------------------------------------------------------

    def repay(self, pipeline: str, batch_id: int, work: dict[str, list[Committable]]) -> None:
        """Commit ``work``, the owed batch ``batch_id`` of ``pipeline`` written
        again, and record the debt paid (:meth:`lifecycle.debts.Debts.repay`),
        between checkpoints."""
        with self._checkpointing:
            self._debts.repay(pipeline, batch_id, work)

    def finish_repay(self, pipeline: str, batch_id: int) -> bool:
        """After a restart: settle the work recorded as writing owed batch
        ``batch_id`` of ``pipeline`` again; True when the debt is paid now
        (:meth:`lifecycle.debts.Debts.finish_repay`)."""
        with self._checkpointing:
            return self._debts.finish_repay(pipeline, batch_id)

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
                    self._sinks.abort_batch(p, sinks)
                    self.ledger.drop_batches(p, [b])
                    self._pending_changed()
        self._sweeper.unowned(pipelines)

    # -- helpers ----------------------------------------------------------------------

    def _pending_changed(self) -> None:
        """Tell the metrics what the ledger holds pending now."""
        self.ledger.read_pending(self.metrics.pending_changed)

    def _spark_completed(self, p: str) -> int:
        """The highest batch of ``p`` Spark completed: its commit log, or what the
        ledger recorded of it (Spark writes ``commits/N`` without an fsync, so the
        file can vanish in a host crash; the ledger's record cannot)."""
        latest = self._sinks.pipeline(p).commit_log.latest()
        recorded = self.ledger.spark_completed(p)
        if latest > recorded:
            self.ledger.record_spark_completed(p, latest)
        return max(latest, recorded)


def _reports_loss(e: BaseException) -> bool:
    """Whether ``e`` (a sink's failed commit) is, or was caused by, a
    :class:`TransactionLostError`: work lost in the target (rule 5)."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, TransactionLostError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False
