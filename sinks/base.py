"""The two-phase sink protocol shared by every sink.

A sink has two halves that run in different processes:

* Executor side (``open_writer``): a :class:`SinkWriter` is opened for one
  (job, pipeline, batch, partition, task attempt), fed Arrow record batches as
  they arrive, and ``prepare()``-d at the end of the task. ``prepare`` makes the
  written data durable but invisible (a prepared PostgreSQL transaction, a
  flushed Kafka transaction, staged Parquet files) and returns a small
  JSON-serialisable **committable** that travels back to the driver.
* Driver side: ``preflight`` before any data moves, ``commit`` / ``abort`` of
  committables once the coordinator has decided, ``abort_lingering`` to sweep
  work that no ledger entry owns (failed or speculative task attempts, a crash
  before registration), and ``forget`` once the ledger has recorded a commit.
* Operations (the ``twophase`` command, read-only): ``settings`` (what the
  ledger records to build the sink again, without secrets, see
  :mod:`sinks.settings`), ``lingering`` (the work of a job the target holds
  unfinished) and ``classify`` (whether committables are committed, still
  prepared, or lost), each reusing the checks of the sweep and the commit.

Sinks are pickled and shipped to executors, so they hold configuration only;
connections are opened inside methods.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from sinks.audit import CheckpointEvidence, Finding, Verdict
from sinks.naming import TxnName, scope_prefix
from sinks.progress import SinkProgress

Committable = dict[str, Any]
"""What ``prepare`` returns: small, JSON-serialisable, self-describing.

Every committable carries at least ``"txn"`` (its transaction name, see
:class:`sinks.naming.TxnName`) and ``"rows"`` (rows written)."""


@dataclass(frozen=True)
class JobScope:
    """Identifies the job, pipeline and sink a sink instance writes for, and the
    incarnation (the ledger's random id) that writes. ``incarnation`` is None
    only for work named before incarnations existed."""

    job: str
    pipeline: str
    sink_id: str
    incarnation: str | None = None

    def txn_prefix(self) -> str:
        """The prefix shared by every transaction name of this scope (this
        incarnation's names only)."""
        return scope_prefix(self.job, self.pipeline, self.sink_id, self.incarnation)

    def own_prefixes(self) -> tuple[str, ...]:
        """The prefixes of every name this incarnation may sweep: its own, and
        those of the first format (work prepared before an upgrade, which the
        upgraded ledger owns)."""
        legacy = scope_prefix(self.job, self.pipeline, self.sink_id, None)
        return (self.txn_prefix(),) if self.incarnation is None else (self.txn_prefix(), legacy)

    def key(self) -> str:
        """``job/pipeline/sink``: the scope in progress records and messages."""
        return f"{self.job}/{self.pipeline}/{self.sink_id}"


class ClaimedScopes:
    """The scopes a driver-side sink instance claimed, and for which incarnation.

    A committable commits in the scope of the incarnation its name carries. A
    first-format name (no incarnation, prepared before an upgrade) commits as
    the incarnation that claimed its scope: the upgraded ledger owns it."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str, str], str] = {}

    def remember(self, scope: JobScope) -> None:
        """Record that ``scope.incarnation`` holds the claim of ``scope``."""
        assert scope.incarnation is not None
        self._by_key[(scope.job, scope.pipeline, scope.sink_id)] = scope.incarnation

    def owns(self, scope: JobScope) -> bool:
        """Whether this instance claimed ``scope`` (its incarnation included)."""
        key = (scope.job, scope.pipeline, scope.sink_id)
        return self._by_key.get(key) == scope.incarnation

    def owner(self, job: str, pipeline: str, sink_id: str, incarnation: str | None) -> str | None:
        """The incarnation work named with ``incarnation`` commits as."""
        return incarnation or self._by_key.get((job, pipeline, sink_id))

    def group(self, names: Iterable[TxnName]) -> dict[JobScope, list[TxnName]]:
        """``names`` by the scope, with its owning incarnation, they commit in."""
        groups: dict[JobScope, list[TxnName]] = {}
        for n in names:
            owner = self.owner(n.job, n.pipeline, n.sink_id, n.incarnation)
            groups.setdefault(JobScope(n.job, n.pipeline, n.sink_id, owner), []).append(n)
        return groups


@dataclass(frozen=True)
class WriteContext:
    """Where one executor task writes: scope, run, batch, partition, attempt."""

    scope: JobScope
    run: int
    batch_id: int
    partition: int
    attempt: int
    """Spark's task attempt id: unique within a Spark application"""
    attempt_number: int = 0
    """0 for the first attempt of a partition, >0 for retries"""
    lease: int | None = None
    """what ``Sink.lease`` gave the batch on the driver (the Kafka sink's lane of
    pooled transactional ids); None outside a job's pre-commit"""

    def txn_name(self) -> TxnName:
        """The name of this task attempt's transaction (:mod:`sinks.naming`)."""
        return TxnName(
            job=self.scope.job,
            pipeline=self.scope.pipeline,
            sink_id=self.scope.sink_id,
            run=self.run,
            batch_id=self.batch_id,
            partition=self.partition,
            attempt=self.attempt,
            incarnation=self.scope.incarnation,
        )


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


class SinkWriter(abc.ABC):
    """Executor-side writer for one task attempt."""

    @abc.abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Write one record batch inside the task's transaction."""

    @abc.abstractmethod
    def prepare(self) -> Committable | None:
        """Make the written data durable but invisible; return its committable.

        Returns ``None`` when nothing was written (no transaction was opened)."""

    @abc.abstractmethod
    def close(self, failed: bool = False) -> None:
        """Release resources. Unprepared work is rolled back. Prepared work is kept,
        unless ``failed``: the task failed after ``prepare`` (its output will never
        be used), so its prepared work is aborted now rather than by a later sweep."""


REPAYS = "repays"
"""The committable key the coordinator sets (to True) on work that writes an
owed batch again (recovery rule 5, :mod:`lifecycle.replay`): see
:meth:`Sink.commit`."""

OrphanTest = Callable[[TxnName], bool]
"""Decides, for a lingering transaction found by a sink, whether to abort it."""

COMMITTED = "committed"
PREPARED = "prepared"
LOST = "lost"
"""What :meth:`Sink.classify` says of a committable: committed already, still
prepared (a commit would go through), or lost (a commit would raise
:class:`~sinks.errors.TransactionLostError`)."""


@dataclass(frozen=True)
class LingeringTxn:
    """Unfinished work of a job found in a target by :meth:`Sink.lingering`."""

    txn: str
    """the transaction name (:class:`~sinks.naming.TxnName`)"""
    name: TxnName
    state: str
    """what the target says: ``prepared`` (PostgreSQL), ``open`` / ``committed``
    / ``aborted`` (a Kafka announcement not yet tombstoned), ``staged`` (Delta)"""
    detail: str = ""
    """more of what the target says (when prepared, how many files, ...)"""


class Sink(abc.ABC):
    """Driver-side half of a sink and factory of its executor-side writers.

    A sink that keeps state on the driver (connections kept between
    checkpoints) names those attributes in ``_driver_only``: they are never
    pickled to executors, and ``_init_driver_state`` makes them anew after
    unpickling (and in the sink's constructor)."""

    _driver_only: tuple[str, ...] = ()

    def _init_driver_state(self) -> None:  # noqa: B027
        """Create the attributes named in ``_driver_only``."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in self._driver_only:
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_driver_state()

    #: short kind name used in ids and messages ("postgres", "kafka", "delta")
    kind: str = "sink"

    #: whether prepared work has a deadline that runs from its first write (a
    #: Kafka transaction's timeout): such sinks pre-commit after the others of
    #: their pipeline, so that their work waits as briefly as possible
    prepared_work_expires: bool = False

    #: whether each pre-committed batch holds resources of the target until it is
    #: committed (a PostgreSQL prepared transaction: its row locks and a slot of
    #: ``max_prepared_transactions``; a Kafka transaction): such a sink cannot wait,
    #: batch after batch, for a deferred pipeline to finish (``commits_at_finish``)
    prepared_work_holds_resources: bool = False

    #: whether two attempts of one task may run at once (``spark.speculation``):
    #: each attempt's work is its own, a retry never rolls back another attempt's
    #: prepared work, and the sweep ends the attempts Spark did not take. A job
    #: refuses speculation unless every sink says so.
    speculation_safe: bool = False

    #: whether the sink's work is committed once, at the checkpoint that finishes
    #: its pipeline (a replace: ``replace_where``); until then every batch of the
    #: pipeline stays prepared, across restarts. Bounded pipelines only.
    commits_at_finish: bool = False

    def prepared_work_timeout(self) -> float | None:
        """Seconds after which the target aborts prepared work by itself, counted
        from its first write (a Kafka transaction's timeout); None: never."""
        return None

    @property
    @abc.abstractmethod
    def sink_id(self) -> str:
        """Stable id of this sink within its pipeline (part of transaction names)."""

    def partition_columns(self) -> list[str] | None:
        """Columns the input must be hash-partitioned by before writing, if any."""
        return None

    def sort_columns(self) -> list[str] | None:
        """Columns each task's input must be sorted by, if any (a keyed write
        that keeps the last row per key in the task, :mod:`sinks.last_write`)."""
        return None

    def describe(self) -> str:
        """What this sink writes to, for messages (e.g. ``PostgreSQL table t at h:p/db``)."""
        return f"{self.kind} sink {self.sink_id}"

    @abc.abstractmethod
    def preflight(self, schema: pa.Schema) -> None:
        """Fail fast, with a message that says what to change, when this sink
        cannot give exactly-once for input of ``schema``."""

    def evolve_schema(self, schema: pa.Schema) -> None:  # noqa: B027
        """Change the target's schema for input of ``schema`` where the sink's
        options allow it (new columns). The job calls it once at start, after
        recovery settled every prepared transaction of an earlier run and
        before any data is prepared; the default changes nothing."""

    @abc.abstractmethod
    def open_writer(self, ctx: WriteContext, schema: pa.Schema) -> SinkWriter:
        """Open the executor-side writer of one task attempt."""

    def frame_for_write(self, df: Any) -> Any:
        """The micro-batch (a Spark ``DataFrame``) as this sink writes it, on the
        driver before every batch; the default is ``df`` itself. A sink adds the
        columns its target derives and the checks its target makes here (the
        Delta sink: generated columns, CHECK constraints), so that they run on
        the executors, before anything is staged."""
        return df

    def precommit_frame(
        self, df: Any, scope: JobScope, run: int, batch_id: int
    ) -> list[Committable] | None:
        """Pre-commit a whole micro-batch (a Spark ``DataFrame``) with a Spark job
        of the sink's own, on the driver; return its committables. ``None``, the
        default, means: write it with per-task writers (:meth:`open_writer`).

        Same contract as the writers: nothing visible before commit, every staged
        thing named after a transaction of ``scope`` in ``run`` and ``batch_id``
        so that a sweep finds it after any crash."""
        return None

    def lease(self, scope: JobScope, batch_id: int) -> int | None:
        """On the driver, before ``batch_id``'s tasks start: a number the batch's
        writers get as ``WriteContext.lease`` (the Kafka sink's lane of pooled
        transactional ids); None (the default) when the sink needs none."""
        return None

    def settled(self, scope: JobScope, through_batch: int) -> None:  # noqa: B027
        """Every batch of ``scope`` up to ``through_batch`` is decided (committed
        or aborted) and its orphans were swept: what the sink leased them may
        be reused."""

    @abc.abstractmethod
    def commit(self, committables: Sequence[Committable]) -> None:
        """Commit prepared work. Idempotent: committing twice is harmless.

        Retries transient failures; raises :class:`sinks.errors.TransactionLostError`
        when prepared work is gone without having been committed, having
        committed none of ``committables`` when the loss can be found before
        (the coordinator then owes the lost batches: recovery rule 5).

        A committable the coordinator marks ``REPAYS`` (its key set to True)
        writes an owed batch again (rule 5): it commits even when the sink's
        progress holds its batch already (its other tasks' work committed
        before), where other work of a batch at or below the progress is a
        replay and is aborted."""

    @abc.abstractmethod
    def abort(self, committables: Sequence[Committable]) -> None:
        """Abort prepared work. Idempotent: aborting what is gone is harmless."""

    @abc.abstractmethod
    def abort_lingering(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        """Abort every prepared transaction of ``scope`` for which ``is_orphan``
        is true; return the names aborted."""

    def progress(self, scope: JobScope) -> SinkProgress:
        """Read, from the target system, the progress record of ``scope``: which
        incarnation holds the claim and the highest batch it has committed (see
        :mod:`sinks.progress`). The default is a sink that remembers nothing."""
        return SinkProgress(owner=None)

    def claim(self, scope: JobScope, *, start_over_from: str | None = None) -> SinkProgress:
        """Atomically make ``scope.incarnation`` the owner of ``scope`` in the
        target (before any data moves) and return the record as claimed.

        Raises :class:`sinks.progress.IncarnationConflictError` when another
        incarnation holds it, unless it is ``start_over_from`` (an operator's
        explicit choice to start over, recorded in the target). Every commit
        afterwards checks that the claim is still this incarnation's, and never
        commits a batch at or below what the sink holds committed."""
        return SinkProgress(owner=scope.incarnation)

    def check_checkpoint_interval(self, checkpoint_interval_s: float) -> None:  # noqa: B027
        """Raise :class:`sinks.errors.PreflightError` when prepared work could expire
        before a checkpoint of this interval (plus a restart) commits it."""

    def expect_load(self, load: ExpectedLoad) -> None:  # noqa: B027
        """Warn (log) when the target may not hold the work that waits for a
        checkpoint under ``load`` (called once, after :meth:`preflight`)."""

    def checkpoint_pressure(self, batch: Sequence[Committable]) -> str | None:
        """After a batch prepared ``batch`` and it was recorded: a reason to take
        the next checkpoint now rather than at its interval (the target is
        close to a limit on work awaiting commit), or None."""
        return None

    def close(self) -> None:  # noqa: B027
        """Release driver-side resources (called when ``Job.run`` ends)."""

    def settings(self) -> dict[str, Any]:
        """The non-secret, JSON-able settings that build this sink again with
        :func:`sinks.rebuild.from_settings` (``kind``, ``sink_id`` and the
        constructor's arguments). The default names the sink only: a sink of
        another kind cannot be rebuilt by the ``twophase`` commands."""
        return {"kind": self.kind, "sink_id": self.sink_id}

    def lingering(self, job: str, pipeline: str) -> list[LingeringTxn]:
        """List, without changing anything, the unfinished work of (``job``,
        ``pipeline``, this sink) that the target holds, of every incarnation
        and both name formats: what a sweep would consider."""
        raise NotImplementedError(f"{self.describe()} cannot list its lingering work")

    def classify(self, committables: Sequence[Committable]) -> dict[str, str]:
        """``{txn: COMMITTED | PREPARED | LOST}`` for ``committables``, by the
        checks of the commit path, without committing anything."""
        raise NotImplementedError(f"{self.describe()} cannot classify its transactions")

    def evidence(self, committable: Committable) -> dict[str, Any]:
        """What the ledger keeps of a committed ``committable`` for an audit
        (:mod:`sinks.audit`): at least its ``txn`` and ``rows``."""
        return {"txn": committable["txn"], "rows": int(committable.get("rows", 0))}

    def audit(self, scope: JobScope, checkpoints: Sequence[CheckpointEvidence]) -> list[Finding]:
        """Check the evidence of ``checkpoints`` (committed by ``scope``)
        against the target's own records, one :class:`~sinks.audit.Finding` per
        transaction. The default cannot: every one is unverifiable."""
        return [
            Finding(cp.checkpoint, str(c["txn"]), Verdict.UNVERIFIABLE, "not auditable", 0)
            for cp in checkpoints
            for c in cp.committed
        ]

    def retire_evidence(self, scope: JobScope, before_batch: int) -> None:  # noqa: B027
        """The ledger no longer keeps the audit evidence of ``scope``'s batches
        below ``before_batch``: records kept only for audits may go."""

    def forget(self, committables: Sequence[Committable]) -> None:  # noqa: B027
        """Drop bookkeeping kept only to make ``commit`` idempotent (called after
        the ledger has durably recorded that these committables are committed)."""
