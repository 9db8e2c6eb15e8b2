"""Opt-in capabilities: what only some sinks need, each a small interface.

A sink (or its committer) implements a capability by inheriting it; the
coordinator asks ``isinstance`` and, where a sink lacks one, does without:

* :class:`StagesThroughSpark` (on the sink): stages a whole micro-batch with a
  Spark job of its own, and derives or checks columns first (Delta: generated
  columns, CHECK constraints);
* :class:`ExpiringWork` (on the sink): prepared work the target aborts by
  itself after a timeout (a Kafka transaction);
* :class:`HoldsPreparedWork` (on the sink): prepared work holds the target's
  resources until its commit (PostgreSQL's prepared slots and row locks,
  Kafka's open transactions), so the sink may ask for an early checkpoint;
* :class:`LeasesIds` (on the committer): gives each batch a lane of reusable
  ids before its tasks start (Kafka's pooled transactional ids);
* :class:`Audits` (on the committer): keeps evidence of each commit and checks
  it later against the target's records (``twophase audit``);
* :class:`RetiresEvidence` (on the committer): keeps records in the target for
  audits only, dropped when the ledger drops their evidence (PostgreSQL's
  commit markers).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sinks.audit import CheckpointEvidence, Finding, Verdict
from sinks.committer import Committable
from sinks.scope import JobScope


class StagesThroughSpark(abc.ABC):
    """A sink that sees each micro-batch as a Spark ``DataFrame`` on the driver."""

    @abc.abstractmethod
    def frame_for_write(self, df: Any) -> Any:
        """The micro-batch as this sink writes it, on the driver before every
        batch: ``df`` with the columns the target derives added and the checks
        the target makes applied, so that they run on the executors before
        anything is staged."""

    @abc.abstractmethod
    def precommit_frame(
        self, df: Any, scope: JobScope, run: int, batch_id: int, *, shared: bool = False
    ) -> list[Committable] | None:
        """Pre-commit a whole micro-batch with a Spark job of the sink's own and
        return its committables; ``None``: write it with per-task writers
        (:meth:`~sinks.base.Sink.open_writer`) after all.

        ``shared``: other sinks of the pipeline write this batch with per-task
        writers in one Spark job, and :meth:`joins_shared_jobs` said this
        sink's writers join it: make the checks, stage nothing, return ``None``.

        Same contract as the writers: nothing visible before commit, every staged
        thing named after a transaction of ``scope`` in ``run`` and ``batch_id``
        so that a sweep finds it after any crash."""

    def joins_shared_jobs(self) -> bool:
        """Whether this sink's per-task writers may join the one Spark job other
        sinks of its pipeline share for each batch (one pass over the batch, no
        job of its own): then :meth:`frame_for_write` returns its input as it is
        and :meth:`precommit_frame` with ``shared`` stages nothing. Known after
        the sink's preflight. By default no."""
        return False


class ExpiringWork(abc.ABC):
    """A sink whose target aborts prepared work by itself after a timeout.

    The job pre-commits such a sink after the others of its pipeline (its work
    waits as briefly as possible), watches the age of its open work, and
    refuses a checkpoint interval the timeout cannot cover."""

    @abc.abstractmethod
    def prepared_work_timeout(self) -> float:
        """Seconds after which the target aborts prepared work, counted from
        its first write."""


class HoldsPreparedWork(abc.ABC):
    """A sink whose prepared work holds resources of the target until its commit
    (a PostgreSQL prepared transaction: its row locks and a slot of
    ``max_prepared_transactions``; a Kafka transaction)."""

    @abc.abstractmethod
    def holds_prepared_work(self) -> bool:
        """Whether this sink, with its options, holds resources for its prepared
        work (a replace stages into a table instead): such a sink cannot wait,
        batch after batch, for a deferred pipeline to finish
        (:attr:`~sinks.base.Sink.commits_at_finish`)."""

    def prepare_waits_for_commits(self) -> bool:
        """Whether a writer's ``prepare`` may wait for an earlier batch's commit
        (a keyed PostgreSQL upsert: the rows it updates stay locked by the
        earlier batch's prepared transactions until the checkpoint commits
        them). Such a sink shares no Spark job with expiring work
        (:func:`lifecycle.binding.write_plan`). By default no."""
        return False

    @abc.abstractmethod
    def checkpoint_pressure(self, batch: Sequence[Committable]) -> str | None:
        """After a batch prepared ``batch`` and it was recorded: a reason to take
        the next checkpoint now rather than at its interval (the target is
        close to a limit on work awaiting commit), or None."""

    def expect_load(self, load: ExpectedLoad) -> None:  # noqa: B027
        """Warn (log) when the target may not hold the work that waits for a
        checkpoint under ``load`` (called once, after preflight). The default
        says nothing."""

    def prepared_work_limit(self) -> float | None:
        """Seconds past which prepared work harms the target or other writers,
        for the metric an alert compares its age with
        (``twophase_prepared_age_limit_seconds``); None (the default): no such
        limit. An :class:`ExpiringWork` sink's limit is its timeout instead."""
        return None

    def server_prepared_transactions(self) -> tuple[int, int] | None:
        """The target server's prepared transactions (every job's) and their
        limit, as last seen (``twophase_server_prepared_transactions``); None
        (the default): not known. Called when metrics are read: it must not
        ask the server."""
        return None


@dataclass(frozen=True)
class ExpectedLoad:
    """What a job expects to prepare between two checkpoints, per sink: an
    estimate (adaptive execution changes partition counts, and how many batches
    an available-now run fits into an interval is unknown)."""

    tasks_per_batch: int
    """Spark tasks that write one batch"""
    batches_per_checkpoint: int
    """batches prepared and awaiting commit at most, before a checkpoint commits them"""

    @property
    def transactions(self) -> int:
        return self.tasks_per_batch * self.batches_per_checkpoint


class LeasesIds(abc.ABC):
    """A committer that lends each batch a lane of reusable ids on the driver."""

    @abc.abstractmethod
    def lease(self, scope: JobScope, batch_id: int) -> int | None:
        """Before ``batch_id``'s tasks start: the lane its writers get as
        :attr:`~sinks.base.WriteContext.lease`; None when this batch needs none."""

    @abc.abstractmethod
    def settled(self, scope: JobScope, through_batch: int) -> None:
        """Every batch of ``scope`` up to ``through_batch`` is decided (committed
        or aborted) and its orphans were swept: what was leased to them may be
        reused once the target shows it ended."""


def lease(committer: object, scope: JobScope, batch_id: int) -> int | None:
    """What ``committer`` leases ``batch_id`` before its tasks start when it
    :class:`LeasesIds`; None for any other."""
    if isinstance(committer, LeasesIds):
        return committer.lease(scope, batch_id)
    return None


class Audits(abc.ABC):
    """A committer whose commits can be checked later against the target's records."""

    @abc.abstractmethod
    def evidence(self, committable: Committable) -> dict[str, Any]:
        """What the ledger keeps of a committed ``committable`` for an audit
        (:mod:`sinks.audit`): at least its ``txn`` and ``rows``."""

    @abc.abstractmethod
    def audit(self, scope: JobScope, checkpoints: Sequence[CheckpointEvidence]) -> list[Finding]:
        """Check the evidence of ``checkpoints`` (committed by ``scope``) against
        the target's own records, one :class:`~sinks.audit.Finding` per
        transaction."""


def evidence(committer: object, committable: Committable) -> dict[str, Any]:
    """What the ledger keeps of ``committable``: the committer's evidence when it
    :class:`Audits`, else its ``txn`` and ``rows``."""
    if isinstance(committer, Audits):
        return committer.evidence(committable)
    return {"txn": committable["txn"], "rows": int(committable.get("rows", 0))}


def audit(
    committer: object, scope: JobScope, checkpoints: Sequence[CheckpointEvidence]
) -> list[Finding]:
    """The committer's findings when it :class:`Audits`; else every transaction
    of ``checkpoints`` is unverifiable."""
    if isinstance(committer, Audits):
        return committer.audit(scope, checkpoints)
    return [
        Finding(cp.checkpoint, str(c["txn"]), Verdict.UNVERIFIABLE, "not auditable", 0)
        for cp in checkpoints
        for c in cp.committed
    ]


class RetiresEvidence(abc.ABC):
    """A committer that keeps records in the target only for audits."""

    @abc.abstractmethod
    def retire_evidence(self, scope: JobScope, before_batch: int) -> None:
        """The ledger no longer keeps the audit evidence of ``scope``'s batches
        below ``before_batch``: the records kept only for audits may go."""
