"""Job: run several pipelines (Spark streaming queries) whose sinks commit
together, exactly once, with one shared final checkpoint.

``Job.run()`` recovers first, then starts every pipeline that is not
finished, takes checkpoints every ``checkpoint_interval`` seconds across all
pipelines, and returns when every pipeline has finished or the job was stopped.
The lifecycle of each pipeline is in :mod:`lifecycle.pipeline`; how to stop a
running job (code, another terminal, signals) is in :mod:`lifecycle.control`.

This module holds the :class:`Job` and its run loop. What a run does before its
first query starts is :mod:`lifecycle.startup`; how a run fails,
:mod:`lifecycle.run_failures`; what it returns, :mod:`lifecycle.job_result`;
what ``add_pipeline`` refuses, :mod:`lifecycle.pipeline_checks`.

Longer than 450 lines because the Job class is the package's entry point and
documents every argument of its constructor and ``add_pipeline`` (over a
hundred lines of docstrings) beside the run loop they configure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from pyspark.sql import DataFrame, SparkSession

from lifecycle import control, replay, startup
from lifecycle.binding import batch_handler
from lifecycle.coordinator import Coordinator
from lifecycle.errors import JobFailedError
from lifecycle.job_result import JobResult, job_result, last_final, warn_undecided
from lifecycle.job_sinks import PipelineSinks
from lifecycle.ledger import (
    Ledger,
    LedgerLostError,
    check_location,
    ledger_directory,
    new_state_advice,
    open_ledger,
)
from lifecycle.metrics import MetricSample
from lifecycle.pipeline import Pipeline, PipelineState, Transform
from lifecycle.pipeline_checks import check_pipeline
from lifecycle.run_failures import RunFailures
from lifecycle.source_offsets import SourceOffsets
from lifecycle.spark_log import SparkCommitLog
from lifecycle.state.store import LocalStore, open_store
from lifecycle.state.store_interface import StateStore
from lifecycle.watch import RunWatch
from sinks.base import Sink
from sinks.errors import ConfigError
from sinks.naming import check_id, check_incarnation

log = logging.getLogger("lifecycle.job")

FINAL_MODES = ("shared", "per-pipeline")

# After a batch handler returns, Spark writes ``commits/N`` within tens of
# milliseconds, and an available-now query that has consumed its input ends soon
# after. For this long after a handler returns, the run loop looks every
# _QUICK_POLL_S (a local state_dir; _QUICK_POLL_REMOTE_S for a URI, where a look
# is a Hadoop call); otherwise at least every 0.5 s. (A StreamingQueryListener
# reported both 100-150 ms late, and its Python callbacks slowed every batch by
# about 20 ms on 2 cores: the loop does not use one.) Stop requests made with
# files (``twophase stop``) are read every _REQUEST_POLL_S.
_QUICK_WINDOW_S = 0.5
_QUICK_POLL_S = 0.01
_QUICK_POLL_REMOTE_S = 0.05
_REQUEST_POLL_S = 0.2

__all__ = ["Job", "JobFailedError"]


class Job:
    """A set of pipelines whose sinks commit together, exactly once.

    Args:
        spark: the SparkSession every pipeline runs in.
        name: the job's id (``[A-Za-z0-9_-]``, part of every transaction name).
        state_dir: where the job's state lives: every pipeline's Spark checkpoint
            location, its end-of-input flags and control files, and (for a local
            directory, unless ``ledger`` puts it elsewhere) the ledger. A plain
            path is a local directory; a URI with a scheme (``file://``,
            ``viewfs://``, ``hdfs://``, ``s3a://``, ...) is reached through
            Spark's Hadoop FileSystem in the driver JVM, so that a driver
            restarting on another host finds it (see
            :mod:`lifecycle.state.store`). Running again with the same
            ``state_dir`` recovers, then resumes.
        checkpoint_interval: seconds between checkpoints. 0 commits every
            micro-batch as soon as Spark has completed it; a positive interval
            groups all completed batches of all pipelines into one checkpoint
            (one commit per sink per checkpoint).
        final_checkpoint: ``"shared"`` (default): when every pipeline has
            finished its logic, one final checkpoint commits the remaining data
            of all of them. ``"per-pipeline"``: then each pipeline's final data
            is committed by a checkpoint of its own, one after another (kept
            for comparison, see ``benchmarks/final_checkpoint.py``).
        stop_grace: seconds a stop (drain or savepoint) waits for a micro-batch
            in flight to finish before interrupting it. Nothing is lost either
            way: an interrupted batch's pre-committed work is rolled back and
            Spark replays the batch.
        start_over_from: the incarnation id of a lost or abandoned state of this
            job whose claim on the sinks this state takes over (an operator's
            explicit choice, recorded in every sink; see :mod:`sinks.progress`).
            Without it, a job whose sinks hold output of another incarnation
            refuses before any data moves. ``twophase start-over STATE_DIR
            --from ID`` makes the same choice for the next run.
        ledger: where the ledger lives. None (default): ``state_dir/ledger``,
            the embedded file ledger of a local ``state_dir``, or the store
            ledger of a URI one (HDFS, S3 through S3A: one object per change,
            each created only if its name is free; a restarted driver on any
            host reaches it, see :mod:`lifecycle.state.store_ledger`). A
            PostgreSQL URI
            (``postgresql://user@host/dbname``, optionally ``?schema=NAME``,
            default ``twophase_ledger``): the ledger is kept there, as rows, for
            a driver that can restart on another machine; the password comes
            from the URI or libpq's environment (``PGPASSWORD``, ``~/.pgpass``).
            An advisory lock keeps it to one driver, and a fencing token makes
            a driver that lost the lock fail instead of writing. The URI
            without its password is recorded in ``state_dir/ledger.location``
            (through the state store, so a URI ``state_dir`` holds it too) for
            ``twophase``. A local directory (a plain path): the file ledger in
            its ``ledger/`` subdirectory, on this host only. A state_dir keeps
            the kind of ledger it started with; one job name has one ledger
            per schema.
        metrics_port: serve the job's Prometheus metrics at
            ``http://metrics_host:PORT/metrics`` while it runs (0: any free port,
            see :attr:`metrics_address`); None (default): no endpoint. The
            figures are always kept: :meth:`metrics` reads them in Python, and
            :attr:`metrics_registry` is the job's own registry (for
            ``prometheus_client.push_to_gateway``). What each metric is:
            :mod:`lifecycle.metrics`.
        metrics_host: the address the endpoint binds to (loopback by default;
            ``"0.0.0.0"`` for a scraper on another host).
        metrics_linger: at the end of a run whose endpoint was scraped, the
            seconds the endpoint waits, at most, for one more scrape, so that
            Prometheus reads the final state (15; 0: stop at once). A job
            never scraped ends at once.
        audit_checkpoints: how many of the newest checkpoints the ledger keeps,
            with the evidence ``twophase audit`` checks each sink's records
            against (50); a PostgreSQL sink keeps its commit markers as long.
        progress: how bounded pipelines show their progress: ``"auto"`` (a bar
            per pipeline when standard error is a terminal, a log line per
            checkpoint otherwise), ``"bar"``, ``"log"`` or ``"off"`` (see
            :mod:`lifecycle.progress`).
    """

    def __init__(
        self,
        spark: SparkSession,
        name: str,
        state_dir: str | os.PathLike[str],
        checkpoint_interval: float = 5.0,
        *,
        final_checkpoint: str = "shared",
        stop_grace: float = 10.0,
        start_over_from: str | None = None,
        ledger: str | os.PathLike[str] | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        metrics_linger: float = 15.0,
        audit_checkpoints: int = 50,
        progress: str = "auto",
    ) -> None:
        if checkpoint_interval < 0:
            raise ConfigError("checkpoint_interval must be >= 0 seconds")
        if stop_grace < 0:
            raise ConfigError("stop_grace must be >= 0 seconds")
        if metrics_linger < 0:
            raise ConfigError("metrics_linger must be >= 0 seconds")
        if audit_checkpoints < 1:
            raise ConfigError("audit_checkpoints must be >= 1")
        if final_checkpoint not in FINAL_MODES:
            raise ConfigError(f"final_checkpoint must be one of {FINAL_MODES}")
        self.spark = spark
        self.name = check_id("job name", name)
        self.state_dir = os.fspath(state_dir)
        self.store: StateStore = open_store(state_dir, spark)
        self.ledger_location = check_location(ledger)
        self.ledger_dir: Path | None = (
            None
            if isinstance(self.ledger_location, str)
            else ledger_directory(self.store, self.ledger_location)
        )
        """the file ledger's directory (None: the ledger is in PostgreSQL, or in a
        URI state_dir itself)"""
        self.checkpoint_interval = float(checkpoint_interval)
        self.final_checkpoint = final_checkpoint
        self.stop_grace = float(stop_grace)
        self.audit_checkpoints = int(audit_checkpoints)
        self.start_over_from = (
            check_incarnation(start_over_from) if start_over_from is not None else None
        )
        self._pipelines: dict[str, Pipeline] = {}
        self._wake = threading.Event()
        self._stop: bool | None = None  # None: no stop asked; else: drain?
        self._outcome = ""  # "", "drained", "stopped"
        self._running = False
        self._failures = RunFailures(self.name)  # the failed batches; the run's error
        self._quick_until = 0.0  # monotonic time until which the run loop polls quickly
        self._quick_poll = (
            _QUICK_POLL_S if isinstance(self.store, LocalStore) else _QUICK_POLL_REMOTE_S
        )
        self._watch = RunWatch(
            self.name,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            metrics_linger=metrics_linger,
            progress=progress,
        )
        self._source_offsets = SourceOffsets(self.name, self._watch.metrics.registry)

    def add_pipeline(
        self,
        name: str,
        df: DataFrame,
        sinks: Sequence[Sink],
        *,
        bounded: bool = False,
        trigger_interval: float = 1.0,
        output_mode: str = "append",
        transform: Transform | None = None,
        event_time: str | None = None,
        expected_rows: int | None = None,
        source_offsets_group: str | bool = True,
        source_offsets_config: Mapping[str, Any] | None = None,
    ) -> None:
        """Add a pipeline: a streaming DataFrame written to ``sinks``.

        Args:
            name: the pipeline's id within the job (``[A-Za-z0-9_-]``).
            df: a streaming DataFrame (``spark.readStream...``): the source, or
                the whole pipeline when ``transform`` is not given.
            sinks: where every row goes, exactly once.
            bounded: True when all input is known (files, a table): the
                pipeline runs with an available-now trigger and finishes.
            trigger_interval: seconds between micro-batches of an unbounded pipeline.
            output_mode: Spark output mode (``append``, ``update``, ``complete``).
            transform: a function from the source DataFrame to the output
                DataFrame (e.g. a windowed aggregation). Needed with ``event_time``.
            event_time: the timestamp column of the source that the transform's
                watermark is defined on. At end of input (bounded input
                consumed, or a drain) an end-of-input marker row with this column
                at 9999-12-31 is fed through ``transform``, so that every
                event-time window still open in Spark state is emitted before the
                pipeline finishes. The transform must let the marker reach its
                ``withWatermark`` (apply the watermark before filters); the marker
                itself never reaches a sink. Only in ``append`` mode: ``update``
                and ``complete`` emit every window as data arrives and hold
                nothing back, so no marker is fed there.
            expected_rows: how many rows a bounded pipeline writes, when known:
                its progress shows the share done and an ETA (Spark's sources do
                not tell it).
            source_offsets_group: the consumer group that, after each completed
                checkpoint, gets the end offsets of the pipeline's Kafka
                sources that checkpoint covers, so that lag tools
                (``kafka-consumer-groups.sh --describe``, Burrow, exporters)
                see the job. True (default): ``twophase.<job>.<pipeline>``; a
                name; False: none. For monitoring only: recovery never reads
                the group, and a commit that fails is logged and counted, never
                fails the job (:mod:`lifecycle.source_offsets`). Pipelines
                without a Kafka source commit nothing.
            source_offsets_config: kafka-python ``KafkaConsumer`` settings for
                those commits, over the ones derived from the source's
                ``kafka.*`` options (:mod:`lifecycle.kafka_source`): e.g.
                ``ssl_cafile`` where the source uses a JKS trust store.
        """
        check_id("pipeline name", name)
        if self._running:
            raise ConfigError("add pipelines before run()")
        if name in self._pipelines:
            raise ConfigError(f"pipeline {name!r} is already in job {self.name!r}")
        check_pipeline(
            name,
            df,
            sinks,
            bounded=bounded,
            trigger_interval=trigger_interval,
            transform=transform,
            event_time=event_time,
            source_offsets=(source_offsets_group, source_offsets_config),
        )
        self._pipelines[name] = Pipeline(
            name=name,
            source=df,
            sinks=list(sinks),
            bounded=bounded,
            trigger_interval=float(trigger_interval),
            output_mode=output_mode,
            store=self.store,
            location=f"pipelines/{name}",
            transform=transform,
            event_time=event_time,
            expected_rows=expected_rows,
            source_offsets_group=source_offsets_group,
            source_offsets_config=source_offsets_config,
        )

    def stop(self, drain: bool = False) -> None:
        """Ask a running job to stop. Safe to call from another thread.

        ``drain=False`` (a savepoint): queries stop, a checkpoint commits every
        batch Spark completed, input is not ended (windows stay open), and
        running the job again resumes from there.

        ``drain=True``: unbounded pipelines process what is available now and end
        their input like bounded ones; one shared final checkpoint commits
        everything; every pipeline is recorded as finished.
        """
        if self._stop is None or (self._stop and not drain):
            self._stop = drain  # a stop without drain overrides a drain in progress
        self._wake.set()

    # -- observing --------------------------------------------------------------------

    def metrics(self) -> list[MetricSample]:
        """Every metric sample of this job now (what the endpoint serves), for
        pushing them elsewhere. Kept across runs of this ``Job`` object."""
        return self._watch.metrics.samples()

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The job's own ``prometheus_client`` registry."""
        return self._watch.metrics.registry

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of the metrics endpoint while the job runs, else None."""
        return self._watch.metrics.address

    # -- running ----------------------------------------------------------------------

    def run(self, *, handle_signals: bool = True) -> JobResult:
        """Recover, run every unfinished pipeline, and return when all have finished
        or the job was stopped.

        Raises :class:`sinks.PreflightError` before any data moves when a sink
        cannot give exactly-once, and a :class:`JobFailedError` whose message is
        one line (the full trace is logged once at ERROR): a
        :class:`~lifecycle.errors.TaskFailedError` when a task writing a sink
        failed, a :class:`~lifecycle.errors.CheckpointCommitError` when a
        checkpoint could not commit, a
        :class:`~lifecycle.errors.RecoveryRefusedError` when recovery refuses to
        go on (see :mod:`lifecycle.errors`).

        With ``handle_signals`` (and when called from the main thread), SIGTERM
        drains and SIGINT drains / stops / interrupts (see :mod:`lifecycle.control`).
        """
        if not self._pipelines:
            raise ConfigError(f"job {self.name!r} has no pipelines")
        if (self.spark.conf.get("spark.speculation", "false") or "").lower() == "true":
            startup.refuse_speculation([s for p in self._pipelines.values() for s in p.sinks])
        ledger = open_ledger(
            self.ledger_location, self.store, self.name, history=self.audit_checkpoints
        )
        self._running = True
        self._outcome = ""  # a stop() that came before run() is honoured
        self._failures.error = None
        ended = "failed"
        lost = False
        signals = control.SignalHandlers(self.stop) if handle_signals else contextlib.nullcontext()
        try:
            with signals:
                result = self._run(ledger)
            ended = "stopped" if result.stopped else "finished"
            return result
        except BaseException as e:
            lost = _ledger_lost(e)
            # a job's failure is logged once; a sink's error becomes the job's failure
            replaced = self._failures.ended_by(e)
            if replaced is None:
                raise
            raise replaced from e
        finally:
            self._running = False
            self._stop = None
            warn_undecided(self.name, self.state_dir, ledger)
            self._source_offsets.end()
            # a driver that lost its ledger leaves the heartbeat to the one that took it
            self._watch.end(ended, self._failures.error, heartbeat=not lost)
            ledger.close()
            for p in self._pipelines.values():
                for s in p.sinks:
                    with contextlib.suppress(Exception):
                        s.close()

    def _run(self, ledger: Ledger) -> JobResult:
        ledger.begin_run()
        self._watch.begin(
            self.store, ledger, list(self._pipelines.values()), self.checkpoint_interval
        )
        new_state = new_state_advice(self.ledger_location)
        coord = Coordinator(
            self.name,
            ledger,
            [
                PipelineSinks(
                    p.name,
                    {s.sink_id: s for s in p.sinks},
                    SparkCommitLog(self.store, p.spark_location),
                )
                for p in self._pipelines.values()
            ],
            new_state=new_state,
            metrics=self._watch.metrics,
            replay_lost=True,
        )
        coord.progress_note = self._watch.progress_note
        coord.completed = self._source_offsets.checkpoint_completed
        startup.preflight(
            self.spark,
            self.store,
            ledger,
            self._pipelines,
            checkpoint_interval=self.checkpoint_interval,
            new_state=new_state,
        )
        self._source_offsets.begin(self._pipelines.values(), ledger)
        startup.recover(
            self.name, self.store, coord, self._pipelines, start_over_from=self.start_over_from
        )
        startup.prepare_pipelines(self.store, ledger, self._pipelines)
        try:
            for p in self._live():
                self._start(coord, p)
            self._watch.set_state("running")
            end_of_input = self._loop(coord)
        except BaseException:
            self._stop_queries()
            raise
        return self._result(coord, ledger, end_of_input)

    def _start(self, coord: Coordinator, p: Pipeline) -> None:
        """(Re)start the query of ``p`` with its batch handler."""
        self._failures.forget(p.name)
        handle = batch_handler(
            coord,
            p.name,
            p.sinks,
            p.schema,
            on_failure=self._failures.remember,
            ending_input=p.state is PipelineState.ENDING_INPUT,
        )

        def handle_then_poll(df: DataFrame, batch_id: int) -> None:
            try:
                handle(df, batch_id)
            finally:
                self._quick_until = time.monotonic() + _QUICK_WINDOW_S
                self._wake.set()

        p.start(self.name, handle_then_poll)

    def _live(self) -> list[Pipeline]:
        live = (PipelineState.RUNNING, PipelineState.ENDING_INPUT)
        return [p for p in self._pipelines.values() if p.state in live]

    def _loop(self, coord: Coordinator) -> float | None:
        """The run loop. Returns the monotonic time the last input was consumed
        (None when no pipeline consumed input in this run)."""
        interval = self.checkpoint_interval
        last = time.monotonic()
        next_request_check = 0.0
        while True:
            now = time.monotonic()
            wait = 0.2 if interval == 0 else max(0.05, min(0.5, last + interval - now))
            if now < self._quick_until:
                wait = self._quick_poll
            self._wake.wait(wait)
            self._wake.clear()
            self._watch.tick()
            request = None
            if time.monotonic() >= next_request_check:
                next_request_check = time.monotonic() + _REQUEST_POLL_S
                request = control.take_request(self.store)
            if request is not None:
                log.warning("stop requested by %s (drain=%s)", request.source, request.drain)
                self.stop(drain=request.drain)
            self._advance(coord)
            if self._stop is False:  # savepoint
                self._watch.set_state("stopping")
                self._stop_queries(self.stop_grace)
                coord.settle(kind="savepoint")
                for p in self._live():
                    p.state = PipelineState.STOPPED
                    log.info("pipeline %s stopped (resumable)", p.name)
                self._outcome = "stopped"
                return None
            if self._stop is True and self._outcome != "drained":
                self._drain(coord)
            done_logic = [
                p for p in self._pipelines.values() if p.state is PipelineState.FINISHED_LOGIC
            ]
            if not self._live():
                if self.final_checkpoint == "per-pipeline":
                    for p in done_logic:  # each its own checkpoint, one after another
                        coord.checkpoint("final", finished=[p.name], only=[p.name])
                        self._finished([p])
                elif done_logic:  # one shared final checkpoint
                    coord.checkpoint("final", finished=[p.name for p in done_logic])
                    self._finished(done_logic)
                self._pay_debts(coord)
                consumed = [p.input_done_at for p in self._pipelines.values() if p.input_done_at]
                return max(consumed) if consumed else None
            now = time.monotonic()
            early = coord.take_early_checkpoint()
            if early is not None:
                log.info("taking a checkpoint early: %s", early)
            if interval == 0 or now - last >= interval or early is not None:
                last = now
                coord.checkpoint("periodic", finished=[p.name for p in done_logic])
                self._finished(done_logic)
                self._pay_debts(coord)

    def _finished(self, pipelines: list[Pipeline]) -> None:
        """Their data is committed by the checkpoint just taken: FINISHED."""
        for p in pipelines:
            p.state = PipelineState.FINISHED
            self._watch.pipeline_finished(p.name)
            log.info("pipeline %s finished: its data is committed", p.name)

    def _pay_debts(self, coord: Coordinator) -> None:
        """Recovery rule 5 during a run: the checkpoint just taken found work
        lost in a target and recorded its batches as owed. Write them again
        now, before any new batch of their pipeline is written: the owing
        pipeline's query stops (its interrupted batch is aborted and replayed
        by Spark, as in a drain), the owed batches are written again from their
        source (:mod:`lifecycle.replay`), and the query starts again. A batch
        the source no longer has stops the job with
        :class:`~lifecycle.errors.BatchLostError`; the debt stays in the ledger
        for the next start."""
        owed = coord.ledger.owed()
        for name in sorted(set(owed) & set(self._pipelines)):
            p = self._pipelines[name]
            live = p in self._live() and p.query is not None and p.query.isActive
            log.warning(
                "pipeline %s owes batch(es) %s to sinks that lost their work: writing them "
                "again from the source now%s",
                name,
                sorted(owed[name]),
                " (its query stops meanwhile)" if live else "",
            )
            if live:
                p.stop_query(self.stop_grace)
                coord.reset_pipeline(name)
            owing = {sid for sinks in owed[name].values() for sid in sinks}
            for sink in p.sinks:
                if sink.sink_id in owing:
                    # as a start would: the loss may be a change of the target (a
                    # constraint added to a Delta table) the writers must know of
                    sink.preflight(p.schema)
            replay.pay_owed(self.name, coord, self._pipelines, only=[name])
            if live:
                self._start(coord, p)

    def _drain(self, coord: Coordinator) -> None:
        """Unbounded pipelines end their input: stop, then run available-now."""
        self._outcome = "drained"
        self._watch.set_state("draining")
        for p in self._pipelines.values():
            if p.state is PipelineState.RUNNING and not p.bounded:
                p.stop_query(self.stop_grace)
                coord.reset_pipeline(p.name)
                p.begin_ending_input(drain=True)
                self._start(coord, p)

    def _advance(self, coord: Coordinator) -> None:
        """Move pipelines whose query terminated to their next state."""
        for p in self._live():
            q = p.query
            if q is None or q.isActive:
                continue
            exc = q.exception()
            if exc is not None or (p.state is PipelineState.RUNNING and not p.bounded):
                p.state = PipelineState.FAILED
                self._failures.fail(coord, p.name, exc, self._stop_queries)
            now = time.monotonic()
            if p.input_done_at is None:
                self._watch.metrics.input_consumed(p.name)
            if p.state is PipelineState.RUNNING and p.event_time:
                log.info("pipeline %s consumed its input; flushing event-time state", p.name)
                p.input_done_at = now
                p.begin_ending_input(drain=False)
                self._start(coord, p)
                continue
            p.input_done_at = p.input_done_at or now
            p.state = PipelineState.FINISHED_LOGIC
            log.info("pipeline %s finished its logic; waiting for a checkpoint", p.name)

    def _stop_queries(self, grace: float = 0.0) -> None:
        deadline = time.monotonic() + grace
        for p in self._pipelines.values():
            p.stop_query(max(0.0, deadline - time.monotonic()))

    def _result(self, coord: Coordinator, ledger: Ledger, end: float | None) -> JobResult:
        final = last_final(coord.checkpoints_taken)
        if final is not None:
            self._watch.metrics.final_committed(
                final.committed_at or time.time(),
                (time.monotonic() - end) if end is not None else None,
            )
        return job_result(
            coord.checkpoints_taken, self._pipelines.values(), ledger, self._outcome, end
        )


def _ledger_lost(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) says this driver lost its ledger."""
    seen: BaseException | None = e
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, LedgerLostError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
