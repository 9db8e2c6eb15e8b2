"""Column types and values at the edges, through each sink's real preflight and
writer (no Spark): what a sink cannot store faithfully is refused with an error
naming the column, before anything is created or committed.

The property tests over random schemas and values are in test_fuzz_types.py;
the cases here are the ones it found, kept as plain examples."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sinks import PostgresSink, PreflightError
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
