"""The two-phase sink protocol: a table of contents.

A sink has two halves that run in different processes, and a few opt-in
capabilities:

* :class:`Sink`: the sink's face, on the driver: its options, ``preflight``,
  ``settings``, and the factory of its writers and of its committer;
* :class:`SinkWriter`: the executor side, one per task attempt: ``write``
  Arrow batches, ``prepare`` (durable but invisible), ``close``; where it
  writes is its :class:`WriteContext`;
* :class:`~sinks.committer.Committer` (:mod:`sinks.committer`): the driver
  side, one per sink: ``claim``, ``progress``, ``commit``, ``abort``,
  ``classify`` (an :class:`~sinks.committer.Outcome`: committed, prepared or
  lost), ``lingering``, ``sweep``, ``forget``;
* :data:`Committable`: what ``prepare`` returns and ``commit`` takes;
* :class:`~sinks.scope.JobScope` (:mod:`sinks.scope`): the job, pipeline,
  sink and incarnation that write;
* :mod:`sinks.capabilities`: what only some sinks need: staging through Spark,
  work that expires, work that holds the target's resources, leased ids,
  audits, evidence kept in the target.

``prepare`` makes the written data durable but invisible (a prepared PostgreSQL
transaction, a flushed Kafka transaction, staged Parquet files) and returns a
small JSON-serialisable committable that travels back to the driver; the
coordinator records it in its ledger and, once the checkpoint is complete, has
the committer commit it (:mod:`lifecycle.coordinator` states the recovery
rules). "Write your own sink" in the docs walks through a complete one.

Sinks are pickled and shipped to executors, so they hold configuration only;
connections are opened inside methods, and driver-side state (the committer)
is named in ``_driver_only``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from sinks import capabilities
from sinks.capabilities import ExpectedLoad
from sinks.committer import REPAYS, Committable, Committer, LingeringTxn, OrphanTest, Outcome
from sinks.naming import TxnName
from sinks.scope import ClaimedScopes, JobScope

__all__ = [
    "REPAYS",
    "ClaimedScopes",
    "Committable",
    "Committer",
    "ExpectedLoad",
    "JobScope",
    "LingeringTxn",
    "OrphanTest",
    "Outcome",
    "Sink",
    "SinkWriter",
    "WriteContext",
]


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
    """what the committer's ``lease`` gave the batch on the driver
    (:class:`~sinks.capabilities.LeasesIds` (the Kafka sink's lane of
    pooled transactional ids)); None outside a job's pre-commit"""

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


class Sink(abc.ABC):
    """A sink's face: its options, its preflight, the factory of its writers
    (executor side) and of its committer (driver side).

    A sink that keeps state on the driver (its committer, connections kept
    between checkpoints) names those attributes in ``_driver_only``: they are
    never pickled to executors, and ``_init_driver_state`` makes them anew
    after unpickling (and in the sink's constructor)."""

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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a sink written for the protocol before the committer: a method
        it defines that no coordinator would call any more would be ignored."""
        super().__init_subclass__(**kwargs)
        stale = [
            f"{name} ({home.__module__}.{home.__qualname__}{note})"
            for name, (home, note) in _MOVED.items()
            if name in vars(cls) and not issubclass(cls, home)
        ]
        if stale:
            raise TypeError(
                f"{cls.__qualname__} defines {', '.join(stale)}: the sink protocol no longer "
                "calls these on a Sink. Its committer() returns a Committer with claim, "
                "progress, commit, abort, classify, lingering, sweep and forget; what only "
                "some sinks need is a capability of sinks.capabilities, inherited by the "
                "sink or by its committer (docs: Write your own sink)"
            )

    # -- options ----------------------------------------------------------------------

    #: short kind name used in ids and messages ("postgres", "kafka", "delta")
    kind: str = "sink"

    #: whether two attempts of one task may run at once (``spark.speculation``):
    #: each attempt's work is its own, a retry never rolls back another attempt's
    #: prepared work, and the sweep ends the attempts Spark did not take. A job
    #: refuses speculation unless every sink says so.
    speculation_safe: bool = False

    #: whether the sink's work is committed once, at the checkpoint that finishes
    #: its pipeline (a replace: ``replace_where``); until then every batch of the
    #: pipeline stays prepared, across restarts. Bounded pipelines only.
    commits_at_finish: bool = False

    @property
    @abc.abstractmethod
    def sink_id(self) -> str:
        """Stable id of this sink within its pipeline (part of transaction names)."""

    def describe(self) -> str:
        """What this sink writes to, for messages (e.g. ``PostgreSQL table t at h:p/db``)."""
        return f"{self.kind} sink {self.sink_id}"

    def partition_columns(self) -> list[str] | None:
        """Columns the input must be clustered by before writing, if any: every
        row of one value in one partition. The binding repartitions the batch
        by them unless Spark's plan already clusters it so
        (:mod:`lifecycle.partitioning`)."""
        return None

    def sort_columns(self) -> list[str] | None:
        """Columns each task's input must be sorted by, if any (a keyed write
        that keeps the last row per key in the task, :mod:`sinks.last_write`)."""
        return None

    def settings(self) -> dict[str, Any]:
        """The non-secret, JSON-able settings that build this sink again with
        :func:`sinks.rebuild.from_settings` (``kind``, ``sink_id`` and the
        constructor's arguments). The default names the sink and its class
        (``"class": "module:Name"``): a sink of your own that adds its
        arguments and defines a classmethod ``from_settings(settings,
        secrets)`` is rebuilt by the ``twophase`` commands too."""
        cls = type(self)
        return {
            "kind": self.kind,
            "sink_id": self.sink_id,
            "class": f"{cls.__module__}:{cls.__qualname__}",
        }

    # -- preflight: before any data moves ------------------------------------------------

    def check_checkpoint_interval(self, checkpoint_interval_s: float) -> None:  # noqa: B027
        """Raise :class:`sinks.errors.PreflightError` when this sink cannot give
        exactly-once at this checkpoint interval (prepared work that could expire
        before a checkpoint, plus a restart, commits it); called before
        :meth:`preflight`."""

    @abc.abstractmethod
    def preflight(self, schema: pa.Schema) -> None:
        """Fail fast, with a message that says what to change, when this sink
        cannot give exactly-once for input of ``schema``."""

    def evolve_schema(self, schema: pa.Schema) -> None:  # noqa: B027
        """Change the target's schema for input of ``schema`` where the sink's
        options allow it (new columns). The job calls it once at start, after
        recovery settled every prepared transaction of an earlier run and
        before any data is prepared; the default changes nothing."""

    # -- the two halves -----------------------------------------------------------------

    @abc.abstractmethod
    def open_writer(self, ctx: WriteContext, schema: pa.Schema) -> SinkWriter:
        """Open the executor-side writer of one task attempt."""

    @abc.abstractmethod
    def committer(self) -> Committer:
        """The driver-side committer of this sink: the same object every call
        (driver-only state, never pickled)."""

    def close(self) -> None:  # noqa: B027
        """Release driver-side resources (called when ``Job.run`` ends)."""


_MOVED: dict[str, tuple[type, str]] = {
    **{
        name: (Committer, "")
        for name in ("commit", "abort", "classify", "lingering", "forget", "progress", "claim")
    },
    "abort_lingering": (Committer, ": now sweep"),
    "evidence": (capabilities.Audits, ", on the committer"),
    "audit": (capabilities.Audits, ", on the committer"),
    "retire_evidence": (capabilities.RetiresEvidence, ", on the committer"),
    "lease": (capabilities.LeasesIds, ", on the committer"),
    "settled": (capabilities.LeasesIds, ", on the committer"),
    "frame_for_write": (capabilities.StagesThroughSpark, ""),
    "precommit_frame": (capabilities.StagesThroughSpark, ""),
    "prepared_work_timeout": (capabilities.ExpiringWork, ""),
    "prepared_work_expires": (capabilities.ExpiringWork, ": inherit it instead"),
    "checkpoint_pressure": (capabilities.HoldsPreparedWork, ""),
    "expect_load": (capabilities.HoldsPreparedWork, ""),
    "prepared_work_holds_resources": (
        capabilities.HoldsPreparedWork,
        ": its holds_prepared_work() instead",
    ),
}
"""What a Sink of the protocol before the committer defined, and where it lives
now (a sink that defines it without being that is refused)."""
