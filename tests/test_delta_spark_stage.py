"""The Delta sink's two routes to staged files: Spark's own Parquet writer
(``write_with="spark"``, :mod:`sinks.delta.spark_stage`) and the sink's pyarrow
writer in ``mapInArrow`` tasks (``write_with="arrow"``). The same batch written
both ways must give the same table: the same rows, the same add-action
statistics (the Spark route reads them from footers, the Arrow route computes
them from the data), timestamps as INT64 microseconds (never INT96), and
nothing of Spark's (``_SUCCESS``, ``_temporary``, ``.crc``) left in the table.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from decimal import Decimal
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from lifecycle import Job
from sinks import ConfigError, DeltaSink
from tests import deltacheck

SCHEMA = (
    "id long, b byte, s short, i int, f float, d double, dec decimal(12,3), "
    "txt string, flag boolean, day date, ts timestamp, ntz timestamp_ntz, raw binary, "
    "st struct<x:int,y:string>, arr array<long>, m map<string,double>, kind string"
)
UTC = dt.timezone.utc


def _row(i: int) -> tuple[object, ...]:
    if i % 7 == 3:
        return (i, *([None] * 15), "k" if i % 2 else None)  # nulls everywhere
    return (
        i,
        i % 120 - 60,
        i * 7 - 3000,
        i * 1001,
        float("nan") if i == 11 else i / 3,
        -math.inf if i == 17 else i * 1.5,
        Decimal(i * 1250) / 1000,
        ("\u00e9t\u00e9 " + "x" * (i % 40)) + ("\U00020000" if i % 5 == 0 else ""),
        i % 3 == 0,
        dt.date(2020, 1, 1) + dt.timedelta(days=i * 37),
        dt.datetime(2024, 2, 29, tzinfo=UTC) + dt.timedelta(microseconds=i * 123_457),
        dt.datetime(1999, 12, 31) + dt.timedelta(seconds=i * 61, microseconds=i),
        bytes([i % 256]) * (i % 5),
        (i, f"s{i}"),
        list(range(i % 4)),
        {f"k{i % 3}": i / 4},
        ["a", "b c", "x:/y"][i % 3],
    )


def _write(  # type: ignore[no-untyped-def]
    spark, tmp: Path, route: str, data: Path, rows: int, schema: str = SCHEMA, by=("kind",)
) -> str:
    uri = str(tmp / f"table-{route}")
    src = spark.readStream.schema(schema).parquet(str(data))
    job = Job(spark, f"stage{route}", tmp / f"state-{route}", checkpoint_interval=0.0)
    job.add_pipeline(
        "p", src, [DeltaSink(uri, partition_by=list(by), write_with=route)], bounded=True
    )
    result = job.run(handle_signals=False)
    assert result.committed, result
    assert DeltaTable(uri).count() == rows
    return uri


def _adds(uri: str) -> list[dict[str, object]]:
    """Partition values and statistics of every file added, read from ``_delta_log``."""
    adds = []
    for log in sorted((Path(uri) / "_delta_log").glob("*.json")):
        for line in log.read_text().splitlines():
            a = json.loads(line).get("add") if line.strip() else None
            if a is not None:
                adds.append({"partition": a["partitionValues"], "stats": json.loads(a["stats"])})
    return sorted(adds, key=lambda a: json.dumps(a, sort_keys=True))


def test_spark_and_arrow_routes_write_the_same_table(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rows = 60
    data = tmp_path / "in"
    spark.createDataFrame([_row(i) for i in range(rows)], SCHEMA).coalesce(1).write.parquet(
        str(data)
    )
    by_route = {r: _write(spark, tmp_path, r, data, rows) for r in ("spark", "arrow")}

    tables = {r: DeltaTable(uri).to_pyarrow_table().sort_by("id") for r, uri in by_route.items()}
    assert tables["spark"].schema == tables["arrow"].schema
    assert tables["spark"].to_pylist() == tables["arrow"].to_pylist() or _equal_with_nan(
        tables["spark"].to_pylist(), tables["arrow"].to_pylist()
    )
    spark_adds, arrow_adds = _adds(by_route["spark"]), _adds(by_route["arrow"])
    assert len(spark_adds) == 5  # one file per partition value, null included
    assert spark_adds == arrow_adds
    # bounds where every column has one; none at all in a file holding a NaN
    with_bounds = [a for a in spark_adds if "minValues" in a["stats"]]
    assert with_bounds and len(with_bounds) < len(spark_adds)

    for route, uri in by_route.items():
        deltacheck.assert_nothing_staged(uri)  # no _SUCCESS, .crc, _temporary, staging dir
        for f in deltacheck.data_files(uri):
            meta = pq.ParquetFile(Path(uri) / f).metadata
            kinds = {
                meta.schema.column(j).path: meta.schema.column(j).physical_type
                for j in range(meta.num_columns)
            }
            assert kinds["ts"] == kinds["ntz"] == "INT64", (route, kinds)
            if route == "spark":
                assert "parquet-mr" in (meta.created_by or ""), meta.created_by


def test_both_routes_name_partitions_of_every_type_alike(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Partition values of integer, boolean, date and string columns (nulls and
    characters Spark escapes included) are the same strings in both routes'
    add actions, and the files lie in the same directories."""
    schema = "id long, n short, flag boolean, day date, kind string"
    kinds = ["a", "b c", "x:/y=%", None]
    rows = [
        (
            i,
            None if i % 5 == 4 else i % 3 - 1,
            None if i % 7 == 6 else i % 2 == 0,
            dt.date(1999, 12, 31) + dt.timedelta(days=i % 2),
            kinds[i % 4],
        )
        for i in range(40)
    ]
    data = tmp_path / "in"
    spark.createDataFrame(rows, schema).coalesce(1).write.parquet(str(data))
    by = ("n", "flag", "day", "kind")
    uris = {r: _write(spark, tmp_path, r, data, 40, schema, by) for r in ("spark", "arrow")}
    assert _adds(uris["spark"]) == _adds(uris["arrow"])
    dirs = {r: {f.rsplit("/", 1)[0] for f in deltacheck.data_files(u)} for r, u in uris.items()}
    assert dirs["spark"] == dirs["arrow"]
    assert any("__HIVE_DEFAULT_PARTITION__" in d for d in dirs["spark"])
    tables = {r: DeltaTable(u).to_pyarrow_table().sort_by("id") for r, u in uris.items()}
    assert tables["spark"].to_pylist() == tables["arrow"].to_pylist()
    assert tables["spark"].to_pylist() == [dict(zip(("id", *by), r, strict=True)) for r in rows]


def _equal_with_nan(a: list[dict[str, object]], b: list[dict[str, object]]) -> bool:
    def norm(v: object) -> object:
        return "NaN" if isinstance(v, float) and math.isnan(v) else v

    return [{k: norm(v) for k, v in r.items()} for r in a] == [
        {k: norm(v) for k, v in r.items()} for r in b
    ]


def test_spark_route_refuses_nulls_in_a_not_null_column_and_leaves_nothing(
    spark,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    uri = str(tmp_path / "strict")
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string())])
    write_deltalake(uri, pa.table({"id": [0], "name": ["x"]}, schema=schema))
    data = tmp_path / "in"
    spark.createDataFrame([(1, "a"), (None, "b")], "id long, name string").write.parquet(str(data))
    src = spark.readStream.schema("id long, name string").parquet(str(data))
    job = Job(spark, "strict", tmp_path / "state", checkpoint_interval=0.0)
    job.add_pipeline("p", src, [DeltaSink(uri, write_with="spark")], bounded=True)
    with pytest.raises(Exception, match="NOT NULL") as info:
        job.run(handle_signals=False)
    assert "id" in str(info.value)
    assert DeltaTable(uri).count() == 1
    deltacheck.assert_nothing_staged(uri)


def test_write_with_is_checked() -> None:
    with pytest.raises(ConfigError, match="write_with"):
        DeltaSink("/tmp/x", write_with="rust")
    with pytest.raises(ConfigError, match="local or shared-filesystem"):
        DeltaSink("s3://bucket/table", write_with="spark")
    assert DeltaSink("s3://bucket/table").write_with == "auto"
