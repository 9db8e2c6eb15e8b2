"""The end-of-input marker source (``lifecycle/end_of_input.py``): offsets, the
row it carries, its schema, and that the row comes with the partition (no file).

The lifecycle tests (``tests/test_lifecycle.py``) run it inside jobs.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.streaming.datasource import ReadAllAvailable
from pyspark.sql.types import StructType

from lifecycle.end_of_input import (
    END_OF_TIME,
    DriverSideReader,
    MarkerRows,
    marker_offset,
    marker_stream,
)
from tests.sparkutil import EVENT_SCHEMA

ALL = ReadAllAvailable()


def _reader(ended: bool) -> DriverSideReader:
    return DriverSideReader(MarkerRows(ended))


def _rows(reader: DriverSideReader, start: Any, end: Any) -> list[tuple[bool]]:
    rows = reader.getCache(start, end)
    assert rows is not None, "a range Spark would leave to an executor's Python"
    return list(rows)


def test_the_marker_is_in_exactly_one_offset_range() -> None:
    running = _reader(ended=False)
    start = running.initialOffset()
    assert start == {"marker": 0}
    assert running.latestOffset(start, ALL) == start
    assert _rows(running, start, start) == []

    ended = _reader(ended=True)
    end = ended.latestOffset(start, ALL)
    assert end == {"marker": 1}
    assert _rows(ended, start, end) == [(True,)]
    assert ended.latestOffset(end, ALL) == end  # then never again
    assert _rows(ended, end, end) == []
    # an option that says "not ended" after the end never moves the offset back
    assert running.latestOffset(end, ALL) == end


def test_every_range_is_answered_on_the_driver_side() -> None:
    """Spark asks the driver-side reader for the rows of each batch it plans
    (``getCache``) and leaves the batch to a Python worker on an executor only
    when that answer is missing, as Spark's own wrapper's is for a batch
    replayed after a restart (its cache is empty then). This reader answers
    every range, a fresh reader included, and holds no path."""
    fresh = _reader(ended=True)  # as after a restart: nothing read yet
    assert vars(fresh.simple_reader) == {"ended": True}
    assert _rows(fresh, {"marker": 0}, {"marker": 1}) == [(True,)]
    shipped = pickle.loads(pickle.dumps(fresh))
    assert _rows(shipped, {"marker": 1}, {"marker": 1}) == []


@pytest.mark.parametrize(
    ("legacy", "emitted"),
    [({"logOffset": -1}, 0), ({"logOffset": 0}, 1), ({"logOffset": 3}, 1)],
)
def test_offsets_of_the_former_file_source_are_understood(legacy: Any, emitted: int) -> None:
    """Checkpoints of earlier versions hold a file source's offset at this
    source's place: a file read there was the marker."""
    assert marker_offset(legacy) == emitted
    assert marker_offset(None) == 0
    reader = _reader(ended=True)
    assert reader.latestOffset(legacy, ALL) == {"marker": 1}
    assert len(_rows(reader, legacy, {"marker": 1})) == 1 - emitted
    with pytest.raises(ValueError, match="unknown offset"):
        marker_offset({"partition": 7})


def _fields(schema: StructType) -> list[tuple[str, str]]:
    return [(f.name, f.dataType.simpleString()) for f in schema.fields]


def test_the_marker_stream_has_the_source_schema(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rate = spark.readStream.format("rate").load()  # timestamp and value are NOT NULL
    ntz = spark.readStream.schema("k string, at timestamp_ntz, v array<int>").json(str(tmp_path))
    events = spark.readStream.schema(EVENT_SCHEMA).json(str(tmp_path))
    for source, column in ((rate, "timestamp"), (ntz, "at"), (events, "ts")):
        marker = marker_stream(source, column, ended=True)
        assert marker.isStreaming
        assert _fields(marker.schema) == _fields(source.schema)
        assert all(f.nullable for f in marker.schema.fields)
        union = source.unionByName(marker)
        assert _fields(union.schema) == _fields(source.schema)
        assert all(f.nullable for f in union.schema.fields)


def _run(df: DataFrame, checkpoint: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def collect(batch: DataFrame, batch_id: int) -> None:
        rows.extend(r.asDict() for r in batch.collect())

    q = (
        df.writeStream.option("checkpointLocation", str(checkpoint))
        .foreachBatch(collect)
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination(120)
    assert not q.isActive and q.exception() is None
    return rows


def test_the_marker_row_once_and_never_again(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Available-now over the same checkpoint: no row before input ends, the
    marker once when it ends, nothing on every later start; no file but the
    Spark checkpoint."""
    (tmp_path / "in").mkdir()
    source = spark.readStream.schema(EVENT_SCHEMA).json(str(tmp_path / "in"))
    end = F.lit(END_OF_TIME).cast("timestamp")

    def marker(ended: bool) -> DataFrame:
        m = marker_stream(source, "ts", ended=ended)
        return m.select("*", (F.col("ts") == end).alias("at_end"))

    checkpoint = tmp_path / "ck"
    assert _run(marker(False), checkpoint) == []
    rows = _run(marker(True), checkpoint)
    assert rows == [{"id": None, "ts": rows[0]["ts"], "amount": None, "at_end": True}]
    assert _run(marker(True), checkpoint) == []
    assert _run(marker(False), checkpoint) == []
    logs = sorted((checkpoint / "offsets").glob("[0-9]*"), key=lambda p: int(p.name))
    assert json.loads(logs[-1].read_text().splitlines()[-1]) == {"marker": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "in"]
