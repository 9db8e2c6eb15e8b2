"""The end-of-input marker source: a Python streaming data source whose one
row never comes from a file.

A pipeline that names an ``event_time`` column unions this source with its
input (see :mod:`lifecycle.pipeline`). Its offset is ``{"marker": 0}`` until
the pipeline's input ends and ``{"marker": 1}`` after: the batch that moves it
from 0 to 1 carries one row, and no batch ever carries it again (a restart from
the Spark checkpoint resumes at the committed offset; a batch Spark replays
after a crash has the same offsets and the same row).

Where each piece runs: everything in a Python worker that the driver JVM
starts on the driver's host, with the driver's own interpreter (see
:func:`register`); no executor runs Python for this source. The source is a
simple stream reader: its rows are computed on the driver's side and Spark
ships them to the executors itself, for every batch, a replayed one included
(:class:`DriverSideReader`). Whether input has ended comes from the ``ended``
option, which the driver sets when it (re)starts the query: a pipeline's query
is always restarted after its input is recorded as ending, so the source opens
no file at all.

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

import sys
from collections.abc import Iterator
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, SimpleDataSourceStreamReader
from pyspark.sql.datasource_internal import _SimpleStreamReaderWrapper
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
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


class MarkerRows(SimpleDataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"marker": 0}`` then ``{"marker": 1}`` (module docstring); the
    rows of a range are a function of its two offsets alone."""

    def __init__(self, ended: bool) -> None:
        self.ended = ended

    def initialOffset(self) -> dict[str, int]:
        return {"marker": 0}

    def read(self, start: dict[str, Any]) -> tuple[Iterator[tuple[bool]], dict[str, int]]:
        # never moves back, whatever the option says (a restart after the end)
        end = {"marker": max(marker_offset(start), int(self.ended))}
        return self.readBetweenOffsets(start, end), end

    def readBetweenOffsets(
        self, start: dict[str, Any], end: dict[str, Any]
    ) -> Iterator[tuple[bool]]:
        return iter([(True,)] if marker_offset(start) < marker_offset(end) else [])

    def prepareForTriggerAvailableNow(self) -> None:
        # the target offset is fixed when the query starts: nothing to record
        pass


class DriverSideReader(_SimpleStreamReaderWrapper):
    """Hands Spark the rows of every batch from the driver's side, also a batch
    replayed after a restart (Spark's wrapper would leave that one to a Python
    worker on an executor: its cache of prefetched rows is empty then). So no
    executor ever runs Python for this source, and the source may run on the
    driver's own interpreter (see :func:`register`)."""

    def getCache(self, start: dict[str, Any], end: dict[str, Any]) -> Iterator[tuple[bool]]:
        return self.simple_reader.readBetweenOffsets(start, end)


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
        return DriverSideReader(MarkerRows(ended == "true"))


def register(spark: SparkSession) -> None:
    """Register the source with ``spark`` unless it already is (idempotent).

    Its Python runs in a worker that the driver JVM starts on the driver's host,
    with the interpreter registered with the source. That is the driver's own
    (``sys.executable``), not ``PYSPARK_PYTHON``: on a cluster the latter is
    often a path valid on executors only (``./environment/bin/python`` from
    ``spark.archives``), which a worker started by the driver cannot run."""
    try:
        exists = bool(
            spark._jsparkSession.sessionState().dataSourceManager().dataSourceExists(FORMAT)
        )
    except Exception:  # no JVM session to ask (e.g. Spark Connect): registering again is harmless
        exists = False
    if exists:
        return
    sc = spark.sparkContext
    executors_python = sc.pythonExec
    sc.pythonExec = sys.executable
    try:
        spark.dataSource.register(EndOfInputSource)
    finally:
        sc.pythonExec = executors_python


def marker_stream(source: DataFrame, event_time: str, *, ended: bool) -> DataFrame:
    """A streaming DataFrame with ``source``'s schema (every column nullable)
    that holds the end-of-input marker row once ``ended`` is true."""
    spark = source.sparkSession
    register(spark)
    raw = spark.readStream.format(FORMAT).option("ended", "true" if ended else "false").load()
    cols = [
        (F.lit(END_OF_TIME) if f.name == event_time else F.lit(None)).cast(f.dataType).alias(f.name)
        for f in source.schema.fields
    ]
    return raw.select(*cols)
