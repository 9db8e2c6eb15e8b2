"""The end-of-input marker source: a Python streaming data source whose one
row never comes from a file.

A pipeline that names an ``event_time`` column unions this source with its
input (see :mod:`lifecycle.pipeline`). Its offset is ``{"marker": 0}`` until
the pipeline's input ends and ``{"marker": 1}`` after: the batch that moves it
from 0 to 1 carries one row, and no batch ever carries it again (a restart from
the Spark checkpoint resumes at the committed offset; a batch Spark replays
after a crash has the same offsets and the same row).

Where each piece runs:

* ``latestOffset``, ``partitions``: in a Python worker that the driver JVM
  starts on the driver's host. Whether input has ended comes from the
  ``ended`` option, which the driver sets when it (re)starts the query: a
  pipeline's query is always restarted after its input is recorded as ending,
  so the reader opens no file at all.
* ``read``: in a Spark task (on an executor). It yields the row its pickled
  ``InputPartition`` describes and needs nothing else: no file, no path, no
  access to the driver's disk.

The source's own schema is one boolean column; :func:`marker_stream` projects
it onto the pipeline's source schema in Spark (the event-time column cast from
``9999-12-31T00:00:00`` in the session time zone, exactly as the filter that
keeps the marker from the sinks casts it; every other column null of its type).

Upgrading: versions before this one fed the marker from a file stream source
on ``<pipeline>/end_of_input/``, the same position of the same union. Spark
resumes such a checkpoint with this source: it hands over the file source's
last offset (``{"logOffset": n}``), which this reader reads as "marker emitted"
when ``n >= 0`` (the marker file was the only file that directory ever held)
and "not yet" otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

FORMAT = "twophase_end_of_input"
END_OF_TIME = "9999-12-31T00:00:00"
_COLUMN = "end_of_input"


def marker_offset(offset: Any) -> int:
    """1 when ``offset`` says the marker was emitted, else 0. Accepts this
    source's offsets and the file source offsets of earlier versions."""
    if not isinstance(offset, dict):
        return 0
    if "marker" in offset:
        return 1 if int(offset["marker"]) >= 1 else 0
    if "logOffset" in offset:  # FileStreamSourceOffset of the former end_of_input/ source
        return 1 if int(offset["logOffset"]) >= 0 else 0
    raise ValueError(
        f"end-of-input source: unknown offset {offset!r} in the Spark checkpoint (its second "
        "source is not an end-of-input source of this or an earlier version)"
    )


class MarkerPartition(InputPartition):
    """The one partition of the batch that carries the marker."""

    def __init__(self) -> None:
        super().__init__(1)


class EndOfInputReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"marker": 0}`` then ``{"marker": 1}`` (module docstring)."""

    def __init__(self, ended: bool) -> None:
        self.ended = ended

    def initialOffset(self) -> dict[str, int]:
        return {"marker": 0}

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        # never moves back, whatever the option says (a restart after the end)
        return {"marker": max(marker_offset(start), int(self.ended))}

    def prepareForTriggerAvailableNow(self) -> None:
        # the target offset is fixed when the query starts: nothing to record
        pass

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        if marker_offset(start) < marker_offset(end):
            return [MarkerPartition()]
        return []

    def read(self, partition: InputPartition) -> Iterator[tuple[bool]]:
        # runs on an executor: the row comes with the partition, nothing is read
        if isinstance(partition, MarkerPartition):
            yield (True,)


class EndOfInputSource(DataSource):
    """``spark.readStream.format("twophase_end_of_input").option("ended", "true"|"false")``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return f"{_COLUMN} boolean"

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        ended = str(self.options.get("ended", "false")).lower()
        if ended not in ("true", "false"):
            raise ValueError(f"end-of-input source: option ended must be true or false: {ended!r}")
        return EndOfInputReader(ended == "true")


def register(spark: SparkSession) -> None:
    """Register the source with ``spark`` unless it already is (idempotent)."""
    try:
        exists = bool(
            spark._jsparkSession.sessionState().dataSourceManager().dataSourceExists(FORMAT)
        )
    except Exception:  # no JVM session to ask (e.g. Spark Connect): registering again is harmless
        exists = False
    if not exists:
        spark.dataSource.register(EndOfInputSource)


def marker_stream(source: DataFrame, event_time: str, *, ended: bool, pipeline: str) -> DataFrame:
    """A streaming DataFrame with ``source``'s schema (every column nullable)
    that holds the end-of-input marker row once ``ended`` is true."""
    spark = source.sparkSession
    register(spark)
    raw = (
        spark.readStream.format(FORMAT)
        .option("ended", "true" if ended else "false")
        .option("pipeline", pipeline)
        .load()
    )
    cols = [
        (F.lit(END_OF_TIME) if f.name == event_time else F.lit(None)).cast(f.dataType).alias(f.name)
        for f in source.schema.fields
    ]
    return raw.select(*cols)
