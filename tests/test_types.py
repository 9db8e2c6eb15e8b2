"""Column types and values at the edges, through each sink's real preflight and
writer (no Spark): what a sink cannot store faithfully is refused with an error
naming the column, before anything is created or committed.

The property tests over random schemas and values are in test_fuzz_types.py;
the cases here are the ones it found, kept as plain examples."""

from __future__ import annotations

import decimal
import itertools
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sinks import DataError, PostgresSink, PreflightError
from sinks.base import JobScope, WriteContext
from sinks.delta import DeltaSink

# -- PostgreSQL: create_table ------------------------------------------------------------


def _exists(dsn: str, table: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as c:
        return c.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is not None


@pytest.mark.parametrize(
    "nested",
    [
        pa.struct([("x", pa.int64())]),
        pa.list_(pa.int64()),
        pa.map_(pa.string(), pa.int64()),
    ],
    ids=["struct", "array", "map"],
)
def test_create_table_refuses_nested_columns_naming_column_and_type(
    pg_module_dsn: str, nested: pa.DataType
) -> None:
    table = f"nested_{nested.id}"
    schema = pa.schema([("id", pa.int64()), ("payload", nested)])
    with pytest.raises(PreflightError) as e:
        PostgresSink(pg_module_dsn, table, create_table=True).preflight(schema)
    message = str(e.value)
    assert f"public.{table}" in message and "create_table=True" in message
    assert f"column 'payload': the DataFrame type {nested} is nested" in message
    assert not _exists(pg_module_dsn, table)
    # an existing table says the same through the column check
    with psycopg.connect(pg_module_dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE {table} (id bigint, payload text)")
    with pytest.raises(PreflightError, match=r"column 'payload': the DataFrame type .* is nested"):
        PostgresSink(pg_module_dsn, table).preflight(schema)


def test_create_table_reports_every_problem_before_creating_anything(pg_module_dsn: str) -> None:
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("id", pa.string()),
            ("", pa.int32()),
            ("a\0b", pa.int32()),
            ("x" * 64, pa.int32()),
            ("wide", pa.decimal256(50, 2)),
            ("t", pa.time64("us")),
        ]
    )
    with pytest.raises(PreflightError) as e:
        PostgresSink(pg_module_dsn, "many", key=["nope"], create_table=True).preflight(schema)
    message = str(e.value)
    for text in (
        "column 'id' appears more than once",
        "a column has an empty name",
        "column 'a\\x00b': PostgreSQL names cannot contain NUL",
        f"column '{'x' * 64}' is 64 bytes long; PostgreSQL would cut it to 63 bytes",
        "column 'wide': the DataFrame type decimal256(50, 2) has more than 38 digits",
        "column 't': the DataFrame type time64[us] is not supported",
        "key column 'nope' is not a column of the DataFrame",
    ):
        assert text in message, (text, message)
    assert not _exists(pg_module_dsn, "many")


def test_decimal_wider_than_38_digits_is_refused_at_preflight(pg_module_dsn: str) -> None:
    """pgpq encodes decimal128 only: numeric(50,2) used to pass preflight and the
    task failed with pgpq's bare 'Failed to create encoder: TypeNotSupported'."""
    with psycopg.connect(pg_module_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE wide (id bigint, amount numeric(50,2))")
    schema = pa.schema([("id", pa.int64()), ("amount", pa.decimal256(50, 2))])
    with pytest.raises(PreflightError, match=r"column 'amount': .* more than 38 digits"):
        PostgresSink(pg_module_dsn, "wide").preflight(schema)


def test_create_table_columns_hold_every_value_of_their_type(pg_module_dsn: str) -> None:
    """uint32 got integer (4294967295 refused at write time), a timestamp
    without time zone got timestamptz (a wall-clock time stored as if UTC), a
    negative decimal scale numeric(5,-2) (refused before PostgreSQL 15)."""
    arrays = {
        "u8": pa.array([255], pa.uint8()),
        "u16": pa.array([65_535], pa.uint16()),
        "u32": pa.array([2**32 - 1], pa.uint32()),
        "u64": pa.array([2**64 - 1], pa.uint64()),
        "ntz": pa.array([1_000_000], pa.int64()).view(pa.timestamp("us")),
        "tz": pa.array([1_000_000], pa.int64()).view(pa.timestamp("ms", "Europe/Paris")),
        "hundreds": pa.array([decimal.Decimal("12300")], pa.decimal128(5, -2)),
        "cents": pa.array([decimal.Decimal("-999.99")], pa.decimal128(5, 2)),
    }
    batch = pa.record_batch({"id": pa.array([0], pa.int64()), **arrays})
    sink = PostgresSink(pg_module_dsn, "created", create_table=True, sink_id="created")
    sink.preflight(batch.schema)
    with psycopg.connect(pg_module_dsn, autocommit=True) as c:
        types = dict(
            c.execute(
                "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
                " WHERE attrelid = 'created'::regclass AND attnum > 1"
            ).fetchall()
        )
    assert types == {
        "u8": "smallint",
        "u16": "integer",
        "u32": "bigint",
        "u64": "numeric",
        "ntz": "timestamp without time zone",
        "tz": "timestamp with time zone",
        "hundreds": "numeric(7,0)",
        "cents": "numeric(5,2)",
    }
    ctx = WriteContext(JobScope("types", "p", "created"), 1, 0, 0, next(_attempts))
    writer = sink.open_writer(ctx, batch.schema)
    writer.write(batch)
    sink.committer().commit([writer.prepare()])
    writer.close()
    with psycopg.connect(pg_module_dsn, autocommit=True) as c:
        c.execute("SET TimeZone = 'America/New_York'")  # not UTC: wall clock vs instant
        row = c.execute(f"SELECT {', '.join(f'{n}::text' for n in arrays)} FROM created").fetchone()
    assert row == (
        "255",
        "65535",
        "4294967295",
        "18446744073709551615",
        "1970-01-01 00:00:01",
        "1969-12-31 19:16:40-05",
        "12300",
        "-999.99",
    )


# -- PostgreSQL: values the writer refuses ---------------------------------------------------

_attempts = itertools.count(1)


def _write(dsn: str, table: str, column: str, arr: pa.Array, *, key: list[str] | None = None):
    """Write ``arr`` (with an ``id`` column) through the sink's own writer and
    commit; return the error raised, or None. Nothing may be left prepared."""
    batch = pa.record_batch({"id": pa.array(range(len(arr)), pa.int64()), column: arr})
    sink = PostgresSink(dsn, table, key=key, sink_id="types")
    sink.preflight(batch.schema)
    ctx = WriteContext(JobScope("types", "p", "types"), 1, 0, 0, next(_attempts))
    writer = sink.open_writer(ctx, batch.schema)
    try:
        writer.write(batch)
        committable = writer.prepare()
    except Exception as e:
        writer.close(failed=True)
        assert not _prepared(dsn, str(ctx.txn_name()))
        return e
    writer.close()
    sink.committer().commit([committable])
    return None


def _prepared(dsn: str, gid: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as c:
        return bool(c.execute("SELECT 1 FROM pg_prepared_xacts WHERE gid = %s", (gid,)).fetchall())


def _rows(dsn: str, table: str, expr: str = "v::text") -> list[Any]:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SET TimeZone = UTC; SET DateStyle = ISO")
        return [r[0] for r in c.execute(f"SELECT {expr} FROM {table} ORDER BY id").fetchall()]


@pytest.mark.parametrize(
    ("ddl", "arr", "expected"),
    [
        pytest.param(
            "v text",
            pa.array(["ok", "a\0b"]),
            "column 'v' (text), row 1 of a record batch: 'a\\x00b' holds NUL (\\x00)",
            id="nul-text",  # was: CharacterNotInRepertoire from the server, naming no row
        ),
        pytest.param(
            "v timestamptz",
            pa.array([0, -(2**63) + 946_684_800_000_000], pa.int64()).view(
                pa.timestamp("us", "UTC")
            ),
            "row 1 of a record batch: -9222425352054775808 us since 1970-01-01 is out of "
            "PostgreSQL's range",
            id="timestamp-as-minus-infinity",  # was: written as -infinity, silently
        ),
        pytest.param(
            "v date",
            pa.array([-(2**31) + 10_957], pa.int32()).view(pa.date32()),
            "-2147472691 days since 1970-01-01 is out of PostgreSQL's range",
            id="date-as-minus-infinity",  # was: written as -infinity, silently
        ),
        pytest.param(
            "v date",
            pa.array([-(2**31)], pa.int32()).view(pa.date32()),
            "-2147483648 days since 1970-01-01 is out of PostgreSQL's range",
            id="date-underflow",  # was: pgpq's 'Encode { reason: "Underflow converting days' ...
        ),
        pytest.param(
            "v timestamp",
            pa.array([-210_866_803_200_000_001], pa.int64()).view(pa.timestamp("us")),
            "is out of PostgreSQL's range (4714-11-24 00:00 BC to 294276-12-31)",
            id="timestamp-before-4714-BC",  # was: the server's 'timestamp out of range'
        ),
        pytest.param(
            "v numeric(10,2)",
            pa.array([decimal.Decimal("1.235")], pa.decimal128(10, 3)),
            "column 'v' (numeric(10,2)), row 0 of a record batch: Decimal('1.235') cannot be "
            "written exactly",
            id="numeric-scale-rounds",  # was: stored as 1.24, silently
        ),
        pytest.param(
            "v real",
            pa.array([1.0, 1e300]),
            "row 1 of a record batch: 1e+300 is too large for real",
            id="real-overflow",  # was: stored as Infinity, silently
        ),
        pytest.param(
            "v timestamptz",
            pa.array([1_000, 1_001], pa.int64()).view(pa.timestamp("ns", "UTC")),
            "row 1 of a record batch: 1970-01-01T00:00:00.000001001+00:00 cannot be written "
            "exactly (Casting from timestamp[ns, tz=UTC] to timestamp[us, tz=UTC] would lose data",
            id="nanoseconds",  # was: pyarrow's ArrowInvalid, naming no column
        ),
        pytest.param(
            "v integer",
            pa.array([1, 2**31], pa.int64()),
            "column 'v' (integer), row 1 of a record batch: 2147483648 cannot be written exactly",
            id="narrowed-integer",  # was: pyarrow's ArrowInvalid, naming no column
        ),
    ],
)
def test_postgres_writer_refuses_values_it_cannot_store_exactly(
    pg_module_dsn: str, ddl: str, arr: pa.Array, expected: str
) -> None:
    table = f"v{next(_attempts)}"
    with psycopg.connect(pg_module_dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE {table} (id bigint, {ddl})")
    error = _write(pg_module_dsn, table, "v", arr)
    assert isinstance(error, DataError), repr(error)
    assert f"PostgreSQL table public.{table} at " in str(error)
    assert expected in str(error), str(error)
    assert _rows(pg_module_dsn, table) == []


def test_postgres_upsert_refuses_nul_too(pg_module_dsn: str) -> None:
    with psycopg.connect(pg_module_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE up (id bigint PRIMARY KEY, v text)")
    error = _write(pg_module_dsn, "up", "v", pa.array(["\0"]), key=["id"])
    assert isinstance(error, DataError) and "holds NUL" in str(error)
    assert "public.up" in str(error) and "stage_" not in str(error)


def test_postgres_values_at_the_edges_are_written_exactly(pg_module_dsn: str) -> None:
    """The other side of each refusal: the last values that fit."""
    cases = [
        (
            "timestamptz",
            pa.array([-210_866_803_200_000_000, 2**63 - 1], pa.int64()).view(
                pa.timestamp("us", "UTC")
            ),
            ["4714-11-24 00:00:00+00 BC", "294247-01-10 04:00:54.775807+00"],
        ),
        (
            "date",
            pa.array([-2_440_588, 2_145_042_905], pa.int32()).view(pa.date32()),
            ["4714-11-24 BC", "5874897-12-31"],
        ),
        ("numeric(10,2)", pa.array([decimal.Decimal("1.230")], pa.decimal128(10, 3)), ["1.23"]),
        (
            "numeric",
            pa.array([decimal.Decimal("-" + "9" * 38)], pa.decimal128(38, 0)),
            ["-" + "9" * 38],
        ),
        ("numeric", pa.array([decimal.Decimal("12.5")], pa.decimal64(5, 1)), ["12.5"]),
        (
            "real",
            pa.array([3.4028234663852886e38, float("inf"), float("nan")]),
            ["3.4028235e+38", "Infinity", "NaN"],
        ),
        ("text", pa.array(["\u00e9\U0010ffff\\'"]), ["\u00e9\U0010ffff\\'"]),
    ]
    for n, (pg, arr, want) in enumerate(cases):
        table = f"edge{n}"
        with psycopg.connect(pg_module_dsn, autocommit=True) as c:
            c.execute(f"CREATE TABLE {table} (id bigint, v {pg})")
        assert _write(pg_module_dsn, table, "v", arr) is None, pg
        assert _rows(pg_module_dsn, table) == want, pg


# -- Delta: table creation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (
            pa.schema([("id", pa.int64()), ("ID", pa.int64())]),
            "the column names: 'id' and 'ID' differ only in case",
        ),
        (
            pa.schema([("s", pa.struct([("x", pa.int64()), ("X", pa.string())]))]),
            "the fields of struct column s: 'x' and 'X' differ only in case",
        ),
        (
            pa.schema([("a\0b", pa.int64())]),
            "name 'a\\x00b' holds NUL",
        ),
    ],
    ids=["case", "struct-case", "nul"],
)
def test_delta_create_refuses_names_delta_cannot_hold(
    tmp_path: Path, schema: pa.Schema, expected: str
) -> None:
    """deltalake raised a bare ``Exception`` ('Schema error: Duplicate field name
    (case-insensitive)') for the first two; for a NUL it created a table with
    the name cut at the NUL, and preflight then failed on the table it made."""
    uri = str(tmp_path / "t")
    with pytest.raises(PreflightError) as e:
        DeltaSink(uri).preflight(schema)
    assert f"Delta table {uri} cannot be created from the DataFrame" in str(e.value)
    assert expected in str(e.value)
    assert not DeltaTable.is_deltatable(uri)


def _delta_write(uri: str, batch: pa.RecordBatch, partition_by: list[str] | None = None) -> None:
    """Preflight, one task's writer, commit: the Delta sink's real path."""
    sink = DeltaSink(uri, partition_by=partition_by, sink_id="types")
    sink.preflight(batch.schema)
    ctx = WriteContext(JobScope("types", "p", "types", "0123456789ab"), 1, 1, 0, 1)
    writer = sink.open_writer(ctx, batch.schema)
    ok = False
    try:
        writer.write(batch)
        committable = writer.prepare()
        ok = True
    finally:
        writer.close(failed=not ok)
    sink.committer().commit([committable])


@pytest.mark.parametrize(
    ("t", "values"),
    [
        (pa.decimal128(5, -2), [decimal.Decimal("12300"), decimal.Decimal("-9999900")]),
        (pa.decimal128(3, 3), [decimal.Decimal("0.001"), decimal.Decimal("-0.999")]),
    ],
    ids=["negative-scale", "scale-equals-precision"],
)
def test_delta_decimal_scales_are_stored_exactly(
    tmp_path: Path, t: pa.DataType, values: list[decimal.Decimal]
) -> None:
    """A negative scale made deltalake raise a bare Exception ('Negative scales are
    not supported in Delta') when creating the table: it becomes scale 0."""
    uri = str(tmp_path / "t")
    _delta_write(uri, pa.record_batch({"d": pa.array(values, t)}))
    got = DeltaTable(uri).to_pyarrow_table().column("d").to_pylist()
    assert got == values


def test_delta_refuses_structs_without_fields_at_preflight(tmp_path: Path) -> None:
    """Preflight created the table, then every task failed in pyarrow's
    ParquetWriter ('Cannot write struct type ... with no child field')."""
    for t in (pa.struct([]), pa.list_(pa.struct([]))):
        uri = str(tmp_path / f"t{t.id}")
        with pytest.raises(PreflightError, match="a struct without fields cannot be stored"):
            DeltaSink(uri).preflight(pa.schema([("id", pa.int64()), ("s", t)]))
        assert not DeltaTable.is_deltatable(uri)


def test_delta_refuses_a_date_partition_value_outside_years_1_to_9999(tmp_path: Path) -> None:
    """It failed with a bare OverflowError ('date value out of range')."""
    uri = str(tmp_path / "t")
    days = pa.array([0, 2_932_897], pa.int32()).view(pa.date32())  # 10000-01-01
    with pytest.raises(DataError, match=r"partition column 'day': the date 2932897 days"):
        _delta_write(uri, pa.record_batch({"id": [1, 2], "day": days}), ["day"])
    assert DeltaTable(uri).version() == 0
    assert [p for p in Path(uri).rglob("*.parquet")] == []


@pytest.mark.parametrize("ratio", [[0.25, 0.5], [float("nan"), 0.5]], ids=["finite", "nan"])
def test_deltalake_filters_find_every_row_the_sink_wrote(
    tmp_path: Path, ratio: list[float]
) -> None:
    """deltalake prunes a file from a filtered scan when its statistics lack a
    bound of the filtered column, and it decodes an escaped surrogate pair
    wrongly: filters on the boolean, decimal, zone-less timestamp and float (with
    a NaN) columns found no rows, on the string U+20000 neither. With a NaN
    the file has no bounds at all; without, every column has them."""
    uri = str(tmp_path / "t")
    long = "a string longer than thirty-two characters"
    batch = pa.record_batch(
        {
            "id": pa.array([1, 2], pa.int64()),
            "flag": [True, False],
            "amount": pa.array(
                [decimal.Decimal("1.50"), decimal.Decimal("-2.25")], pa.decimal64(9, 2)
            ),
            "local": pa.array([1_000_001, 5], pa.int64()).view(pa.timestamp("us")),
            "name": [long, "\U00020000"],
            "ratio": ratio,
        }
    )
    _delta_write(uri, batch)
    table = DeltaTable(uri)
    (stats,) = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    assert (stats.get("min.flag") is not None) == (ratio[0] == ratio[0])
    for row in batch.to_pylist():
        for column, value in row.items():
            if value != value:  # NaN
                continue
            found = table.to_pyarrow_table(columns=["id"], filters=[(column, "=", value)])
            assert found.column("id").to_pylist() == [row["id"]], (column, value, stats)
