"""One pipeline of a job: its Spark query, its state, and how it ends its input.

States (drawn in :doc:`/concepts/lifecycle`)::

    RUNNING --input consumed--> ENDING_INPUT --end-of-input flushed--> FINISHED_LOGIC
    FINISHED_LOGIC --its data committed by a checkpoint--> FINISHED
    RUNNING/ENDING_INPUT --stop() (savepoint)--> STOPPED      (resumable)
    any --query failed--> FAILED

*Ending input* (Flink's ``endInput``): a bounded pipeline has consumed all its
input when its available-now query terminates. Results still held in Spark
state (event-time windows the watermark has not closed) are then flushed: when
the pipeline names its ``event_time`` column, one end-of-input marker row with
that column at 9999-12-31 (other columns null) is fed through an extra source
unioned before ``transform``, and the query runs once more (available-now): the
watermark passes every window, Spark emits them, and the marker's own window
never closes. A drained unbounded pipeline is restarted with an available-now
trigger the same way. A flag file (``ending_input.json``, read and written only
by the driver, through the job's state store) records that input is ending,
so a restart resumes the drain instead of reading new input.

The extra source is :mod:`lifecycle.end_of_input`, a Python streaming data
source, not a file: the driver tells it at query start whether input has
ended, its offset goes from ``{"marker": 0}`` to ``{"marker": 1}`` in the one
batch that carries the marker, and that row is computed on the driver's side
and shipped by Spark. Executors never read the marker (or anything else) from
the driver's disk, so the same job runs on a cluster.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import TimestampNTZType, TimestampType

from lifecycle._columns import column
from lifecycle.binding import BatchHandler, arrow_schema
from lifecycle.end_of_input import END_OF_TIME, marker_stream
from lifecycle.state.store_interface import StateStore
from sinks import _faults
from sinks.base import Sink
from sinks.errors import ConfigError

log = logging.getLogger("lifecycle.pipeline")

Transform = Callable[[DataFrame], DataFrame]


class PipelineState(str, enum.Enum):
    """Where a pipeline is in its life (module docstring)."""

    RUNNING = "RUNNING"
    ENDING_INPUT = "ENDING_INPUT"
    FINISHED_LOGIC = "FINISHED_LOGIC"
    FINISHED = "FINISHED"
    STOPPED = "STOPPED"
    FAILED = "FAILED"


@dataclass
class Pipeline:
    """A pipeline of a job (built by ``Job.add_pipeline``)."""

    name: str
    source: DataFrame
    sinks: list[Sink]
    bounded: bool
    trigger_interval: float
    output_mode: str
    store: StateStore  # the job's state_dir
    location: str  # "pipelines/<name>" in the store
    transform: Transform | None = None
    event_time: str | None = None
    expected_rows: int | None = None  # the total its progress is shown against
    source_offsets_group: str | bool = True  # :mod:`lifecycle.source_offsets`
    source_offsets_config: Mapping[str, Any] | None = None  # kafka-python settings, over those
    state: PipelineState = PipelineState.RUNNING
    query: StreamingQuery | None = None
    schema: pa.Schema = field(init=False)
    input_done_at: float | None = None  # when its input was consumed (monotonic)

    def __post_init__(self) -> None:
        if self.event_time is not None:
            f = next((f for f in self.source.schema.fields if f.name == self.event_time), None)
            if f is None or not isinstance(f.dataType, TimestampType | TimestampNTZType):
                raise ConfigError(
                    f"pipeline {self.name!r}: event_time {self.event_time!r} must be a timestamp "
                    "column of the source DataFrame"
                )
        self.schema = arrow_schema(self._output(self.source))

    # -- locations ----------------------------------------------------------------

    @property
    def spark_location(self) -> str:
        """The Spark checkpoint location, in the store (``store.uri()`` of it is
        what Spark gets)."""
        return f"{self.location}/spark"

    @property
    def _ending_flag(self) -> str:
        return f"{self.location}/ending_input.json"

    def ending_input(self) -> bool:
        """Whether ending input was started (in this run or one before a crash)."""
        return self.store.exists(self._ending_flag)

    # -- the query -------------------------------------------------------------------

    def _output(self, source: DataFrame) -> DataFrame:
        df = self.transform(source) if self.transform else source
        if self.event_time and self.event_time in df.columns:
            # the marker must never reach a sink, whatever the transform does
            col = column(self.event_time)
            end = F.lit(END_OF_TIME).cast(df.schema[self.event_time].dataType)
            df = df.where(col.isNull() | (col < end))
        return df

    def query_dataframe(self) -> DataFrame:
        """The DataFrame the query runs: the source (with the end-of-input
        marker's source beside it, with ``event_time``) through ``transform``."""
        source = self.source
        if self.event_time:
            # the marker row only in a query started after input ended (module
            # docstring), and only in append mode: update and complete modes hold
            # nothing back for the end of input, and there a marker would be
            # aggregated into a group (a window of 9999-12-31) that reaches the sinks.
            # The source stays in the union either way, so that a checkpoint keeps
            # its shape whatever the mode.
            ended = self.state is PipelineState.ENDING_INPUT and self.output_mode == "append"
            marker = marker_stream(source, self.event_time, ended=ended)
            source = source.unionByName(marker)
        return self._output(source)

    def start(self, job: str, handler: BatchHandler) -> None:
        """Start (or restart) the Spark query: available-now when the input is
        bounded or ending, else on a processing-time trigger."""
        w = (
            self.query_dataframe()
            .writeStream.queryName(f"{job}.{self.name}")
            .outputMode(self.output_mode)
            .option("checkpointLocation", self.store.uri(self.spark_location))
            .foreachBatch(handler)
        )
        available_now = self.bounded or self.state is PipelineState.ENDING_INPUT
        if available_now:
            w = w.trigger(availableNow=True)
        else:
            w = w.trigger(processingTime=f"{self.trigger_interval} seconds")
        log.info(
            "starting pipeline %s (%s)",
            self.name,
            "available-now" if available_now else f"every {self.trigger_interval}s",
        )
        self.query = w.start()

    def start_replay(self, job: str, location: str, handler: BatchHandler) -> StreamingQuery:
        """Start a query on the Spark checkpoint at ``location`` (a copy that
        ends with one uncompleted batch, :mod:`lifecycle.replay`) that runs
        that batch again and stops (a once trigger)."""
        w = (
            self.query_dataframe()
            .writeStream.queryName(f"{job}.{self.name}.replay")
            .outputMode(self.output_mode)
            .option("checkpointLocation", self.store.uri(location))
            .foreachBatch(handler)
            .trigger(once=True)
        )
        return w.start()

    def stop_query(self, grace: float = 0.0) -> None:
        """Stop the query. With ``grace``, first wait up to that many seconds for
        the micro-batch in flight (if any) to finish, so that a stop rarely
        interrupts one; an interrupted batch is rolled back and Spark replays it."""
        q = self.query
        if q is None or not q.isActive:
            return
        deadline = time.monotonic() + grace
        try:
            while q.isActive and q.status.get("isTriggerActive") and time.monotonic() < deadline:
                time.sleep(0.05)
            if q.isActive and q.status.get("isTriggerActive"):
                log.warning(
                    "pipeline %s: interrupting the micro-batch in flight (it is rolled back "
                    "and replayed)",
                    self.name,
                )
            q.stop()
        except Exception:
            log.exception("stopping pipeline %s", self.name)

    def begin_ending_input(self, *, drain: bool) -> None:
        """Record that input ends. The caller (re)starts the query afterwards;
        with ``event_time``, the restarted query feeds the end-of-input marker."""
        self.state = PipelineState.ENDING_INPUT
        if not self.store.exists(self._ending_flag):
            flag = {"at": time.time(), "drain": drain}
            self.store.write_atomic(self._ending_flag, json.dumps(flag).encode())
        _faults.hit("driver.ending_input")
