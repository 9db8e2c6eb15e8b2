"""Job and pipelines: run several Spark streaming queries with exactly-once sinks.

A :class:`Job` owns a ``state_dir`` (its ledger and every pipeline's Spark
checkpoint location), a coordinator and the run loop. ``run()`` recovers
first, then starts every pipeline that is not finished, takes checkpoints
every ``checkpoint_interval`` seconds, and returns when every pipeline has
finished (bounded input) or when ``stop()`` is called.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming import StreamingQuery, StreamingQueryListener

from lifecycle.binding import batch_handler
from lifecycle.coordinator import Coordinator, PipelineSinks, sink_label
from lifecycle.ledger import FileLedger
from lifecycle.spark_log import SparkCommitLog
from sinks.base import Sink
from sinks.errors import ConfigError, PreflightError, TwoPhaseError
from sinks.naming import check_id

log = logging.getLogger("lifecycle.job")


class JobFailedError(TwoPhaseError):
    """A pipeline or a commit failed. Work Spark completed was committed where
    possible; the ledger keeps every decision, and running the job again with
    the same ``state_dir`` recovers and resumes."""


class PipelineState(str, enum.Enum):
    """RUNNING -> FINISHED_LOGIC (input consumed, pre-committed, waiting for a
    checkpoint) -> FINISHED (its data committed). STOPPED: ended by ``stop()``
    (resumable). FAILED: its query failed."""

    RUNNING = "RUNNING"
    FINISHED_LOGIC = "FINISHED_LOGIC"
    FINISHED = "FINISHED"
    STOPPED = "STOPPED"
    FAILED = "FAILED"


@dataclass
class _Pipeline:
    name: str
    df: DataFrame
    sinks: list[Sink]
    bounded: bool
    trigger_interval: float
    output_mode: str
    schema: pa.Schema
    state: PipelineState = PipelineState.RUNNING
    query: StreamingQuery | None = None


@dataclass
class JobResult:
    """What ``Job.run()`` returns."""

    checkpoints: int
    """checkpoints that committed during this run (recovery included)"""
    rows_committed: dict[str, int]
    """rows committed during this run, per ``pipeline/sink_id``"""
    pipelines: dict[str, PipelineState]
    final_checkpoint: int | None = None
    """id of the final checkpoint, when every pipeline finished"""
    stopped: bool = False
    """True when the run ended by ``stop()``"""
    checkpoint_ids: list[int] = field(default_factory=list)


class _Wakeup(StreamingQueryListener):
    """Wakes the run loop when Spark finishes a batch (after ``commits/N``)."""

    def __init__(self, event: threading.Event) -> None:
        self._event = event

    def onQueryStarted(self, event: object) -> None:
        pass

    def onQueryProgress(self, event: object) -> None:
        self._event.set()

    def onQueryIdle(self, event: object) -> None:
        pass

    def onQueryTerminated(self, event: object) -> None:
        self._event.set()


class Job:
    """A set of pipelines whose sinks commit together, exactly once.

    Args:
        spark: the SparkSession every pipeline runs in.
        name: the job's id (``[A-Za-z0-9_-]``, part of every transaction name).
        state_dir: local directory holding the ledger and every pipeline's Spark
            checkpoint location. Running again with the same ``state_dir``
            recovers, then resumes.
        checkpoint_interval: seconds between checkpoints. 0 commits every
            micro-batch as soon as Spark has completed it; a positive interval
            groups all completed batches of all pipelines into one checkpoint
            (one commit per sink per checkpoint).
    """

    def __init__(
        self,
        spark: SparkSession,
        name: str,
        state_dir: str | Path,
        checkpoint_interval: float = 5.0,
    ) -> None:
        if checkpoint_interval < 0:
            raise ConfigError("checkpoint_interval must be >= 0 seconds")
        self.spark = spark
        self.name = check_id("job name", name)
        self.state_dir = Path(state_dir)
        self.checkpoint_interval = float(checkpoint_interval)
        self._pipelines: dict[str, _Pipeline] = {}
        self._wake = threading.Event()
        self._stop_requested = False
        self._running = False

    def add_pipeline(
        self,
        name: str,
        df: DataFrame,
        sinks: Sequence[Sink],
        *,
        bounded: bool = False,
        trigger_interval: float = 1.0,
        output_mode: str = "append",
    ) -> None:
        """Add a pipeline: a streaming DataFrame written to ``sinks``.

        Args:
            name: the pipeline's id within the job (``[A-Za-z0-9_-]``).
            df: a streaming DataFrame (``spark.readStream...``).
            sinks: where every row goes, exactly once.
            bounded: True when all input is known (files, a table): the
                pipeline runs with an available-now trigger and finishes.
            trigger_interval: seconds between micro-batches of an unbounded pipeline.
            output_mode: Spark output mode (``append``, ``update``, ``complete``).
        """
        check_id("pipeline name", name)
        if self._running:
            raise ConfigError("add pipelines before run()")
        if name in self._pipelines:
            raise ConfigError(f"pipeline {name!r} is already in job {self.name!r}")
        if not df.isStreaming:
            raise ConfigError(
                f"pipeline {name!r}: the DataFrame is not streaming; build it with "
                "spark.readStream (for a bounded input, with bounded=True)"
            )
        if not sinks:
            raise ConfigError(f"pipeline {name!r} has no sinks")
        ids = [s.sink_id for s in sinks]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ConfigError(
                f"pipeline {name!r}: sink id(s) {sorted(dup)} used twice; pass sink_id= to tell "
                "them apart"
            )
        if trigger_interval <= 0:
            raise ConfigError("trigger_interval must be > 0 seconds")
        self._pipelines[name] = _Pipeline(
            name=name,
            df=df,
            sinks=list(sinks),
            bounded=bounded,
            trigger_interval=float(trigger_interval),
            output_mode=output_mode,
            schema=to_arrow_schema(df.schema),
        )

    def stop(self) -> None:
        """Ask a running job to stop: queries stop, a savepoint checkpoint commits
        every batch Spark completed, and ``run()`` returns. Running the job again
        resumes from there. Safe to call from another thread."""
        self._stop_requested = True
        self._wake.set()

    # -- running ----------------------------------------------------------------------

    def _spark_location(self, pipeline: str) -> Path:
        return self.state_dir / "pipelines" / pipeline / "spark"

    def run(self) -> JobResult:
        """Recover, run every unfinished pipeline, and return when all have finished
        or ``stop()`` was called. Raises :class:`JobFailedError` when a pipeline or
        a commit fails, and :class:`sinks.PreflightError` before any data moves
        when a sink cannot give exactly-once."""
        if not self._pipelines:
            raise ConfigError(f"job {self.name!r} has no pipelines")
        if self.spark.conf.get("spark.speculation", "false").lower() == "true":
            raise ConfigError(
                "spark.speculation is on: a task retry could not tell a failed attempt from "
                "a speculative one still running, so exactly-once sinks refuse it; set "
                "spark.speculation=false for this job"
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ledger = FileLedger(self.state_dir / "ledger", self.name)
        self._running = True
        self._stop_requested = False
        try:
            return self._run(ledger)
        except (JobFailedError, ConfigError, PreflightError):
            raise
        except TwoPhaseError as e:
            raise JobFailedError(f"job {self.name!r} failed: {e}") from e
        finally:
            self._running = False
            ledger.close()

    def _run(self, ledger: FileLedger) -> JobResult:
        ledger.begin_run()
        coord = Coordinator(
            self.name,
            ledger,
            [
                PipelineSinks(
                    p.name,
                    {s.sink_id: s for s in p.sinks},
                    SparkCommitLog(self._spark_location(p.name)),
                )
                for p in self._pipelines.values()
            ],
        )
        self._check_spark_state(ledger)
        for p in self._pipelines.values():
            for s in p.sinks:
                s.preflight(p.schema)
        coord.recover()
        for name in ledger.finished() & set(self._pipelines):
            log.info("pipeline %s finished in an earlier run: not run again", name)
            self._pipelines[name].state = PipelineState.FINISHED
        listener = _Wakeup(self._wake)
        self.spark.streams.addListener(listener)
        try:
            for p in self._pipelines.values():
                if p.state is PipelineState.RUNNING:
                    p.query = self._start(p, coord)
            stopped = self._loop(coord)
        except BaseException:
            self._stop_queries()
            raise
        finally:
            self.spark.streams.removeListener(listener)
        return self._result(coord, stopped)

    def _check_spark_state(self, ledger: FileLedger) -> None:
        """Refuse to start a pipeline whose Spark checkpoint vanished after it
        committed output: Spark would read its input again from the start."""
        totals = ledger.totals()
        for p in self._pipelines:
            committed = any(k.startswith(p + "/") for k in totals)
            if committed and not SparkCommitLog(self._spark_location(p)).exists():
                raise ConfigError(
                    f"pipeline {p!r} committed output in earlier runs, but its Spark "
                    f"checkpoint {self._spark_location(p)} is missing: starting over would "
                    "write its input twice. Restore the directory, or use a new state_dir "
                    "(and an empty target) to start afresh."
                )

    def _start(self, p: _Pipeline, coord: Coordinator) -> StreamingQuery:
        handler = batch_handler(coord, p.name, p.sinks, p.schema)
        w = (
            p.df.writeStream.queryName(f"{self.name}.{p.name}")
            .outputMode(p.output_mode)
            .option("checkpointLocation", str(self._spark_location(p.name)))
            .foreachBatch(handler)
        )
        if p.bounded:
            w = w.trigger(availableNow=True)
        else:
            w = w.trigger(processingTime=f"{p.trigger_interval} seconds")
        log.info("starting pipeline %s (%s)", p.name, "bounded" if p.bounded else "unbounded")
        return w.start()

    def _loop(self, coord: Coordinator) -> bool:
        """The run loop; returns True when ended by ``stop()``."""
        interval = self.checkpoint_interval
        last = time.monotonic()
        while True:
            wait = 0.2 if interval == 0 else max(0.05, min(0.5, last + interval - time.monotonic()))
            self._wake.wait(wait)
            self._wake.clear()
            self._check_queries(coord)
            if self._stop_requested:
                self._stop_queries()
                coord.settle(kind="savepoint")
                for p in self._pipelines.values():
                    if p.state is not PipelineState.FINISHED:
                        p.state = PipelineState.STOPPED
                return True
            done_logic = [
                p for p in self._pipelines.values() if p.state is PipelineState.FINISHED_LOGIC
            ]
            if all(p.state is not PipelineState.RUNNING for p in self._pipelines.values()):
                if done_logic:  # else: every pipeline had finished in an earlier run
                    coord.checkpoint("final", finished=[p.name for p in done_logic])
                for p in done_logic:
                    p.state = PipelineState.FINISHED
                return False
            now = time.monotonic()
            if interval == 0 or now - last >= interval:
                last = now
                coord.checkpoint("periodic", finished=[p.name for p in done_logic])
                for p in done_logic:
                    p.state = PipelineState.FINISHED

    def _check_queries(self, coord: Coordinator) -> None:
        for p in self._pipelines.values():
            q = p.query
            if p.state is not PipelineState.RUNNING or q is None or q.isActive:
                continue
            exc = q.exception()
            if exc is None and p.bounded:
                p.state = PipelineState.FINISHED_LOGIC
                log.info("pipeline %s consumed all its input", p.name)
                continue
            p.state = PipelineState.FAILED
            self._stop_queries()
            why = str(exc) if exc is not None else "its query stopped unexpectedly"
            try:
                coord.settle(kind="recovery")
            except Exception:
                log.exception("could not settle after the failure; the next start recovers")
            raise JobFailedError(f"job {self.name!r}, pipeline {p.name!r} failed: {why}") from exc

    def _stop_queries(self) -> None:
        for p in self._pipelines.values():
            q = p.query
            if q is not None and q.isActive:
                try:
                    q.stop()
                except Exception:
                    log.exception("stopping pipeline %s", p.name)

    def _result(self, coord: Coordinator, stopped: bool) -> JobResult:
        rows: dict[str, int] = {
            sink_label(p.name, s.sink_id): 0 for p in self._pipelines.values() for s in p.sinks
        }
        for cp in coord.checkpoints_taken:
            for k, n in cp.rows.items():
                rows[k] = rows.get(k, 0) + n
        final = next((cp.id for cp in coord.checkpoints_taken if cp.kind == "final"), None)
        return JobResult(
            checkpoints=len(coord.checkpoints_taken),
            rows_committed=rows,
            pipelines={p.name: p.state for p in self._pipelines.values()},
            final_checkpoint=final,
            stopped=stopped,
            checkpoint_ids=[cp.id for cp in coord.checkpoints_taken],
        )
