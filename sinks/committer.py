"""The driver side of a sink: one :class:`Committer` decides its prepared work.

A sink's :meth:`~sinks.base.Sink.committer` returns it, on the driver only. The
coordinator (:mod:`lifecycle.coordinator`) and the ``twophase`` commands call
it and nothing else of the sink's commit path. Its roles, each under one name
in every sink:

==============  ==========================================================
``claim``       make this incarnation the owner of a scope, before any data moves
``progress``    read the owner and the highest committed batch of a scope
``commit``      make prepared work visible (idempotent; raises when it is lost)
``abort``       end prepared work that will never be committed (idempotent)
``classify``    :class:`Outcome` of prepared work, by the commit's own checks
``lingering``   list a job's unfinished work the target holds (read-only)
``sweep``       abort the unfinished work of a scope that no ledger entry owns
``forget``      drop what was kept only to make ``commit`` idempotent
==============  ==========================================================

A committer that checks its commits against the target (an audit), leases
resources to batches, or keeps evidence for audits says so by implementing a
capability of :mod:`sinks.capabilities` too.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sinks.naming import TxnName
from sinks.progress import SinkProgress
from sinks.scope import JobScope

Committable = dict[str, Any]
"""What a writer's ``prepare`` returns: small, JSON-serialisable, self-describing.

Every committable carries at least ``"txn"`` (its transaction name, see
:class:`sinks.naming.TxnName`) and ``"rows"`` (rows written)."""

REPAYS = "repays"
"""The committable key the coordinator sets (to True) on work that writes an
owed batch again (recovery rule 5, :mod:`lifecycle.replay`): see
:meth:`Committer.commit`."""

OrphanTest = Callable[[TxnName], bool]
"""Decides, for a lingering transaction a sweep found, whether to abort it."""


class Outcome(str, enum.Enum):
    """What :meth:`Committer.classify` says of prepared work."""

    COMMITTED = "committed"
    """committed already: a commit would change nothing"""
    PREPARED = "prepared"
    """still prepared: a commit would go through"""
    LOST = "lost"
    """gone without having been committed: a commit would raise
    :class:`~sinks.errors.TransactionLostError` (the source must write it again)"""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LingeringTxn:
    """Unfinished work of a job found in a target by :meth:`Committer.lingering`."""

    txn: str
    """the transaction name (:class:`~sinks.naming.TxnName`)"""
    name: TxnName
    state: str
    """what the target says: ``prepared`` (PostgreSQL), ``open`` / ``committed``
    / ``aborted`` (a Kafka announcement not yet tombstoned), ``staged`` (Delta)"""
    detail: str = ""
    """more of what the target says (when prepared, how many files, ...)"""


class Committer(abc.ABC):
    """Claims, commits, aborts and sweeps one sink's prepared work, on the driver.

    Every method may be called again after a crash of the driver at any point
    of an earlier call: each is idempotent, and retries transient failures of
    the target itself within the sink's ``commit_timeout``."""

    @abc.abstractmethod
    def claim(self, scope: JobScope, *, start_over_from: str | None = None) -> SinkProgress:
        """Atomically make ``scope.incarnation`` the owner of ``scope`` in the
        target (before any data moves) and return the record as claimed.

        Raises :class:`sinks.progress.IncarnationConflictError` when another
        incarnation holds it, unless it is ``start_over_from`` (an operator's
        explicit choice to start over, recorded in the target). Every commit
        afterwards checks that the claim is still this incarnation's, and never
        commits a batch at or below what the target holds committed. A target
        that cannot keep a record returns ``SinkProgress(owner=scope.incarnation)``."""

    @abc.abstractmethod
    def progress(self, scope: JobScope) -> SinkProgress:
        """Read, from the target, the progress record of ``scope``: which
        incarnation holds the claim and the highest batch it has committed (see
        :mod:`sinks.progress`); ``SinkProgress(owner=None)`` when there is none."""

    @abc.abstractmethod
    def commit(self, committables: Sequence[Committable]) -> None:
        """Commit prepared work. Idempotent: committing twice is harmless.

        Retries transient failures; raises :class:`sinks.errors.TransactionLostError`
        when prepared work is gone without having been committed, having
        committed none of ``committables`` when the loss can be found before
        (the coordinator then owes the lost batches: recovery rule 5).

        A committable the coordinator marks ``REPAYS`` (its key set to True)
        writes an owed batch again (rule 5): it commits even when the target's
        progress holds its batch already (its other tasks' work committed
        before), where other work of a batch at or below the progress is a
        replay and is aborted."""

    @abc.abstractmethod
    def abort(self, committables: Sequence[Committable]) -> None:
        """Abort prepared work. Idempotent: aborting what is gone is harmless."""

    @abc.abstractmethod
    def classify(self, committables: Sequence[Committable]) -> dict[str, Outcome]:
        """``{txn: Outcome}`` for ``committables``, by the checks of the commit
        path, without committing anything."""

    @abc.abstractmethod
    def lingering(self, job: str, pipeline: str) -> list[LingeringTxn]:
        """List, without changing anything, the unfinished work of (``job``,
        ``pipeline``, this sink) that the target holds, of every incarnation
        and both name formats: what a sweep would consider."""

    @abc.abstractmethod
    def sweep(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        """Abort every unfinished transaction of ``scope`` (this incarnation's
        names and the first format's, :meth:`JobScope.own_prefixes`) for
        which ``is_orphan`` is true; return the names aborted."""

    def forget(self, committables: Sequence[Committable]) -> None:  # noqa: B027
        """Drop bookkeeping kept only to make ``commit`` idempotent (called after
        the ledger has durably recorded that these committables are committed).
        The default keeps nothing."""
