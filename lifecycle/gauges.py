"""The gauges of a job's metrics, computed when they are read.

:class:`~lifecycle.metrics.JobMetrics` keeps what the job and the coordinator
told it; at each scrape :class:`LiveGauges` takes a :class:`Snapshot` of that
and turns it into gauge families, so figures that age between two events (the
time since the last checkpoint, the age of the oldest open transaction) are
current when read. The alert rules shipped in ``integration/prometheus`` read
these names; ``tests/test_prometheus.py`` checks that each one they use exists.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

Key = tuple[str, str]
"""(pipeline, sink id)"""


@dataclass(frozen=True)
class Snapshot:
    """What the gauges show, as told by the job up to one instant."""

    job: str
    state: str
    state_names: Sequence[str]
    """what ``twophase_job_state`` can say"""
    pipeline_state_names: Sequence[str]
    pipeline_states: Mapping[str, str]
    sinks: Sequence[Key]
    """every (pipeline, sink id) of the run"""
    pending: Mapping[Key, tuple[int, int]]
    """committables and rows awaiting a checkpoint"""
    batches: Mapping[str, tuple[int, float | None]]
    """per pipeline: batches awaiting a checkpoint, and when the oldest was recorded"""
    writing: Mapping[str, float]
    """per pipeline: when the batch being written now began (none: absent)"""
    oldest_prepared: Mapping[Key, float]
    """when each sink's oldest work awaiting a checkpoint was opened or prepared"""
    kafka_opened: Mapping[Key, float]
    """when each Kafka sink's oldest open transaction was opened"""
    timeouts: Mapping[Key, float]
    """the transaction timeout of sinks whose target aborts prepared work"""
    age_limits: Mapping[Key, float]
    """the age past which a sink's prepared work harms its target"""
    server_slots: Mapping[Key, Callable[[], tuple[int, int] | None]]
    """a sink's server-wide prepared transactions and their limit, as last seen"""
    interval: float | None
    began: float
    last_checkpoint: float | None
    ends: Mapping[str, float]
    final_at: float | None
    to_final: float | None
    incarnation: str
    run: int
    recovered_at: Mapping[tuple[str, str, str], float]
    """when a recovery rule last moved transactions of (pipeline, sink, rule)"""


class LiveGauges(Collector):
    """A Prometheus collector of the gauges of one job, from ``snapshot()``."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s, now = self._snapshot(), time.time()
        job = s.job
        P, S = ["job", "pipeline"], ["job", "pipeline", "sink"]

        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        def age(at: float | None) -> float:
            return max(0.0, now - at) if at is not None else 0.0

        pipelines = sorted({p for p, _ in s.sinks} | set(s.batches))
        g = gauge("twophase_batches_pending", "Pre-committed batches awaiting a checkpoint", P)
        c = gauge("twophase_committables_pending", "Committables awaiting a checkpoint", P)
        pend = gauge(
            "twophase_oldest_pending_age_seconds",
            "Age of the oldest batch awaiting a checkpoint (0: none)",
            P,
        )
        uncommitted = gauge(
            "twophase_oldest_uncommitted_age_seconds",
            "Age of the pipeline's oldest work not yet committed: the batch being written, "
            "or the oldest batch awaiting a checkpoint (0: none)",
            P,
        )
        per_pipeline: dict[str, int] = {}
        for (p, _sid), (n, _rows) in s.pending.items():
            per_pipeline[p] = per_pipeline.get(p, 0) + n
        for p in pipelines:
            n, oldest = s.batches.get(p, (0, None))
            g.add_metric([job, p], n)
            c.add_metric([job, p], per_pipeline.get(p, 0))
            pend.add_metric([job, p], age(oldest))
            uncommitted.add_metric([job, p], max(age(oldest), age(s.writing.get(p))))
        yield from (g, c, pend, uncommitted)
        yield from self._per_sink(s, age, gauge, S)
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
        interval = gauge(
            "twophase_checkpoint_interval_seconds",
            "The job's checkpoint_interval (0: every micro-batch is committed when complete)",
            ["job"],
        )
        if s.last_checkpoint is not None:
            ts.add_metric([job], s.last_checkpoint)
        last = s.last_checkpoint
        since.add_metric([job], age(last if last is not None else s.began))
        if s.interval is not None:
            interval.add_metric([job], s.interval)
        started = gauge(
            "twophase_run_started_timestamp_seconds",
            "Unix time this run of the job began (tells a job's newest run among endpoints)",
            ["job"],
        )
        started.add_metric([job], s.began)
        yield from (ts, since, interval, started)
        yield from self._ends(s, gauge, P)
        js = gauge("twophase_job_state", "1 for the job's current state", ["job", "state"])
        for name in s.state_names:
            js.add_metric([job, name], 1.0 if name == s.state else 0.0)
        ps = gauge("twophase_pipeline_state", "1 for each pipeline's current state", [*P, "state"])
        for p, now_in in sorted(s.pipeline_states.items()):
            for name in s.pipeline_state_names:
                ps.add_metric([job, p, name], 1.0 if name == now_in else 0.0)
        info = gauge(
            "twophase_job_info", "The job's incarnation and run", ["job", "incarnation", "run"]
        )
        info.add_metric([job, s.incarnation, str(s.run)], 1.0)
        yield from (js, ps, info)

    @staticmethod
    def _per_sink(
        s: Snapshot,
        age: Callable[[float | None], float],
        gauge: Callable[[str, str, list[str]], GaugeMetricFamily],
        S: list[str],
    ) -> Iterator[Metric]:
        job = s.job
        txns = gauge(
            "twophase_prepared_transactions_open",
            "Transactions the sink holds prepared for this job (PostgreSQL prepared "
            "transactions, open Kafka transactions, staged Delta file sets)",
            S,
        )
        rows = gauge("twophase_rows_pending", "Rows pre-committed, awaiting a checkpoint", S)
        oldest = gauge(
            "twophase_prepared_oldest_age_seconds",
            "Age of the oldest work the sink holds for a checkpoint (0: none)",
            S,
        )
        for p, sid in sorted(set(s.sinks) | set(s.pending)):
            n, r = s.pending.get((p, sid), (0, 0))
            txns.add_metric([job, p, sid], n)
            rows.add_metric([job, p, sid], r)
            oldest.add_metric([job, p, sid], age(s.oldest_prepared.get((p, sid))))
        limit = gauge(
            "twophase_prepared_age_limit_seconds",
            "Age past which the sink's prepared work harms its target: Kafka's "
            "transaction.timeout.ms (the broker aborts it), PostgreSQL's lock_timeout of "
            "the sink (a task waiting on its rows fails)",
            S,
        )
        for (p, sid), seconds in sorted(s.age_limits.items()):
            limit.add_metric([job, p, sid], seconds)
        yield from (txns, rows, oldest, limit)
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
        for (p, sid), timeout in sorted(s.timeouts.items()):
            kage.add_metric([job, p, sid], age(s.kafka_opened.get((p, sid))))
            kmax.add_metric([job, p, sid], timeout)
        yield from (kage, kmax)
        held = gauge(
            "twophase_server_prepared_transactions",
            "Prepared transactions on the sink's PostgreSQL server, every database and job "
            "(as last seen at a batch's barrier)",
            S,
        )
        most = gauge(
            "twophase_server_max_prepared_transactions",
            "The sink's PostgreSQL server's max_prepared_transactions",
            S,
        )
        for (p, sid), read in sorted(s.server_slots.items()):
            seen = read()
            if seen is not None:
                held.add_metric([job, p, sid], seen[0])
                most.add_metric([job, p, sid], seen[1])
        yield from (held, most)
        moved = gauge(
            "twophase_recovery_action_timestamp_seconds",
            "Unix time a recovery rule last moved transactions of the sink in this run (0: never)",
            [*S, "rule"],
        )
        for (p, sid, rule), at in sorted(s.recovered_at.items()):
            moved.add_metric([job, p, sid, rule], at)
        yield moved

    @staticmethod
    def _ends(
        s: Snapshot,
        gauge: Callable[[str, str, list[str]], GaugeMetricFamily],
        P: list[str],
    ) -> Iterator[Metric]:
        job = s.job
        eoi = gauge(
            "twophase_end_of_input_timestamp_seconds",
            "Unix time the pipeline consumed its input (bounded, or drained)",
            P,
        )
        for p, at in sorted(s.ends.items()):
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
        if s.final_at is not None:
            fin.add_metric([job], s.final_at)
        if s.to_final is not None:
            tofin.add_metric([job], s.to_final)
        yield from (eoi, fin, tofin)
