"""Debts, the mechanism of recovery rule 5 (the rule is stated in
:mod:`lifecycle.coordinator`): which batch each sink owes from, the batches of
a checkpoint that become owed to a sink that lost its work of them
(:meth:`Debts.owe_lost`) or owed too because they come after an owed one
(:meth:`Debts.extend`), and the commit of an owed batch written again, which
records the debt paid (:meth:`Debts.repay`, and :meth:`Debts.finish_repay`
after a restart; the writing again is :mod:`lifecycle.replay`). The
coordinator calls these holding its checkpoint lock: one checkpoint or
repayment at a time.
"""

from __future__ import annotations

import logging

from lifecycle.job_sinks import JobSinks, Shares, count_rows
from lifecycle.ledger import Checkpoint, Ledger
from sinks import _faults
from sinks.base import Committable, Outcome
from sinks.errors import TransactionLostError
from sinks.naming import TxnName

log = logging.getLogger("lifecycle.coordinator")  # the coordinator's own messages


class Debts:
    """The batches the ledger records as owed to the sinks of ``sinks``, and
    their repayment (module docstring)."""

    def __init__(self, ledger: Ledger, sinks: JobSinks) -> None:
        self.ledger = ledger
        self._sinks = sinks

    def owes_from(self) -> dict[tuple[str, str], int]:
        """Per (pipeline, sink id) that owes batches, its lowest owed batch."""
        first: dict[tuple[str, str], int] = {}
        for p, batches in self.ledger.owed().items():
            for b, sinks in batches.items():
                for sid in sinks:
                    first[(p, sid)] = min(first.get((p, sid), b), b)
        return first

    def extend(self, cp: Checkpoint) -> None:
        """Rule 5, kept: a sink that owes batches commits none after its first
        owed one before it is paid (its progress would then hold the owed
        batches, and the sink would refuse them as replays). Its work of later
        batches of ``cp`` is aborted and those batches are owed too."""
        for (p, sid), first in sorted(self.owes_from().items()):
            owed = self.ledger.owed().get(p, {})
            later: dict[int, list[Committable]] = {}
            for b in self.ledger.pending_batch_ids(p):
                if first < b <= cp.cut.get(p, -1) and sid not in owed.get(b, {}):
                    later[b] = (self.ledger.pending_batch(p, b) or {}).get(sid, [])
            if not later:
                continue
            self.ledger.record_owed(p, {b: {sid: count_rows(cs)} for b, cs in later.items()})
            work = [c for cs in later.values() for c in cs]
            if work:
                self._sinks.committer(p, sid).abort(work)
            self._sinks.metrics.recovery_action("owe_lost", p, sid, len(work))
            log.warning(
                "%s owes batch %d of pipeline %s: its later batch(es) %s are owed too, "
                "written again after it",
                self._sinks.sink(p, sid).describe(),
                first,
                p,
                sorted(later),
            )

    def owes_part(self, pipeline: str, sink_id: str, batch_id: int) -> set[int] | None:
        """The Spark partitions of batch ``batch_id`` that ``sink_id`` owes when it
        owes only the lost tasks' share of it; None when it owes the whole batch
        (or nothing)."""
        parts = self.ledger.owed_parts(pipeline, batch_id).get(sink_id)
        return set(parts) if parts is not None else None

    def owe_lost(self, cp: Checkpoint, shares: Shares) -> list[tuple[str, str]]:
        """Rule 5 for decided checkpoint ``cp``, whose shares (see
        :meth:`lifecycle.coordinator.Coordinator.shares`) are ``shares``: per
        sink, ask the target (its committer's ``classify``) about every transaction of its
        share; when one was lost before it committed, record what is owed from
        the first batch with a loss on and abort the rest of the sink's work of
        those batches. Of that first batch, the sink owes the whole batch when
        none of its work committed, and only the lost tasks' share (their
        Spark partitions) when the rest committed already (a transaction lost
        in the middle of a commit); the later batches whole. The loss stops
        the job (the commit reports it) only when part of a *later* batch
        committed already, or an operator abandoned some of that work: writing
        it again would then break the batches' order or restore what was given
        up. Returns the sinks that now owe."""
        abandoned = self.ledger.abandoned_txns(cp.id)
        owing: list[tuple[str, str]] = []
        for (p, sid), batches in shares.items():
            sink = self._sinks.sink(p, sid)
            work = [c for cs in batches.values() for c in cs]
            if sink.commits_at_finish or not work:
                continue  # a replace commits its whole backfill at once: no batch to owe
            try:
                verdicts = sink.committer().classify(work)
            except NotImplementedError:
                continue  # the commit reports the loss
            lost = [
                b
                for b, cs in batches.items()
                if any(verdicts.get(c["txn"]) == Outcome.LOST for c in cs)
            ]
            if not lost:
                continue
            first = min(lost)
            later = [b for b in batches if b > first]
            done_first = [c for c in batches[first] if verdicts.get(c["txn"]) == Outcome.COMMITTED]
            lost_first = [c for c in batches[first] if verdicts.get(c["txn"]) == Outcome.LOST]
            done_later = [
                c["txn"]
                for b in later
                for c in batches[b]
                if verdicts.get(c["txn"]) == Outcome.COMMITTED
            ]
            given_up = [
                t
                for b in [first, *later]
                for c in (self.ledger.pending_batch(p, b) or {}).get(sid, [])
                if (t := c.get("txn")) in abandoned
            ]
            if done_later or given_up:
                log.error(
                    "%s: transactions of batch(es) %s of %s were lost (%s), and %s: writing "
                    "them again would %s, so the loss stops the job",
                    sink.describe(),
                    lost,
                    p,
                    ", ".join(c["txn"] for c in work if verdicts.get(c["txn"]) == Outcome.LOST)[
                        :300
                    ],
                    f"{len(done_later)} transaction(s) of later batches committed already "
                    f"({done_later[:3]})"
                    if done_later
                    else f"an operator abandoned {len(given_up)} transaction(s) of them",
                    "put a batch after a later one" if done_later else "restore what was given up",
                )
                continue
            owed = {first: {sid: count_rows(lost_first if done_first else batches[first])}}
            owed.update({b: {sid: count_rows(batches[b])} for b in later})
            parts = (
                {first: {sid: sorted({TxnName.require(c["txn"]).partition for c in lost_first})}}
                if done_first
                else None
            )
            self.ledger.record_owed(p, owed, parts)
            dropped = [b for b in later] + ([] if done_first else [first])
            alive = [
                c for b in dropped for c in batches[b] if verdicts.get(c["txn"]) == Outcome.PREPARED
            ]
            if alive:
                sink.committer().abort(alive)
            owing.append((p, sid))
            self._sinks.metrics.recovery_action("owe_lost", p, sid, len(lost_first))
            log.warning(
                "%s lost its transaction(s) of batch(es) %s of pipeline %s before they "
                "committed (%s); %s are owed to it: written again from the source before any "
                "new batch of it commits",
                sink.describe(),
                lost,
                p,
                ", ".join(c["txn"] for c in work if verdicts.get(c["txn"]) == Outcome.LOST)[:300],
                ", ".join(
                    f"batch {b} ({n[sid]} row(s)"
                    + (f", Spark partition(s) {parts[b][sid]} only" if parts and b in parts else "")
                    + ")"
                    for b, n in sorted(owed.items())
                ),
            )
        return owing

    def repay(self, pipeline: str, batch_id: int, work: dict[str, list[Committable]]) -> None:
        """Commit ``work`` (sink id -> committables), the owed batch
        ``batch_id`` of ``pipeline`` written again (rule 5), recorded in the
        ledger first (so that after a crash its commit is finished, never run
        twice); then record it repaid, and the sinks forget their bookkeeping."""
        self.ledger.record_repaying(pipeline, batch_id, work)
        _faults.hit("driver.before_repay", batch=batch_id)
        self._commit_repaid(pipeline, batch_id, work)

    def finish_repay(self, pipeline: str, batch_id: int) -> bool:
        """After a restart: settle the work recorded as writing owed batch
        ``batch_id`` of ``pipeline`` again. Returns True when every owing sink
        holds the batch now (its work committed, or committed here); False when
        none of the work is kept (it was swept or lost) and the batch is to be
        written again. Raises :class:`TransactionLostError` when part of it
        committed and part is lost."""
        work = self.ledger.owed_work(pipeline, batch_id)
        owing = self.ledger.owed().get(pipeline, {}).get(batch_id, {})
        if not work or set(work) != set(owing):
            return False
        verdicts: dict[str, Outcome] = {}
        for sid, cs in work.items():
            verdicts.update(self._sinks.committer(pipeline, sid).classify(cs) if cs else {})
        if Outcome.LOST in verdicts.values():
            if Outcome.COMMITTED in verdicts.values():
                raise TransactionLostError(
                    f"batch {batch_id} of pipeline {pipeline!r}, written again for sink(s) "
                    f"{sorted(work)}, committed in part and lost in part: writing it again "
                    "would duplicate the committed part"
                )
            for sid, cs in work.items():
                self._sinks.committer(pipeline, sid).abort(cs)
            return False
        self._commit_repaid(pipeline, batch_id, work)
        return True

    def _commit_repaid(
        self, pipeline: str, batch_id: int, work: dict[str, list[Committable]]
    ) -> None:
        """Commit the work that wrote owed batch ``batch_id`` again, record the
        debt paid, and let the sinks forget it."""
        sinks = self._sinks
        for sid, cs in work.items():
            sinks.commit_counted(pipeline, sid, sinks.sink(pipeline, sid), cs)
            sinks.tell("committed", pipeline, sid, (c["txn"] for c in cs), "repay_owed")
        self.ledger.record_repaid(
            pipeline, batch_id, {sid: count_rows(cs) for sid, cs in work.items()}
        )
        for sid, cs in work.items():
            sinks.committer(pipeline, sid).forget(cs)
            sinks.settled(pipeline, sid, batch_id)
