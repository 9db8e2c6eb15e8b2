"""Consumer-group offsets of Kafka sources, for lag monitoring only.

Spark's Kafka source commits no consumer-group offsets, so a job reading Kafka
is invisible to lag tools (``kafka-consumer-groups.sh --describe``, Burrow,
lag exporters). As Flink's ``KafkaSource`` does on checkpoint completion, a job
commits, after each checkpoint that completed (every sink committed and the
ledger recorded it), the END offsets of the last batch that checkpoint
committed of each pipeline (Spark's offset log, ``offsets/<batch>``, read as
:mod:`lifecycle.kafka_source` says) to the pipeline's consumer group
(``Job.add_pipeline(source_offsets_group=...)``). The group never runs ahead of
the output: what it holds was committed in every sink before. At each start the
last completed checkpoint's offsets are committed again (a group an operator
changed, or one whose commit a crash cut short, is right again at once).

The group is for monitoring only: recovery never reads it (Spark's checkpoint
and the ledger say where a pipeline resumes), and nothing else of the job
depends on it. The commits are made by one background thread (off the
checkpoint's path: the coordinator only hands the checkpoint over), with one
kafka-python consumer per group and cluster, never subscribed (a "simple
consumer" commit, which joins no group), closed when the run ends. When
checkpoints complete faster than the commits, only the newest batch of each
pipeline is committed. A commit that fails does not fail or stall anything: it
is logged once per streak of failures of the pipeline (a warning; an info line
when commits succeed again), counted in
``twophase_source_offsets_commit_failures_total``, and the next checkpoint
commits newer offsets. ``twophase_source_offsets_timestamp_seconds`` is the
Unix time of the last successful commit.

Before it commits a batch's offsets, the thread checks that Spark's offset log
still holds the offsets the ledger recorded for that batch (their digest):
after a Spark checkpoint was replaced, nothing is committed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from lifecycle.kafka_source import KafkaSource, SourceOffsetsError, end_offsets, kafka_sources
from lifecycle.pipeline import Pipeline
from lifecycle.spark_log import SparkCommitLog
from lifecycle.state.model import Checkpoint
from lifecycle.state.protocol import Ledger

log = logging.getLogger("lifecycle.source_offsets")

COMMIT_TIMEOUT_S = 10.0
"""how long one commit (finding the group's coordinator, then OffsetCommit) may take"""
END_WAIT_S = 5.0
"""how long the end of a run waits for the commits already handed over"""


def group_name(job: str, pipeline: str, option: str | bool) -> str | None:
    """The consumer group of a pipeline's ``source_offsets_group`` option: its
    name, ``twophase.<job>.<pipeline>`` for True, None for False."""
    if option is True:
        return f"twophase.{job}.{pipeline}"
    return option or None


@dataclass
class _Target:
    """A pipeline whose Kafka source offsets go to ``group``."""

    pipeline: str
    group: str
    sources: list[KafkaSource]
    commit_log: SparkCommitLog
    overrides: dict[str, Any]
    failing: bool = False
    committed: int = -1  # the last batch committed in this run
    clients: dict[str, Any] = field(default_factory=dict)  # cluster -> KafkaConsumer


class SourceOffsets:
    """Commits the Kafka source offsets of completed checkpoints to consumer
    groups (module docstring). One per job, its metrics in ``registry``;
    :meth:`begin` and :meth:`end` bound each run."""

    def __init__(self, job: str, registry: CollectorRegistry) -> None:
        self.job = job
        self._failures = Counter(
            "twophase_source_offsets_commit_failures",
            "Commits of a pipeline's Kafka source offsets to its consumer group that failed "
            "(monitoring only: the job goes on)",
            ["job", "pipeline"],
            registry=registry,
        )
        self._committed_at = Gauge(
            "twophase_source_offsets_timestamp_seconds",
            "Unix time a pipeline's Kafka source offsets were last committed to its consumer group",
            ["job", "pipeline"],
            registry=registry,
        )
        self._run: _Run | None = None

    def begin(self, pipelines: Iterable[Pipeline], ledger: Ledger) -> None:
        """A run begins: find each pipeline's Kafka sources, and hand over the
        offsets of the last completed checkpoint. Never raises."""
        targets: dict[str, _Target] = {}
        for p in pipelines:
            group = group_name(self.job, p.name, p.source_offsets_group)
            if group is None:
                continue
            try:
                sources = kafka_sources(p.query_dataframe())
            except Exception as e:
                log.warning(
                    "pipeline %s: cannot tell its Kafka sources (%s): no consumer-group "
                    "offsets are committed for it",
                    p.name,
                    _one_line(e),
                )
                continue
            if not sources:
                if p.source_offsets_group is not True:  # asked for by name
                    log.info("pipeline %s reads no Kafka source: no group %r", p.name, group)
                continue
            commit_log = SparkCommitLog(p.store, p.spark_location)
            overrides = dict(p.source_offsets_config or {})
            targets[p.name] = _Target(p.name, group, sources, commit_log, overrides)
            self._failures.labels(self.job, p.name)  # 0 until one fails
        if not targets:
            self._run = None
            return
        self._run = _Run(self, targets, ledger)
        self._run.start()

    def checkpoint_completed(self, cp: Checkpoint) -> None:
        """Checkpoint ``cp`` completed: hand its batches over to the committing
        thread (the coordinator calls this; it returns at once, never raises)."""
        run = self._run
        if run is not None:
            run.hand_over(cp.cut, f"checkpoint {cp.id}")

    def end(self, wait: float = END_WAIT_S) -> None:
        """The run ends: commit what was handed over (waiting up to ``wait``
        seconds), then close the consumers."""
        run, self._run = self._run, None
        if run is not None:
            run.end(wait)

    def failed(self, pipeline: str) -> None:
        """Count a commit of ``pipeline``'s offsets that failed."""
        self._failures.labels(self.job, pipeline).inc()

    def committed(self, pipeline: str) -> None:
        """A commit of ``pipeline``'s offsets succeeded now."""
        self._committed_at.labels(self.job, pipeline).set(time.time())


class _Run:
    """The committing thread of one run, and what it commits."""

    def __init__(self, owner: SourceOffsets, targets: dict[str, _Target], ledger: Ledger) -> None:
        self.owner = owner
        self.job = owner.job
        self.targets = targets
        self.ledger = ledger
        self._cond = threading.Condition()
        self._wanted: dict[str, int] = {}  # pipeline -> the batch to commit next
        self._closing = False
        self._thread = threading.Thread(
            target=self._work, name="twophase-source-offsets", daemon=True
        )

    def start(self) -> None:
        """Hand over the last completed checkpoint's batches, start the thread."""
        self.hand_over({p: self.ledger.committed_cut(p) for p in self.targets}, "the start")
        self._thread.start()

    def hand_over(self, cut: dict[str, int], what: str) -> None:
        """Commit the end offsets of these batches (pipeline -> batch) next."""
        try:
            with self._cond:
                for p, batch in cut.items():
                    if p in self.targets and batch >= 0:
                        self._wanted[p] = max(batch, self._wanted.get(p, -1))
                self._cond.notify_all()
        except Exception:
            log.exception("handing over the source offsets of %s", what)

    def end(self, wait: float) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(wait)
        if self._thread.is_alive():
            log.warning(
                "the consumer-group offsets of the last checkpoint were not committed within "
                "%.0f s; the job ends without them (its next run commits them)",
                wait,
            )
            return  # the consumers are the thread's still; it ends with the process
        for target in self.targets.values():
            _close_all(target)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._wanted and not self._closing:
                    self._cond.wait()
                if not self._wanted:
                    return
                wanted, self._wanted = self._wanted, {}
            for p, batch in sorted(wanted.items()):
                target = self.targets[p]
                if batch > target.committed:
                    self._commit(target, batch)

    def _commit(self, target: _Target, batch: int) -> None:
        try:
            for cluster, (config, offsets) in self._offsets(target, batch).items():
                self._send(target, cluster, config, offsets, batch)
        except Exception as e:
            self.owner.failed(target.pipeline)
            if not target.failing:
                target.failing = True
                log.warning(
                    "pipeline %s: could not commit the Kafka source offsets of batch %d to "
                    "consumer group %r: %s. The job goes on (the group is for monitoring "
                    "only); lag tools show the group behind until a commit succeeds. Counted "
                    "in twophase_source_offsets_commit_failures_total; not repeated until "
                    "then",
                    target.pipeline,
                    batch,
                    target.group,
                    _one_line(e),
                )
            _close_all(target)  # connect anew next time
            return
        first, target.committed = target.committed < 0, batch
        self.owner.committed(target.pipeline)
        if first and not target.failing:
            log.info(
                "pipeline %s: its Kafka source offsets go to consumer group %r after each "
                "checkpoint (for lag monitoring; recovery never reads them)",
                target.pipeline,
                target.group,
            )
        if target.failing:
            target.failing = False
            log.info(
                "pipeline %s: its Kafka source offsets are committed to consumer group %r again",
                target.pipeline,
                target.group,
            )

    def _offsets(
        self, target: _Target, batch: int
    ) -> dict[str, tuple[dict[str, Any], dict[tuple[str, int], int]]]:
        """Per cluster, kafka-python settings and the end offsets of ``batch``
        (the lowest where two sources read one partition)."""
        lines = target.commit_log.planned_offsets(batch)
        if lines is None:
            raise SourceOffsetsError(f"Spark's offset log no longer holds batch {batch}")
        recorded = self.ledger.committed_digest(target.pipeline, batch)
        if recorded is not None and target.commit_log.offsets_digest(batch) != recorded:
            raise SourceOffsetsError(
                f"Spark's offset log holds other offsets for batch {batch} than the ledger "
                "recorded (its checkpoint was replaced)"
            )
        out: dict[str, tuple[dict[str, Any], dict[tuple[str, int], int]]] = {}
        for source, offsets in end_offsets(lines, target.sources):
            config = source.client_config(target.overrides)
            cluster = repr(sorted(config.items(), key=lambda kv: kv[0]))
            merged = out.setdefault(cluster, (config, {}))[1]
            for tp, offset in offsets.items():
                merged[tp] = min(offset, merged.get(tp, offset))
        return out

    def _send(
        self,
        target: _Target,
        cluster: str,
        config: dict[str, Any],
        offsets: dict[tuple[str, int], int],
        batch: int,
    ) -> None:
        """Commit ``offsets`` to the group on ``cluster`` (``config`` reaches it)."""
        from kafka import KafkaConsumer, OffsetAndMetadata, TopicPartition

        client = target.clients.get(cluster)
        if client is None:
            settings = {"client_id": f"twophase-offsets-{self.job}", **config}
            client = KafkaConsumer(**settings, group_id=target.group, enable_auto_commit=False)
            target.clients[cluster] = client
        note = f"twophase job {self.job}, pipeline {target.pipeline}, batch {batch}"
        client.commit(
            {TopicPartition(t, p): OffsetAndMetadata(o, note, -1) for (t, p), o in offsets.items()},
            timeout_ms=int(COMMIT_TIMEOUT_S * 1000),
        )


def _close_all(target: _Target) -> None:
    clients, target.clients = target.clients, {}
    for client in clients.values():
        with contextlib.suppress(Exception):
            client.close(autocommit=False, timeout_ms=1000)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
