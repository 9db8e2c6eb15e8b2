"""A job's figures as Prometheus metrics (``prometheus_client``), one registry per
:class:`~lifecycle.job.Job`.

The coordinator and the job report what happens (:class:`JobMetrics` methods);
figures that age between two events (the time since the last checkpoint, the age
of the oldest open Kafka transaction) are computed when they are read. Served
over HTTP by ``Job(metrics_port=...)``, and read in Python with
``Job.metrics()``. Every metric has the label ``job``; per pipeline and per sink
they add ``pipeline`` and ``sink`` (the sink's ``sink_id``).

Each metric, its labels and what it counts: the operating page of the docs
("Metrics"); the alert rules that read them: ``integration/prometheus``.

Recovery actions count transactions, by ``rule`` (:data:`RECOVERY_RULES`; what
each means: the operating page of the docs, "Metrics").

The gauges are computed when read (:mod:`lifecycle.gauges`). When the endpoint
was scraped during a run, the job at its end waits for one more scrape (at most
``Job(metrics_linger=...)`` seconds), so that Prometheus sees the final state:
the alert on a job that stopped with work pending reads it. The two
``twophase_source_offsets_*`` metrics, of the consumer-group offsets
of Kafka sources, are registered by :mod:`lifecycle.source_offsets`.

"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import Metric

from lifecycle.gauges import Key, LiveGauges, Snapshot
from lifecycle.progress import Counts
from lifecycle.state.model import KINDS

JOB_STATES = (
    "starting",
    "recovering",
    "running",
    "draining",
    "stopping",
    "finished",
    "stopped",
    "failed",
)
"""What ``twophase_job_state`` can say (also the heartbeat's ``state``)."""

RECOVERY_RULES = (
    "commit_decided",
    "commit_completed",
    "abort_replayed",
    "abort_rerun",
    "sweep_orphans",
    "skip_abandoned",
    "owe_lost",
    "repay_owed",
)
"""The ``rule`` label of ``twophase_recovery_actions_total``."""

_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True)
class MetricSample:
    """One value of :meth:`lifecycle.job.Job.metrics`: the Prometheus sample name
    (``..._total`` for counters, ``..._bucket``/``_sum``/``_count`` for the
    histogram), its labels and its value."""

    name: str
    labels: Mapping[str, str]
    value: float


def committable_bytes(c: Mapping[str, Any]) -> int:
    """The bytes a committable wrote: its ``bytes``, or the size of its Delta
    add actions."""
    if "bytes" in c:
        return int(c["bytes"])
    return sum(int(a.get("size", 0)) for a in c.get("adds", ()))


class JobMetrics:
    """The metrics of one job: a registry of its own, and what fills it."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.registry = CollectorRegistry()
        r = self.registry
        self._checkpoints_completed = Counter(
            "twophase_checkpoints_completed",
            "Checkpoints committed, by kind",
            ["job", "kind"],
            registry=r,
        )
        self._checkpoints_failed = Counter(
            "twophase_checkpoints_failed",
            "Checkpoints decided whose commit failed in some sink (the next start finishes them)",
            ["job", "kind"],
            registry=r,
        )
        self._checkpoint_duration = Histogram(
            "twophase_checkpoint_duration_seconds",
            "Seconds from a checkpoint's decision to its commit in every sink",
            ["job", "kind"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self._commit_latency = Histogram(
            "twophase_commit_latency_seconds",
            "Seconds from a batch's pre-commit (recorded in the ledger) to its commit",
            ["job", "pipeline"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        sink_labels = ["job", "pipeline", "sink"]
        self._rows_committed = Counter(
            "twophase_rows_committed", "Rows committed", sink_labels, registry=r
        )
        self._bytes_committed = Counter(
            "twophase_bytes_committed",
            "Bytes committed (COPY data, Kafka record batches, Parquet files)",
            sink_labels,
            registry=r,
        )
        self._rows_prepared = Counter(
            "twophase_rows_prepared",
            "Rows pre-committed (written and prepared, awaiting a checkpoint)",
            sink_labels,
            registry=r,
        )
        self._batches_prepared = Counter(
            "twophase_batches_prepared",
            "Micro-batches pre-committed and recorded in the ledger",
            ["job", "pipeline"],
            registry=r,
        )
        self._commit_retries = Counter(
            "twophase_commit_retries",
            "Retries of a commit or abort after a transient error",
            sink_labels,
            registry=r,
        )
        self._recovery_actions = Counter(
            "twophase_recovery_actions",
            "Transactions moved by a recovery rule",
            [*sink_labels, "rule"],
            registry=r,
        )
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], tuple[int, int]] = {}  # (p, sid) -> (txns, rows)
        self._batches: dict[str, tuple[int, float | None]] = {}  # p -> (batches, oldest at)
        self._kafka_oldest: dict[Key, float] = {}  # (p, sid) -> opened_at
        self._oldest_prepared: dict[Key, float] = {}  # (p, sid) -> opened or recorded at
        self._writing: dict[str, float] = {}  # p -> when the batch being written began
        self._timeouts: dict[Key, float] = {}  # (p, sid) -> seconds
        self._age_limits: dict[Key, float] = {}
        self._server_slots: dict[Key, Callable[[], tuple[int, int] | None]] = {}
        self._interval: float | None = None
        self._recovered_at: dict[tuple[str, str, str], float] = {}
        self._began = time.time()
        self._last_checkpoint: float | None = None
        self._end_of_input: dict[str, float] = {}
        self._final_at: float | None = None
        self._end_to_final: float | None = None
        self._incarnation = ""
        self._run = 0
        self._counts: dict[str, Counts] = {}
        self.checkpoints = 0
        """checkpoints committed so far"""
        self.state = "starting"
        self._pipeline_states: Callable[[], Mapping[str, str]] = dict
        self._state_names: tuple[str, ...] = ()
        self._sinks: list[tuple[str, str]] = []
        self._server: Any = None
        self._server_thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None
        """(host, port) the endpoint listens on while :meth:`serve` runs"""
        self._scraped = threading.Condition(self._lock)
        self._scrapes = 0
        self._last_read_from = 0.0  # when the newest scrape that completed began
        r.register(LiveGauges(self.snapshot))

    # -- what the job tells ----------------------------------------------------------

    def began(
        self,
        incarnation: str | None,
        run: int,
        pipeline_states: Callable[[], Mapping[str, str]],
        state_names: Iterable[str],
        sinks: Iterable[Key],
        timeouts: Mapping[Key, float],
        *,
        interval: float | None = None,
        age_limits: Mapping[Key, float] | None = None,
        server_slots: Mapping[Key, Callable[[], tuple[int, int] | None]] | None = None,
    ) -> None:
        """A run began: its identity, where pipeline states are read (one of
        ``state_names`` each), and the transaction timeout of every sink that has
        one; ``sinks``: every (pipeline, sink id) of the job, whose gauges show
        0 until there is something to show; ``interval``: the checkpoint
        interval; ``age_limits``: the age past which a sink's prepared work
        harms its target; ``server_slots``: where a sink reads its server's
        prepared transactions and their limit."""
        with self._lock:
            self._interval = interval
            self._age_limits = dict(age_limits or timeouts)
            self._server_slots = dict(server_slots or {})
        for p, sid in set(sinks):  # every series exists from the start, at 0
            for rule in RECOVERY_RULES:
                self._recovery_actions.labels(self.job, p, sid, rule)
                with self._lock:
                    self._recovered_at.setdefault((p, sid, rule), 0.0)
            for counter in (self._rows_committed, self._bytes_committed, self._commit_retries):
                counter.labels(self.job, p, sid)
        for kind in KINDS:  # the ``kind`` label of the checkpoint metrics
            self._checkpoints_completed.labels(self.job, kind)
            self._checkpoints_failed.labels(self.job, kind)
            self._state_names = tuple(state_names)
            self._sinks = sorted(set(sinks))
            self._incarnation = incarnation or ""
            self._run = run
            self._began = time.time()
            self._pipeline_states = pipeline_states
            self._timeouts = dict(timeouts)

    def input_consumed(self, pipeline: str, at: float | None = None) -> None:
        with self._lock:
            self._end_of_input.setdefault(pipeline, at if at is not None else time.time())

    def final_committed(self, at: float, since_end_of_input: float | None) -> None:
        with self._lock:
            self._final_at = at
            self._end_to_final = since_end_of_input

    # -- what the coordinator tells --------------------------------------------------

    def writing(self, pipeline: str, began: bool) -> None:
        """A batch of ``pipeline`` began (``began``) or ended being written."""
        with self._lock:
            if began:
                self._writing[pipeline] = time.time()
            else:
                self._writing.pop(pipeline, None)

    def prepared(
        self, pipeline: str, committables: Mapping[str, Iterable[Mapping[str, Any]]]
    ) -> None:
        """A batch of ``pipeline`` was pre-committed and recorded."""
        self._batches_prepared.labels(self.job, pipeline).inc()
        most = 0
        for sid, cs in committables.items():
            rows = sum(int(c.get("rows", 0)) for c in cs)
            self._rows_prepared.labels(self.job, pipeline, sid).inc(rows)
            most = max(most, rows)
        with self._lock:
            c = self._counts.setdefault(pipeline, Counts())
            c.batches += 1
            c.rows_prepared += most

    def checkpoint_committed(
        self,
        kind: str,
        seconds: float,
        committed: Mapping[tuple[str, str], Iterable[Mapping[str, Any]]],
        at: float,
    ) -> None:
        most: dict[str, int] = {}
        recorded: set[tuple[str, float]] = set()  # (pipeline, a batch's registered_at)
        for (p, sid), cs in committed.items():
            cs = list(cs)
            recorded.update((p, float(c["registered_at"])) for c in cs if "registered_at" in c)
            rows = sum(int(c.get("rows", 0)) for c in cs)
            self._rows_committed.labels(self.job, p, sid).inc(rows)
            self._bytes_committed.labels(self.job, p, sid).inc(sum(map(committable_bytes, cs)))
            most[p] = max(most.get(p, 0), rows)
        self._checkpoints_completed.labels(self.job, kind).inc()
        self._checkpoint_duration.labels(self.job, kind).observe(seconds)
        for p, registered in recorded:
            self._commit_latency.labels(self.job, p).observe(max(0.0, at - registered))
        with self._lock:
            self._last_checkpoint = at
            self.checkpoints += 1
            for p, rows in most.items():
                self._counts.setdefault(p, Counts()).rows_committed += rows

    def checkpoint_failed(self, kind: str, seconds: float) -> None:
        self._checkpoints_failed.labels(self.job, kind).inc()
        self._checkpoint_duration.labels(self.job, kind).observe(seconds)

    def recovery_action(self, rule: str, pipeline: str, sink: str, txns: int) -> None:
        self._recovery_actions.labels(self.job, pipeline, sink, rule).inc(txns)
        if txns:
            with self._lock:
                self._recovered_at[(pipeline, sink, rule)] = time.time()

    def retried(self, pipeline: str, sink: str) -> Callable[[], None]:
        """What a commit of (pipeline, sink) calls at each retry."""
        counter = self._commit_retries.labels(self.job, pipeline, sink)
        return counter.inc

    def pending_changed(
        self, pending: Mapping[str, Mapping[int, Mapping[str, Sequence[Mapping[str, Any]]]]]
    ) -> None:
        """The ledger's pending batches now (pipeline -> batch -> sink -> committables)."""
        txns: dict[tuple[str, str], tuple[int, int]] = {}
        batches: dict[str, tuple[int, float | None]] = {}
        kafka: dict[Key, float] = {}
        first: dict[Key, float] = {}
        for p, by_batch in pending.items():
            oldest: float | None = None
            for sinks in by_batch.values():
                for sid, cs in sinks.items():
                    n, rows = txns.get((p, sid), (0, 0))
                    txns[(p, sid)] = (n + len(cs), rows + sum(int(c.get("rows", 0)) for c in cs))
                    for c in cs:
                        at = c.get("registered_at")
                        if at is not None and (oldest is None or at < oldest):
                            oldest = float(at)
                        opened = c.get("opened_at")
                        if opened is not None and float(opened) < kafka.get((p, sid), 1e300):
                            kafka[(p, sid)] = float(opened)
                        since = opened if opened is not None else at
                        if since is not None and float(since) < first.get((p, sid), 1e300):
                            first[(p, sid)] = float(since)
            batches[p] = (len(by_batch), oldest)
        with self._lock:
            self._pending = txns
            self._batches = batches
            self._kafka_oldest = kafka
            self._oldest_prepared = first

    # -- reading ---------------------------------------------------------------------

    def counts(self) -> dict[str, Counts]:
        """Per pipeline, what it did in this job object's runs (rows: of the
        sink that got the most)."""
        with self._lock:
            return {p: dataclasses.replace(c) for p, c in self._counts.items()}

    def snapshot(self) -> Snapshot:
        """What the gauges show now (:mod:`lifecycle.gauges`)."""
        with self._lock:
            return Snapshot(
                job=self.job,
                state=self.state,
                state_names=JOB_STATES,
                pipeline_state_names=self._state_names,
                pipeline_states=dict(self._pipeline_states()),
                sinks=list(self._sinks),
                pending=dict(self._pending),
                batches=dict(self._batches),
                writing=dict(self._writing),
                oldest_prepared=dict(self._oldest_prepared),
                kafka_opened=dict(self._kafka_oldest),
                timeouts=dict(self._timeouts),
                age_limits=dict(self._age_limits),
                server_slots=dict(self._server_slots),
                interval=self._interval,
                began=self._began,
                last_checkpoint=self._last_checkpoint,
                ends=dict(self._end_of_input),
                final_at=self._final_at,
                to_final=self._end_to_final,
                incarnation=self._incarnation,
                run=self._run,
                recovered_at=dict(self._recovered_at),
            )

    def samples(self) -> list[MetricSample]:
        """Every sample the registry holds now."""
        return [
            MetricSample(s.name, dict(s.labels), float(s.value))
            for family in self.registry.collect()
            for s in family.samples
        ]

    def serve(self, port: int, addr: str = "127.0.0.1") -> tuple[str, int]:
        """Serve the registry over HTTP (``/metrics``) until :meth:`stop_serving`;
        port 0 picks a free one. Returns the address it listens on."""
        if self._server is not None:
            assert self.address is not None
            return self.address
        self._server, self._server_thread = start_http_server(port, addr, _Scraped(self))
        host, bound = self._server.server_address[:2]
        self.address = (str(host), int(bound))
        return self.address

    def scraped(self, began: float) -> None:
        """The endpoint was read, by a scrape that began at ``began`` (monotonic)."""
        with self._scraped:
            self._scrapes += 1
            self._last_read_from = max(self._last_read_from, began)
            self._scraped.notify_all()

    def stop_serving(self, linger: float = 0.0, final_since: float | None = None) -> None:
        """Stop the endpoint; when it was scraped before, first wait (at most
        ``linger`` seconds) for a scrape that began at or after ``final_since``
        (monotonic; default now: when the run's final state was set), so that
        Prometheus reads that state and not the last one before it."""
        with self._scraped:
            since = time.monotonic() if final_since is None else final_since
            if self._server is not None and self._scrapes > 0 and linger > 0:
                self._scraped.wait_for(lambda: self._last_read_from >= since, timeout=linger)
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._server_thread is not None:
            self._server_thread.join(5)
            self._server_thread = None
        self.address = None


class _Scraped:
    """The registry as the endpoint reads it: each read is counted
    (:meth:`JobMetrics.scraped`) once the registry is collected."""

    def __init__(self, metrics: JobMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        began = time.monotonic()
        yield from self._metrics.registry.collect()
        self._metrics.scraped(began)  # once every family is read

    def restricted_registry(self, names: Iterable[str]) -> Any:
        self._metrics.scraped(time.monotonic())
        return self._metrics.registry.restricted_registry(names)
