"""What a running job shows of itself: its metrics (and their HTTP endpoint), its
heartbeat, and the progress of its bounded pipelines. One :class:`RunWatch`
per :class:`~lifecycle.job.Job`; the job tells it when a run begins, changes
state and ends, and calls :meth:`RunWatch.tick` from its run loop.
"""

from __future__ import annotations

import logging
import time

from lifecycle import heartbeat
from lifecycle.metrics import JOB_STATES, JobMetrics
from lifecycle.pipeline import Pipeline, PipelineState
from lifecycle.progress import ProgressView, Tracked, check_mode
from lifecycle.state.protocol import Ledger
from lifecycle.state.store_interface import StateStore
from sinks.capabilities import ExpiringWork, HoldsPreparedWork
from sinks.errors import ConfigError

log = logging.getLogger("lifecycle.watch")


class RunWatch:
    """Metrics, heartbeat and progress of one job (module docstring)."""

    def __init__(
        self,
        job: str,
        *,
        metrics_port: int | None,
        metrics_host: str,
        progress: str,
        metrics_linger: float = 0.0,
    ) -> None:
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise ConfigError(
                f"metrics_port must be a TCP port (0: any free one), not {metrics_port}"
            )
        self.metrics = JobMetrics(job)
        self._port = metrics_port
        self._host = metrics_host
        self._linger = metrics_linger
        self._progress_mode = check_mode(progress)
        self._progress: ProgressView | None = None
        self._heartbeat: heartbeat.Heartbeat | None = None

    @property
    def state(self) -> str:
        return self.metrics.state

    def set_state(self, state: str) -> None:
        assert state in JOB_STATES, state
        changed = state != self.metrics.state
        self.metrics.state = state
        if changed and self._heartbeat is not None:
            self._heartbeat.beat()

    def begin(
        self,
        store: StateStore,
        ledger: Ledger,
        pipelines: list[Pipeline],
        checkpoint_interval: float,
    ) -> None:
        """A run of ``pipelines`` begins (``ledger`` is open, its run begun):
        serve metrics, start the heartbeat and the progress view."""
        self.set_state("recovering")
        identity = {
            "job": self.metrics.job,
            "incarnation": ledger.incarnation,
            "run": ledger.run,
            "checkpoint_interval": checkpoint_interval,
        }
        timeouts = {
            (p.name, s.sink_id): s.prepared_work_timeout()
            for p in pipelines
            for s in p.sinks
            if isinstance(s, ExpiringWork)
        }
        self.metrics.began(
            ledger.incarnation or "",
            ledger.run,
            lambda: {p.name: p.state.value for p in pipelines},
            [s.value for s in PipelineState],
            [(p.name, s.sink_id) for p in pipelines for s in p.sinks],
            timeouts,
            interval=checkpoint_interval,
            age_limits={
                **{
                    (p.name, s.sink_id): t
                    for p in pipelines
                    for s in p.sinks
                    if isinstance(s, HoldsPreparedWork)
                    and (t := s.prepared_work_limit()) is not None
                },
                **timeouts,
            },
            server_slots={
                (p.name, s.sink_id): s.server_prepared_transactions
                for p in pipelines
                for s in p.sinks
                if isinstance(s, HoldsPreparedWork) and s.holds_prepared_work()
            },
        )
        finished = ledger.finished()
        tracked = [
            Tracked(p.name, p.expected_rows)
            for p in pipelines
            if p.bounded and p.name not in finished
        ]
        if self._port is not None:
            host, port = self.metrics.serve(self._port, self._host)
            log.info("metrics of job %s at http://%s:%d/metrics", self.metrics.job, host, port)
        self._heartbeat = heartbeat.Heartbeat(store, identity, lambda: self.metrics.state)
        self._heartbeat.start()
        self._progress = ProgressView(self._progress_mode, tracked)

    def tick(self) -> None:
        """From the run loop: redraw the progress bars."""
        view = self._progress
        if view is not None and view.mode == "bar":
            view.update(self.metrics.counts())

    def progress_note(self) -> str:
        """What the checkpoint log line says of the progress (``log`` mode), or ""."""
        view = self._progress
        if view is None or view.mode != "log":
            return ""
        return view.note(self.metrics.counts())

    def pipeline_finished(self, pipeline: str) -> None:
        if self._progress is not None:
            self._progress.finished(pipeline)

    def end(self, state: str, error: str | None = None, *, heartbeat: bool = True) -> None:
        """The run ended in ``state`` (``finished``, ``stopped`` or ``failed``);
        ``heartbeat=False``: stop renewing the heartbeat without writing it (a
        driver that lost its ledger to another one, whose heartbeat it is now)."""
        final_since = time.monotonic()  # a scrape from now on reads the final state
        self.set_state(state)
        if self._progress is not None:
            self.tick()
            self._progress.close()
            self._progress = None
        if self._heartbeat is not None:
            self._heartbeat.end(state, error, write=heartbeat)
            self._heartbeat = None
        self.metrics.stop_serving(self._linger, final_since)
