"""Property tests (hypothesis) of the Arrow -> PostgreSQL binary COPY mapping and
of the Delta statistics, over random schemas and values: nulls, extremes, NaN
and infinities, unicode with NUL, decimals at the edge of their precision and
wider than 38 digits, timestamps with and without zones and out of each
target's range.

The property: what is written reads back equal, or the input is refused with a
clear error (naming the column) before anything is committed. Each example runs
the sink's real path without Spark: preflight, a task's writer (write, prepare),
the driver's commit; then reads the target back. What to expect of each value
is computed here, independently of the sink (:func:`pg_expect`,
:func:`delta_bounds`).

Examples are derandomised (the same on every run) and few, so that the module
runs in seconds; ``TWOPHASE_FUZZ_EXAMPLES=N`` runs N random ones per test instead.
"""

from __future__ import annotations

import datetime as dt
import decimal
import itertools
import json
import math
import os
import re
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sinks import DataError, PostgresSink, PreflightError
from sinks.base import Committable, JobScope, SinkWriter, WriteContext
from sinks.delta import DeltaSchemaError, DeltaSink

EXAMPLES = int(os.environ.get("TWOPHASE_FUZZ_EXAMPLES", "0"))


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=EXAMPLES or examples,
        deadline=None,
        derandomize=not EXAMPLES,  # a long run explores afresh each time
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- values ---------------------------------------------------------------------------------

I64 = (-(2**63), 2**63 - 1)
I32 = (-(2**31), 2**31 - 1)
US_PER_DAY = 86_400_000_000
PG_MIN_DAY = -2_440_588  # 4714-11-24 BC, in days since 1970-01-01 (PostgreSQL's first date)
PG_END_DAY = 2_145_042_906  # the day after 5874897-12-31 (its last)
PG_MIN_US = PG_MIN_DAY * US_PER_DAY  # its first timestamp; its last is after Arrow's
PG_EPOCH_DAYS = 10_957  # 2000-01-01 (PostgreSQL's epoch) in days since 1970-01-01
UNIT_US = {"s": 1_000_000, "ms": 1_000, "us": 1}  # nanoseconds: see _to_us
BIG = decimal.Context(prec=200)


def nullable(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), values, values, values)


def mostly(
    common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], one_in: int = 12
) -> st.SearchStrategy[Any]:
    """``common``, and ``rare`` about once in ``one_in`` draws (a task with a few
    rows then still often holds only values the target takes)."""
    return st.integers(1, one_in).flatmap(lambda i: rare if i == 1 else common)


def edges(lo: int, hi: int, *inner: int) -> st.SearchStrategy[int]:
    """The ends of [lo, hi], 0 and ``inner`` values, and their neighbours in [lo, hi]."""
    near = sorted({e + d for e in (lo, hi, 0, *inner) for d in (-1, 0, 1) if lo <= e + d <= hi})
    return st.sampled_from(near)


def day_values() -> st.SearchStrategy[int]:
    """date32 days: mostly years 1 to 9999; rarely PostgreSQL's and Python's
    range edges, the value whose shift to PostgreSQL's 2000 epoch overflows to
    its ``-infinity``, or anything."""
    rare = st.one_of(
        edges(*I32, PG_MIN_DAY, PG_END_DAY, I32[0] + PG_EPOCH_DAYS, -719_162, 2_932_896),
        st.integers(*I32),
    )
    return mostly(st.integers(-719_162, 2_932_896), rare)


def timestamp_values(unit: str) -> st.SearchStrategy[int]:
    """Raw timestamps in ``unit``: mostly years 385 to 10208; rarely PostgreSQL's
    first, the value whose shift to the 2000 epoch would be ``-infinity``, or
    anything in int64."""
    scale = {"s": 1e-6, "ms": 1e-3, "us": 1, "ns": 1_000}[unit]
    common = st.integers(max(I64[0], round(-5e16 * scale)), min(I64[1], round(2.6e17 * scale)))
    if unit == "ns":  # whole microseconds too, which convert
        common = st.one_of(common, st.integers(-(10**15), 10**15).map(lambda v: v * 1000))
    specials = [round(PG_MIN_US * scale), I64[0] + 946_684_800_000_000]
    return mostly(common, st.one_of(edges(*I64, *specials), st.integers(*I64)))


def int_values(lo: int, hi: int) -> st.SearchStrategy[int]:
    inner = (2**15, 2**31, 2**24 + 1, 2**53 + 1, 10**10)
    small = st.integers(max(lo, -1000), min(hi, 1000))
    return st.one_of(small, edges(lo, hi, *inner), st.integers(lo, hi))


def unscaled_values(p: int) -> st.SearchStrategy[int]:
    """Unscaled integers of a decimal of ``p`` digits, often at the edge."""
    top = 10**p - 1
    small = st.integers(-min(top, 1000), min(top, 1000))
    return st.one_of(edges(-top, top), small, st.integers(-top, top))


def decimal_of(t: pa.DataType, unscaled: int) -> Decimal:
    return Decimal(unscaled).scaleb(-t.scale, BIG)


TEXT = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=40),
    st.text(st.sampled_from("a\u00e9\u2603\U0001f600\U0010ffff \\'\"\n"), max_size=40),
)
TEXT_WITH_NUL = mostly(TEXT, st.text(st.sampled_from("a\0\u00e9"), min_size=1, max_size=5), 3)


@dataclass(frozen=True)
class Kind:
    """A source Arrow type, the values to try, the PostgreSQL column types it may
    be written to (explicit tables), and how to build an array of raw values."""

    arrow: pa.DataType
    values: st.SearchStrategy[Any]
    pg_types: tuple[str, ...]
    build: Callable[[list[Any], pa.DataType], pa.Array] = lambda v, t: pa.array(v, t)


def _raw(storage: pa.DataType) -> Callable[[list[Any], pa.DataType], pa.Array]:
    """Arrays of dates and timestamps from raw integers (any int64, none via Python)."""
    return lambda v, t: pa.array(v, storage).view(t)


INT_TYPES = (
    "smallint",
    "integer",
    "bigint",
    "numeric",
    "numeric(12,2)",
    "real",
    "double precision",
)


def int_kind(t: pa.DataType) -> Kind:
    info = (
        (0, 2**t.bit_width - 1)
        if pa.types.is_unsigned_integer(t)
        else (-(2 ** (t.bit_width - 1)), 2 ** (t.bit_width - 1) - 1)
    )
    return Kind(t, int_values(*info), INT_TYPES)


@st.composite
def decimal_kind(draw: st.DrawFn) -> Kind:
    maker, most = draw(
        st.sampled_from(
            [(pa.decimal128, 38), (pa.decimal128, 38), (pa.decimal256, 76), (pa.decimal64, 18)]
        )
    )
    p = draw(
        st.one_of(st.integers(1, most), st.sampled_from([most, 38, 39])).filter(lambda x: x <= most)
    )
    s = draw(st.one_of(st.integers(0, p), st.integers(-3, p)))  # pyarrow builds no s > p
    cp = draw(st.integers(1, 40))
    cs = draw(st.integers(0, cp))
    return Kind(
        maker(p, s),
        unscaled_values(p),
        ("numeric", f"numeric({cp},{cs})", "double precision"),
        # the unscaled integers, read at scale s (pyarrow converts some Decimals wrongly)
        lambda v, t: pa.array(v, maker(t.precision, 0)).view(t),
    )


@st.composite
def timestamp_kind(draw: st.DrawFn) -> Kind:
    unit = draw(st.sampled_from(["s", "ms", "us", "us", "ns"]))
    tz = draw(st.sampled_from([None, "UTC", "Europe/Paris", "+05:30"]))
    return Kind(
        pa.timestamp(unit, tz=tz),
        timestamp_values(unit),
        ("timestamp", "timestamptz"),
        _raw(pa.int64()),
    )


def pg_kinds() -> st.SearchStrategy[Kind]:
    """A source type of each family (picked first, so that none is starved)."""
    ints = [pa.int8(), pa.int16(), pa.int32(), pa.int64()]
    uints = [pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]
    floats = st.sampled_from(
        [
            Kind(pa.float64(), st.floats(), ("real", "double precision")),
            Kind(pa.float32(), st.floats(width=32), ("real", "double precision")),
            Kind(pa.float16(), st.floats(width=16), ("real", "double precision")),
        ]
    )
    texts = st.sampled_from(
        [
            Kind(pa.string(), TEXT_WITH_NUL, ("text", "character varying")),
            Kind(pa.large_string(), TEXT_WITH_NUL, ("text",)),
        ]
    )
    binaries = st.sampled_from(
        [Kind(t, st.binary(max_size=20), ("bytea",)) for t in (pa.binary(), pa.large_binary())]
    )
    dates = st.sampled_from(
        [
            Kind(pa.date32(), day_values(), ("date", "timestamp", "timestamptz"), _raw(pa.int32())),
            Kind(
                pa.date64(),
                st.integers(-3_000_000, 3_000_000).map(lambda d: d * 86_400_000),
                ("date", "timestamp", "timestamptz"),
                _raw(pa.int64()),
            ),
        ]
    )
    families = {
        "timestamp": timestamp_kind(),
        "decimal": decimal_kind(),
        "text": texts,
        "int": st.sampled_from([*ints, *uints]).map(int_kind),
        "float": floats,
        "date": dates,
        "binary": binaries,
        "bool": st.just(Kind(pa.bool_(), st.booleans(), ("boolean",))),
    }
    return st.sampled_from(sorted(families)).flatmap(lambda f: families[f])


# -- what PostgreSQL must hold ------------------------------------------------------------

ACCEPT, REFUSE, EITHER = "accept", "refuse", "either"


def _f32(v: float) -> float | None:
    """``v`` as a float4 holds it; None when a finite ``v`` is too large."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return None


def _to_us(kind: pa.DataType, v: int) -> int | None:
    """Microseconds since 1970 of a raw date or timestamp; None when not exact or
    beyond int64."""
    if pa.types.is_date32(kind):
        us = v * US_PER_DAY
    elif pa.types.is_date64(kind):
        us = v * 1_000
    elif kind.unit == "ns":
        if v % 1000:
            return None
        us = v // 1000
    else:
        us = v * UNIT_US[kind.unit]
    return us if I64[0] <= us <= I64[1] else None


def pg_expect(kind: pa.DataType, pg: str, v: Any) -> tuple[str, Any]:
    """(ACCEPT | REFUSE | EITHER, what reads back) for value ``v`` of Arrow type
    ``kind`` written to a column of PostgreSQL type ``pg`` (format_type)."""
    if v is None:
        return ACCEPT, None
    if pa.types.is_decimal(kind):
        v = decimal_of(kind, v)
    if pg in ("smallint", "integer", "bigint"):
        bits = {"smallint": 16, "integer": 32, "bigint": 64}[pg]
        return (ACCEPT if -(2 ** (bits - 1)) <= v < 2 ** (bits - 1) else REFUSE), v
    if pg.startswith("numeric"):
        d = Decimal(v)
        if pg == "numeric":
            return ACCEPT, d
        p, s = (int(x) for x in pg[8:-1].split(","))
        with decimal.localcontext(BIG):
            if d != d.quantize(Decimal(1).scaleb(-s)):
                return REFUSE, None  # PostgreSQL would round it to the column's scale
            return (ACCEPT if abs(d) < Decimal(10) ** (p - s) else REFUSE), d
    if pg in ("real", "double precision"):
        if pa.types.is_integer(kind):
            exact = 2**24 if pg == "real" else 2**53
            if abs(v) <= exact:
                return ACCEPT, float(v)
            fits = (_f32(float(v)) if pg == "real" else float(v)) == v
            return (EITHER if fits else REFUSE), float(v)
        if pa.types.is_decimal(kind):
            return ACCEPT, float(v)  # the nearest double (checked within an ulp)
        if pg == "real":
            f = _f32(v)
            return (REFUSE, None) if f is None else (ACCEPT, f)
        return ACCEPT, v
    if pg in ("text", "character varying"):
        return (REFUSE if "\0" in v else ACCEPT), v
    if pg == "bytea":
        return ACCEPT, v
    if pg == "boolean":
        return ACCEPT, v
    if pg == "date":
        days = v // 86_400_000 if pa.types.is_date64(kind) else v
        return (ACCEPT if PG_MIN_DAY <= days < PG_END_DAY else REFUSE), days
    if pg.startswith("timestamp"):
        us = _to_us(kind, v)
        return (REFUSE, None) if us is None or us < PG_MIN_US else (ACCEPT, us)
    raise AssertionError(f"no expectation for {kind} -> {pg}")


def _task(
    writer: SinkWriter,
    data: pa.Table,
    split: int,
    refusals: tuple[type[Exception], ...],
) -> tuple[Committable | None, Exception | None]:
    """What a Spark task does with ``data`` in two slices cut at ``split``: write
    every record batch, prepare, close. Returns the committable, or the refusal
    (one of ``refusals``) that stopped the task before it prepared."""
    error: Exception | None = None
    committable: Committable | None = None
    try:
        for part in (data.slice(0, split), data.slice(split)):
            for b in part.to_batches():
                writer.write(b)
        committable = writer.prepare()
    except refusals as e:
        error = e
    finally:
        writer.close(failed=error is not None)
    return committable, error


def _read_expr(col: str, pg: str) -> str:
    """SQL reading column ``col`` back in a form Python holds for every value
    (dates and timestamps as ISO text: Python's own types end at year 9999, and
    PostgreSQL's ``extract(epoch ...)`` rounds its largest timestamps)."""
    if pg.startswith(("timestamp", "date", "numeric")):
        return f'"{col}"::text'
    if pg == "real":  # exactly (as text, psycopg reads the shortest float4 digits as a float8)
        return f'"{col}"::float8'
    return f'"{col}"'


_ISO = re.compile(r"^(\d+)-(\d\d)-(\d\d)(?: (\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?(?:\+00)?)?( BC)?$")


def days_from_civil(y: int, m: int, d: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (any year; 0 is 1 BC)."""
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * ((m + 9) % 12) + 2) // 5 + d - 1
    return era * 146_097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719_468


def parse_iso(text: str) -> tuple[int, int]:
    """(days since 1970, microseconds into the day) of PostgreSQL's ISO output
    (DateStyle ISO, TimeZone UTC)."""
    m = _ISO.match(text)
    assert m is not None, text
    year = int(m[1]) if m[8] is None else 1 - int(m[1])
    days = days_from_civil(year, int(m[2]), int(m[3]))
    h, mi, sec = (int(x or 0) for x in (m[4], m[5], m[6]))
    frac = int((m[7] or "").ljust(6, "0"))
    return days, ((h * 60 + mi) * 60 + sec) * 1_000_000 + frac


def _same(pg: str, kind: pa.DataType, got: Any, want: Any) -> bool:
    if got is None or want is None:
        return got is None and want is None
    if pg.startswith("timestamp"):
        days, us = parse_iso(got)
        return days * US_PER_DAY + us == want
    if pg == "date":
        return parse_iso(got) == (want, 0)
    if pg.startswith("numeric"):
        return Decimal(got) == want
    if pg in ("real", "double precision"):
        if math.isnan(want):
            return math.isnan(got)
        if pa.types.is_decimal(kind) and math.isfinite(want):
            return math.isclose(got, want, rel_tol=2**-51, abs_tol=0.0)
        return got == want and math.copysign(1, got) == math.copysign(1, want)
    return bool(got == want)


# -- PostgreSQL --------------------------------------------------------------------------


@dataclass
class PgCase:
    columns: list[tuple[str, Kind, str | None]]  # name, kind, column type (None: create_table)
    rows: list[list[Any]]  # per column
    split: int  # rows of the first of two record batches

    def batch(self) -> pa.Table:
        arrays = [k.build(v, k.arrow) for (_, k, _), v in zip(self.columns, self.rows, strict=True)]
        ids = pa.array(range(len(self.rows[0])), pa.int64())
        return pa.table([ids, *arrays], names=["_i", *(n for n, _, _ in self.columns)])


@st.composite
def pg_cases(draw: st.DrawFn) -> PgCase:
    create = draw(st.booleans())
    columns = []
    for i in range(draw(st.integers(1, 3))):
        k = draw(pg_kinds())
        columns.append((f"c{i}", k, None if create else draw(st.sampled_from(k.pg_types))))
    n = draw(st.integers(1, 6))
    rows = [draw(st.lists(nullable(k.values), min_size=n, max_size=n)) for _, k, _ in columns]
    return PgCase(columns, rows, draw(st.integers(0, n)))


_tables = itertools.count()
JOB = f"fz{uuid.uuid4().hex[:8]}"


def _pg_types(dsn: str, table: str) -> dict[str, str]:
    with psycopg.connect(dsn) as c:
        rows = c.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
            (table,),
        ).fetchall()
    return dict(rows)


def _short_type(formatted: str) -> str:
    return {
        "timestamp without time zone": "timestamp",
        "timestamp with time zone": "timestamptz",
        "character varying": "character varying",
    }.get(formatted, formatted)


@fuzz_settings(150)
@given(case=pg_cases())
def test_postgres_binary_copy_reads_back_equal_or_refuses(pg_module_dsn: str, case: PgCase) -> None:
    dsn = pg_module_dsn
    n = next(_tables)
    table = f"fz{n}"
    data = case.batch()
    create = case.columns[0][2] is None
    if not create:
        cols = ", ".join(f'"{name}" {pg}' for name, _, pg in case.columns)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f"CREATE TABLE {table} (_i bigint, {cols})")
    sink = PostgresSink(dsn, table, create_table=create, sink_id="fz")
    wide = [
        c for c, k, _ in case.columns if pa.types.is_decimal(k.arrow) and k.arrow.precision > 38
    ]
    try:
        sink.preflight(data.schema)
    except PreflightError as e:
        event("refused at preflight")
        assert wide, f"refused at preflight: {e}"
        assert any(f"column {c!r}" in str(e) for c in wide) and "38 digits" in str(e), str(e)
        return
    assert not wide, "a decimal of more than 38 digits passed preflight"
    types = {k: _short_type(v) for k, v in _pg_types(dsn, table).items()}
    expect = {
        name: [pg_expect(k.arrow, types[name], v) for v in values]
        for (name, k, _), values in zip(case.columns, case.rows, strict=True)
    }
    if create:  # the sink's own columns hold every value of their Arrow type
        for name, k, _ in case.columns:
            if pa.types.is_timestamp(k.arrow):  # instants, or wall-clock times
                assert types[name] == ("timestamptz" if k.arrow.tz else "timestamp"), name
            t = k.arrow
            if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
                assert all(e[0] == ACCEPT for e in expect[name]), (name, types[name])
    must_refuse = {c for c, es in expect.items() if any(e[0] == REFUSE for e in es)}
    may_refuse = must_refuse | {c for c, es in expect.items() if any(e[0] == EITHER for e in es)}

    ctx = WriteContext(JobScope(JOB, "p", "fz"), 1, 0, 0, n)
    committable, error = _task(
        sink.open_writer(ctx, data.schema),
        data,
        case.split,
        (DataError, psycopg.errors.NumericValueOutOfRange),
    )
    if error is None:
        assert committable is not None
        sink.committer().commit([committable])

    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SET DateStyle = ISO; SET TimeZone = UTC")
        names = [name for name, _, _ in case.columns]
        exprs = ", ".join(_read_expr(name, types[name]) for name in names)
        got = c.execute(f"SELECT _i, {exprs} FROM {table} ORDER BY _i").fetchall()
        prepared = c.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE gid = %s", (str(ctx.txn_name()),)
        ).fetchall()
        c.execute(f"DROP TABLE {table}")
    assert prepared == []
    if error is not None:
        reasons = ("NUL", "range", "exactly", "real", "overflow")
        event(f"refused: {next((r for r in reasons if r in str(error)), type(error).__name__)}")
        assert may_refuse, f"refused values it must accept: {error}"
        assert got == [], "rows of a refused task are in the table"
        named = [col for col in may_refuse if f"column {col!r}" in str(error)]
        if isinstance(error, DataError):
            assert named, f"the error names no column it could refuse: {error}"
        else:  # PostgreSQL's own refusal of a numeric(p, s) overflow names the column
            assert any(f"column {col}" in str(error) for col in may_refuse), str(error)
        return
    event("written and read back")
    assert not must_refuse, f"accepted values it must refuse in {sorted(must_refuse)}"
    assert [r[0] for r in got] == list(range(data.num_rows))
    for j, name in enumerate(names):
        kind = next(k for c, k, _ in case.columns if c == name).arrow
        for row, (_, want) in zip(got, expect[name], strict=True):
            assert _same(types[name], kind, row[j + 1], want), (
                f"column {name} ({kind} -> {types[name]}), row {row[0]}: "
                f"wrote {want!r}, read {row[j + 1]!r}"
            )


# -- Delta -------------------------------------------------------------------------------

STRING_PREFIX = 32  # characters of a string bound the Delta statistics keep
PY_MIN_DAY, PY_MAX_DAY = -719_162, 2_932_896  # 0001-01-01 and 9999-12-31, days since 1970


@dataclass(frozen=True)
class DKind:
    """A source Arrow type for the Delta sink, its values and how to build them."""

    arrow: pa.DataType
    values: st.SearchStrategy[Any]
    build: Callable[[list[Any], pa.DataType], pa.Array] = lambda v, t: pa.array(v, t)
    partition: bool = False  # may partition the table


@st.composite
def delta_timestamp_kind(draw: st.DrawFn) -> DKind:
    unit = draw(st.sampled_from(["us", "us", "ms", "s", "ns"]))
    tz = draw(st.sampled_from(["UTC", "UTC", "Europe/Paris", None]))
    return DKind(pa.timestamp(unit, tz=tz), timestamp_values(unit), _raw(pa.int64()))


@st.composite
def delta_decimal_kind(draw: st.DrawFn) -> DKind:
    maker = draw(st.sampled_from([pa.decimal128, pa.decimal128, pa.decimal256]))
    p = draw(st.one_of(st.integers(1, 38), st.sampled_from([38, 39])))
    s = draw(st.one_of(st.integers(0, p), st.integers(-3, p)))
    if p > 38:
        maker = pa.decimal256
    return DKind(maker(p, s), unscaled_values(p), lambda v, t: pa.array(v, maker(p, 0)).view(t))


def delta_kinds() -> st.SearchStrategy[DKind]:
    texts = st.one_of(TEXT_WITH_NUL, st.text(st.sampled_from("ab\0"), max_size=3))
    families = {
        "int": st.sampled_from([pa.int8(), pa.int16(), pa.int32(), pa.int64()]).map(
            lambda t: DKind(
                t, int_values(-(2 ** (t.bit_width - 1)), 2 ** (t.bit_width - 1) - 1), partition=True
            )
        ),
        "float": st.sampled_from(
            [DKind(pa.float64(), st.floats()), DKind(pa.float32(), st.floats(width=32))]
        ),
        "text": st.sampled_from(
            [DKind(pa.string(), texts, partition=True), DKind(pa.large_string(), texts)]
        ),
        "binary": st.just(DKind(pa.binary(), st.binary(max_size=10))),
        "bool": st.just(DKind(pa.bool_(), st.booleans(), partition=True)),
        "date": st.just(DKind(pa.date32(), day_values(), _raw(pa.int32()), partition=True)),
        "timestamp": delta_timestamp_kind(),
        "decimal": delta_decimal_kind(),
        "nested": st.sampled_from(
            [
                DKind(
                    pa.struct([("a", pa.int64()), ("b", pa.string())]),
                    st.fixed_dictionaries({"a": nullable(st.integers(*I64)), "b": nullable(TEXT)}),
                ),
                DKind(pa.list_(pa.int32()), st.lists(nullable(st.integers(*I32)), max_size=3)),
                DKind(
                    pa.map_(pa.string(), pa.float64()),
                    st.dictionaries(TEXT, nullable(st.floats(allow_nan=False)), max_size=2).map(
                        lambda d: list(d.items())
                    ),
                ),
            ]
        ),
    }
    return st.sampled_from(sorted(families)).flatmap(lambda f: families[f])


@dataclass
class DeltaCase:
    columns: list[tuple[str, DKind]]
    rows: list[list[Any]]  # per column
    partition_by: list[str]
    split: int

    def table(self) -> pa.Table:
        arrays = [k.build(v, k.arrow) for (_, k), v in zip(self.columns, self.rows, strict=True)]
        ids = pa.array(range(len(self.rows[0])), pa.int64())
        return pa.table([ids, *arrays], names=["_i", *(n for n, _ in self.columns)])


@st.composite
def delta_cases(draw: st.DrawFn) -> DeltaCase:
    columns = [(f"c{i}", draw(delta_kinds())) for i in range(draw(st.integers(1, 3)))]
    n = draw(st.integers(1, 8))
    rows = [draw(st.lists(nullable(k.values), min_size=n, max_size=n)) for _, k in columns]
    candidates = [name for name, k in columns if k.partition]
    partition_by = draw(st.sampled_from([[], *([c] for c in candidates)]))
    return DeltaCase(columns, rows, partition_by, draw(st.integers(0, n)))


def _ms_text(ms: int, zone: str) -> str | None:
    """A millisecond instant as the statistics write it; None outside years 1..9999."""
    days, rest = divmod(ms, 86_400_000)
    if not PY_MIN_DAY <= days <= PY_MAX_DAY:
        return None
    d = dt.date(1970, 1, 1) + dt.timedelta(days=days)
    h, rest = divmod(rest, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms_ = divmod(rest, 1000)
    return f"{d.year:04d}-{d.month:02d}-{d.day:02d}T{h:02d}:{m:02d}:{s:02d}.{ms_:03d}{zone}"


def _day_text(days: int) -> str | None:
    if not PY_MIN_DAY <= days <= PY_MAX_DAY:
        return None
    return (dt.date(1970, 1, 1) + dt.timedelta(days=days)).isoformat()


class Unbounded(Exception):
    """No bound in the statistics states these values."""


def _string_upper(s: str) -> str:
    """The least string of at most 32 characters greater than every string that
    starts with ``s[:32]`` (``s`` itself when that short)."""
    if len(s) <= STRING_PREFIX:
        return s
    p = s[:STRING_PREFIX].rstrip("\U0010ffff")
    if not p:
        raise Unbounded
    nxt = ord(p[-1]) + 1
    return p[:-1] + chr(0xE000 if 0xD800 <= nxt <= 0xDFFF else nxt)


def delta_bounds(kind: pa.DataType, t: pa.DataType, values: list[Any]) -> tuple[Any, Any]:
    """The (min, max) the statistics must hold for a column of Arrow type ``t``
    (as the table stores it; ``kind`` as written) over ``values`` (raw,
    non-null): (None, None) for none; raise :class:`Unbounded` when no bound
    states them, and then the file has no bounds at all. The rule
    (sinks/delta/stats.py): a bound for every column or for none, each exact or
    (cut strings) on the safe side."""
    if not values or pa.types.is_binary(t):
        return None, None
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return min(values), max(values)
    if pa.types.is_decimal(t):
        exact = [decimal_of(kind, v) for v in values]
        return min(exact), max(exact)
    if pa.types.is_floating(t):
        if not all(math.isfinite(v) for v in values):
            raise Unbounded
        return min(values), max(values)
    if pa.types.is_string(t):
        return min(values)[:STRING_PREFIX], _string_upper(max(values))
    if pa.types.is_date32(t):
        lo, hi = _day_text(min(values)), _day_text(max(values))
    else:
        assert pa.types.is_timestamp(t), t
        us = [_to_us(kind, v) for v in values]
        lo, hi = (_ms_text(m, "Z" if t.tz else "") for m in (min(us) // 1000, -(-max(us) // 1000)))
    if lo is None or hi is None:
        raise Unbounded  # outside years 1 to 9999
    return lo, hi


def _same_bound(t: pa.DataType, got: Any, want: Any) -> bool:
    """A bound as read (floats as Decimal) against the expected one."""
    if pa.types.is_floating(t):
        return float(got) == want
    if pa.types.is_decimal(t):
        return isinstance(got, Decimal | int) and got == want
    return type(got) is type(want) and got == want


def _pv(t: pa.DataType, v: Any) -> str | None:
    """A partition value as Delta (and Spark) write it: empty strings are null."""
    if v is None or v == "":
        return None
    if pa.types.is_boolean(t):
        return "true" if v else "false"
    if pa.types.is_date32(t):
        return _day_text(v)
    return str(v)


def _delta_refusal(case: DeltaCase) -> set[str]:
    """Columns whose values the sink must refuse (nothing is committed then)."""
    bad = set()
    for (name, k), values in zip(case.columns, case.rows, strict=True):
        t = k.arrow
        for v in values:
            if v is None:
                continue
            if pa.types.is_timestamp(t) and _to_us(t, v) is None:
                bad.add(name)  # sub-microsecond, or beyond int64 microseconds
            if name in case.partition_by and pa.types.is_date32(t) and _day_text(v) is None:
                bad.add(name)  # a date partition value outside years 1 to 9999
    return bad


def _delta_preflight_refusal(case: DeltaCase) -> set[str]:
    return {
        name
        for name, k in case.columns
        if pa.types.is_decimal(k.arrow) and k.arrow.precision - min(k.arrow.scale, 0) > 38
    }


def _same_delta(t: pa.DataType, got: Any, want: Any) -> bool:
    if want is None or got is None:
        return want is None and got is None
    if pa.types.is_floating(t):
        if math.isnan(want):
            return math.isnan(got)
        return got == want and math.copysign(1, got) == math.copysign(1, want)
    return bool(got == want)


def _delta_read_back(case: DeltaCase, uri: str) -> None:
    t = DeltaTable(uri).to_pyarrow_table()
    t = t.sort_by("_i")
    assert t.column("_i").to_pylist() == list(range(len(case.rows[0])))
    for (name, k), values in zip(case.columns, case.rows, strict=True):
        col = t.column(name)
        kind = k.arrow
        if pa.types.is_timestamp(kind):
            got = col.cast(pa.int64()).to_pylist()
            want = [None if v is None else _to_us(kind, v) for v in values]
        elif pa.types.is_date32(kind):
            got = col.cast(pa.int32()).to_pylist()
            want = values
        elif pa.types.is_decimal(kind):
            got = col.to_pylist()
            want = [None if v is None else decimal_of(kind, v) for v in values]
        elif pa.types.is_struct(kind):
            got = col.to_pylist()
            want = values
        else:
            got = col.to_pylist()
            want = [None if name in case.partition_by and v == "" else v for v in values]
        for row, (g, w) in enumerate(zip(got, want, strict=True)):
            assert _same_delta(kind, g, w), (
                f"column {name} ({kind}) row {row}: wrote {w!r}, read {g!r}"
            )


def _lookup_value(t: pa.DataType, v: Any) -> Any:
    """``v`` as a deltalake filter takes it; None when this test does not look it up."""
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return v
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return v or None
    if pa.types.is_floating(t):
        return v if math.isfinite(v) and v != 0 else None
    if pa.types.is_date32(t) and PY_MIN_DAY <= v <= PY_MAX_DAY:
        return dt.date(1970, 1, 1) + dt.timedelta(days=v)
    if pa.types.is_timestamp(t) and t.tz is not None:
        us = _to_us(t, v)
        if us is not None and PY_MIN_DAY * US_PER_DAY <= us < (PY_MAX_DAY + 1) * US_PER_DAY:
            return dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(microseconds=us)
    return None


def _delta_lookups(case: DeltaCase, uri: str) -> None:
    """Find rows by value through deltalake, which skips files by the statistics
    (and partitions by their values): a wrong or missing bound loses the row.
    The least and the greatest value of each column are looked up."""
    table = DeltaTable(uri)
    for (name, k), values in zip(case.columns, case.rows, strict=True):
        keys = [w for v in values if v is not None and (w := _lookup_value(k.arrow, v)) is not None]
        for want in {min(keys), max(keys)} if keys else ():
            got = table.to_pyarrow_table(columns=["_i"], filters=[(name, "=", want)])
            assert got.num_rows == keys.count(want), (name, want, got.num_rows, keys)


@fuzz_settings(100)
@given(case=delta_cases())
def test_delta_statistics_hold_and_data_reads_back(
    tmp_path_factory: pytest.TempPathFactory, case: DeltaCase
) -> None:
    uri = str(tmp_path_factory.mktemp("delta") / "t")
    data = case.table()
    sink = DeltaSink(uri, partition_by=case.partition_by, sink_id="fz")
    wide = _delta_preflight_refusal(case)
    try:
        sink.preflight(data.schema)
    except PreflightError as e:
        event("refused at preflight")
        assert wide and any(f"column {c}" in str(e) for c in wide), str(e)
        return
    assert not wide, f"preflight passed decimals of more than 38 digits: {sorted(wide)}"
    bad = _delta_refusal(case)
    scope = JobScope(JOB, "p", "fz", "0123456789ab")
    committable, error = _task(
        sink.open_writer(WriteContext(scope, 1, 1, 0, 1), data.schema),
        data,
        case.split,
        (DataError, DeltaSchemaError),
    )
    if error is not None:
        event("refused")
        assert bad, f"refused values it must accept: {error}"
        assert any(f"column {c!r}" in str(error) for c in bad), str(error)
        assert DeltaTable(uri).version() == 0  # created, nothing committed
        files = [p for p in Path(uri).rglob("*") if p.is_file() and "_delta_log" not in p.parts]
        assert files == [], files
        return
    event("written and read back")
    assert not bad, f"accepted values it must refuse in {sorted(bad)}"
    assert committable is not None
    sink.committer().commit([committable])

    table_schema = pa.schema(DeltaTable(uri).schema().to_arrow())
    kinds = {name: k.arrow for name, k in case.columns}
    raw = {name: values for (name, _), values in zip(case.columns, case.rows, strict=True)}
    raw["_i"] = list(range(data.num_rows))
    part = case.partition_by[0] if case.partition_by else None
    seen = 0
    for add in committable["adds"]:
        rows = [
            r
            for r in range(data.num_rows)
            if part is None or _pv(kinds[part], raw[part][r]) == add["partition_values"][part]
        ]
        seen += len(rows)
        lo: dict[str, Any] = {}
        hi: dict[str, Any] = {}
        columns = [f for f in table_schema if f.name != part and not pa.types.is_nested(f.type)]
        values = {f.name: [raw[f.name][r] for r in rows] for f in columns}
        nulls = {name: sum(v is None for v in vs) for name, vs in values.items()}
        try:
            for f in columns:
                kind = kinds.get(f.name, pa.int64())
                a, b = delta_bounds(kind, f.type, [v for v in values[f.name] if v is not None])
                if a is not None:
                    lo[f.name], hi[f.name] = a, b
        except Unbounded:
            lo, hi = {}, {}
        stats = json.loads(add["stats"], parse_float=Decimal)
        where = (add["partition_values"], add["stats"], lo, hi)
        assert stats["numRecords"] == len(rows), where
        assert stats["nullCount"] == nulls, where
        assert set(stats) == {"numRecords", "nullCount"} | (
            {"minValues", "maxValues"} if lo else set()
        )
        for got, want in ((stats.get("minValues", {}), lo), (stats.get("maxValues", {}), hi)):
            assert set(got) == set(want), where
            for name, bound in want.items():
                assert _same_bound(table_schema.field(name).type, got[name], bound), where
        for name, bound in hi.items():  # a cut string's max is still above every value
            if pa.types.is_string(table_schema.field(name).type):
                assert all(v is None or v <= bound for v in (raw[name][r] for r in rows)), where
    assert seen == data.num_rows
    _delta_read_back(case, uri)
    _delta_lookups(case, uri)
