"""A job's figures as Prometheus metrics (``prometheus_client``), one registry per
:class:`~lifecycle.job.Job`.

The coordinator and the job report what happens (:class:`JobMetrics` methods);
figures that age between two events (the time since the last checkpoint, the age
of the oldest open Kafka transaction) are computed when they are read. Served
over HTTP by ``Job(metrics_port=...)``, and read in Python with
``Job.metrics()``. Every metric has the label ``job``; per pipeline and per sink
they add ``pipeline`` and ``sink`` (the sink's ``sink_id``).

=================================================  =======  ================================
metric                                             type     labels (beyond ``job``)
=================================================  =======  ================================
``twophase_checkpoints_completed_total``           counter  ``kind``
``twophase_checkpoints_failed_total``              counter  ``kind``
``twophase_checkpoint_duration_seconds``           histo.   ``kind`` (decision to commit done)
``twophase_rows_committed_total``                  counter  ``pipeline``, ``sink``
``twophase_bytes_committed_total``                 counter  ``pipeline``, ``sink``
``twophase_rows_prepared_total``                   counter  ``pipeline``, ``sink`` (pre-committed)
``twophase_batches_prepared_total``                counter  ``pipeline``
``twophase_commit_retries_total``                  counter  ``pipeline``, ``sink``
``twophase_recovery_actions_total``                counter  ``pipeline``, ``sink``, ``rule``
``twophase_batches_pending``                       gauge    ``pipeline``
``twophase_committables_pending``                  gauge    ``pipeline``
``twophase_prepared_transactions_open``            gauge    ``pipeline``, ``sink``
``twophase_rows_pending``                          gauge    ``pipeline``, ``sink``
``twophase_oldest_pending_age_seconds``            gauge    ``pipeline``
``twophase_kafka_oldest_transaction_age_seconds``  gauge    ``pipeline``, ``sink``
``twophase_kafka_transaction_timeout_seconds``     gauge    ``pipeline``, ``sink``
``twophase_last_checkpoint_timestamp_seconds``     gauge
``twophase_seconds_since_last_checkpoint``         gauge    (since the run began, before one)
``twophase_end_of_input_timestamp_seconds``        gauge    ``pipeline``
``twophase_final_checkpoint_timestamp_seconds``    gauge
``twophase_end_of_input_to_final_seconds``         gauge
``twophase_job_state``                             gauge    ``state`` (1 for the current one)
``twophase_pipeline_state``                        gauge    ``pipeline``, ``state``
``twophase_job_info``                              gauge    ``incarnation``, ``run``
``twophase_source_offsets_commit_failures_total``  counter  ``pipeline``
``twophase_source_offsets_timestamp_seconds``      gauge    ``pipeline``
=================================================  =======  ================================

Recovery actions count transactions, by ``rule``: ``commit_decided`` (a
checkpoint decided before a crash is finished), ``commit_completed`` (work
Spark completed is committed at start), ``abort_replayed`` (work Spark did not
complete is rolled back; Spark replays it), ``abort_rerun`` (an earlier attempt
of a batch Spark ran again), ``sweep_orphans`` (work no ledger entry owns:
failed or speculative task attempts, earlier runs), ``skip_abandoned``
(transactions an operator gave up with ``twophase abandon``), ``owe_lost``
(transactions found lost in a target, at a start or during a run, whose
batches are owed and written again from the source: :mod:`lifecycle.replay`) and ``repay_owed``
(the transactions that wrote it again, committed).

The two ``twophase_source_offsets_*`` metrics, of the consumer-group offsets
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
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lifecycle.progress import Counts

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
        self._kafka_oldest: dict[tuple[str, str], float] = {}  # (p, sid) -> opened_at
        self._timeouts: dict[tuple[str, str], float] = {}  # (p, sid) -> seconds
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
        r.register(_Live(self))

    # -- what the job tells ----------------------------------------------------------

    def began(
        self,
        incarnation: str | None,
        run: int,
        pipeline_states: Callable[[], Mapping[str, str]],
        state_names: Iterable[str],
        sinks: Iterable[tuple[str, str]],
        timeouts: Mapping[tuple[str, str], float],
    ) -> None:
        """A run began: its identity, where pipeline states are read (one of
        ``state_names`` each), and the transaction timeout of every sink that has
        one; ``sinks``: every (pipeline, sink id) of the job, whose gauges show
        0 until there is something to show."""
        with self._lock:
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
        for (p, sid), cs in committed.items():
            cs = list(cs)
            rows = sum(int(c.get("rows", 0)) for c in cs)
            self._rows_committed.labels(self.job, p, sid).inc(rows)
            self._bytes_committed.labels(self.job, p, sid).inc(sum(map(committable_bytes, cs)))
            most[p] = max(most.get(p, 0), rows)
        self._checkpoints_completed.labels(self.job, kind).inc()
        self._checkpoint_duration.labels(self.job, kind).observe(seconds)
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
        kafka: dict[tuple[str, str], float] = {}
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
            batches[p] = (len(by_batch), oldest)
        with self._lock:
            self._pending = txns
            self._batches = batches
            self._kafka_oldest = kafka

    # -- reading ---------------------------------------------------------------------

    def counts(self) -> dict[str, Counts]:
        """Per pipeline, what it did in this job object's runs (rows: of the
        sink that got the most)."""
        with self._lock:
            return {p: dataclasses.replace(c) for p, c in self._counts.items()}

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
        self._server, self._server_thread = start_http_server(port, addr, self.registry)
        host, bound = self._server.server_address[:2]
        self.address = (str(host), int(bound))
        return self.address

    def stop_serving(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._server_thread is not None:
            self._server_thread.join(5)
            self._server_thread = None
        self.address = None


class _Live(Collector):
    """The gauges, computed from what the job told when they are read."""

    def __init__(self, metrics: JobMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m, job, now = self._m, self._m.job, time.time()
        with m._lock:
            pending = dict(m._pending)
            batches = dict(m._batches)
            kafka = dict(m._kafka_oldest)
            timeouts = dict(m._timeouts)
            last, began = m._last_checkpoint, m._began
            ends = dict(m._end_of_input)
            final_at, to_final = m._final_at, m._end_to_final
            incarnation, run = m._incarnation, m._run
            states, names = m._pipeline_states, m._state_names
            known = list(m._sinks)
        P, S = ["job", "pipeline"], ["job", "pipeline", "sink"]

        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        g = gauge("twophase_batches_pending", "Pre-committed batches awaiting a checkpoint", P)
        c = gauge("twophase_committables_pending", "Committables awaiting a checkpoint", P)
        age = gauge(
            "twophase_oldest_pending_age_seconds",
            "Age of the oldest batch awaiting a checkpoint (0: none)",
            P,
        )
        per_pipeline: dict[str, int] = {}
        for (p, _sid), (n, _rows) in pending.items():
            per_pipeline[p] = per_pipeline.get(p, 0) + n
        for p in sorted({p for p, _ in known} | set(batches)):
            n, oldest = batches.get(p, (0, None))
            g.add_metric([job, p], n)
            c.add_metric([job, p], per_pipeline.get(p, 0))
            age.add_metric([job, p], max(0.0, now - oldest) if oldest is not None else 0.0)
        yield from (g, c, age)
        txns = gauge(
            "twophase_prepared_transactions_open",
            "Transactions the sink holds prepared for this job (PostgreSQL prepared "
            "transactions, open Kafka transactions, staged Delta file sets)",
            S,
        )
        rows = gauge("twophase_rows_pending", "Rows pre-committed, awaiting a checkpoint", S)
        for p, sid in sorted(set(known) | set(pending)):
            n, r = pending.get((p, sid), (0, 0))
            txns.add_metric([job, p, sid], n)
            rows.add_metric([job, p, sid], r)
        yield from (txns, rows)
        kage = gauge(
            "twophase_kafka_oldest_transaction_age_seconds",
            "Age of the sink's oldest open Kafka transaction (0: none open)",
            S,
        )
        kmax = gauge(
            "twophase_kafka_transaction_timeout_seconds",
            "The sink's transaction.timeout.ms, in seconds: a transaction older is aborted "
            "by the broker",
            S,
        )
        for (p, sid), timeout in sorted(timeouts.items()):
            opened = kafka.get((p, sid))
            kage.add_metric([job, p, sid], max(0.0, now - opened) if opened is not None else 0.0)
            kmax.add_metric([job, p, sid], timeout)
        yield from (kage, kmax)
        ts = gauge(
            "twophase_last_checkpoint_timestamp_seconds",
            "Unix time the last checkpoint of this run committed",
            ["job"],
        )
        since = gauge(
            "twophase_seconds_since_last_checkpoint",
            "Seconds since the last checkpoint of this run committed (since the run began, "
            "before the first)",
            ["job"],
        )
        if last is not None:
            ts.add_metric([job], last)
        since.add_metric([job], max(0.0, now - (last if last is not None else began)))
        yield from (ts, since)
        eoi = gauge(
            "twophase_end_of_input_timestamp_seconds",
            "Unix time the pipeline consumed its input (bounded, or drained)",
            P,
        )
        for p, at in sorted(ends.items()):
            eoi.add_metric([job, p], at)
        fin = gauge(
            "twophase_final_checkpoint_timestamp_seconds",
            "Unix time the final checkpoint committed",
            ["job"],
        )
        tofin = gauge(
            "twophase_end_of_input_to_final_seconds",
            "Seconds from the last pipeline consuming its input to the final checkpoint's commit",
            ["job"],
        )
        if final_at is not None:
            fin.add_metric([job], final_at)
        if to_final is not None:
            tofin.add_metric([job], to_final)
        yield from (eoi, fin, tofin)
        js = gauge("twophase_job_state", "1 for the job's current state", ["job", "state"])
        for s in JOB_STATES:
            js.add_metric([job, s], 1.0 if s == m.state else 0.0)
        ps = gauge("twophase_pipeline_state", "1 for each pipeline's current state", [*P, "state"])
        for p, now_in in sorted(states().items()):
            for s in names:
                ps.add_metric([job, p, s], 1.0 if s == now_in else 0.0)
        info = gauge(
            "twophase_job_info", "The job's incarnation and run", ["job", "incarnation", "run"]
        )
        info.add_metric([job, incarnation, str(run)], 1.0)
        yield from (js, ps, info)
