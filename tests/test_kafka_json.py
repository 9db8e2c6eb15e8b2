"""Arrow -> Kafka bytes (:mod:`sinks.kafka.encode`): keys, headers and JSON values.

Pure Arrow and Python: no broker, no Spark.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sinks.base import JobScope, WriteContext
from sinks.errors import PreflightError
from sinks.kafka import KafkaSink
from sinks.kafka.encode import JSONEncodeError, check_json_schema, json_rows, to_bytes

# -- keys and headers ------------------------------------------------------------------------


@pytest.mark.parametrize("t", [pa.int16(), pa.int32(), pa.int64(), pa.uint16(), pa.uint64()])
def test_integer_key_is_its_decimal_text(t: pa.DataType) -> None:
    """The report of a long key "seen as b'411'": 411 is written as the three bytes
    ``411`` (0x34 0x31 0x31), which Python displays as ``b'411'``; not as the six
    characters ``b'411'`` and not as an 8-byte big-endian long."""
    out = to_bytes(pa.array([411, None], t))
    assert out == [b"411", None]
    assert list(out[0] or b"") == [0x34, 0x31, 0x31]
    assert repr(out[0]) == "b'411'"  # the display that was reported
    assert (out[0] or b"").decode() == "411"
    # the same bytes, hence the same partition, as the string key "411"
    assert to_bytes(pa.array(["411"])) == out[:1]


def test_key_from_dictionary_chunked_and_sliced_columns() -> None:
    ids = pa.array([7, 411, 411, None], pa.int64())
    assert to_bytes(ids.slice(1, 2)) == [b"411", b"411"]
    assert to_bytes(ids.dictionary_encode()) == [b"7", b"411", b"411", None]
    assert to_bytes(pa.chunked_array([ids[:2], ids[2:]])) == [b"7", b"411", b"411", None]


def test_text_decimal_boolean_binary_keys() -> None:
    assert to_bytes(pa.array(["é", "a\x00b"])) == ["é".encode(), b"a\x00b"]
    assert to_bytes(pa.array([b"\x00\xff"])) == [b"\x00\xff"]
    assert to_bytes(pa.array([True, False])) == [b"true", b"false"]
    dec = pa.array([decimal.Decimal("411.00"), decimal.Decimal("-0.05")], pa.decimal128(10, 2))
    assert to_bytes(dec) == [b"411.00", b"-0.05"]


def test_float_keys_use_the_json_words_for_non_finite_values() -> None:
    floats = pa.array([1.5, 1e20, float("nan"), float("inf"), float("-inf"), None])
    assert to_bytes(floats) == [b"1.5", b"1e+20", b"NaN", b"Infinity", b"-Infinity", None]


# -- JSON values: one rule per type, the same at every depth ---------------------------------


def one(batch: pa.RecordBatch) -> bytes:
    rows = json_rows(batch)
    assert len(rows) == 1
    return rows[0]


def test_zoned_timestamps_are_utc_with_z_whatever_the_zone() -> None:
    """A Spark ``TimestampType`` arrives in the session time zone (here +01:00 and
    Europe/Paris); it is written as the instant in UTC, six fraction digits, ``Z``."""
    utc = datetime.datetime(2024, 1, 1, 12, 0, tzinfo=datetime.timezone.utc)
    for zone in ("+01:00", "Europe/Paris", "UTC", "America/New_York"):
        t = pa.timestamp("us", zone)
        batch = pa.record_batch(
            {
                "t": pa.array([utc], t),
                "nested": pa.array([{"at": [utc]}], pa.struct([("at", pa.list_(t))])),
            }
        )
        assert one(batch) == (
            b'{"t":"2024-01-01T12:00:00.000000Z","nested":{"at":["2024-01-01T12:00:00.000000Z"]}}'
        )
    seconds = pa.array([0], pa.timestamp("s", "+05:30"))
    assert one(pa.record_batch({"t": seconds})) == b'{"t":"1970-01-01T00:00:00.000000Z"}'


def test_naive_timestamps_have_no_zone_suffix() -> None:
    """Spark's ``TimestampNTZType``: a wall-clock time, written without ``Z``."""
    wall = datetime.datetime(2024, 1, 1, 13, 0, 0, 5)
    batch = pa.record_batch({"t": pa.array([wall]), "l": pa.array([[wall]])})
    assert one(batch) == (b'{"t":"2024-01-01T13:00:00.000005","l":["2024-01-01T13:00:00.000005"]}')


def test_dates_times_durations() -> None:
    batch = pa.record_batch(
        {
            "d": pa.array([datetime.date(1, 1, 1)]),
            "d64": pa.array([datetime.date(9999, 12, 31)], pa.date64()),
            "t": pa.array([datetime.time(13, 1, 2)], pa.time32("s")),
            "tn": pa.array([datetime.time(0, 0, 0, 7)], pa.time64("ns")),
            "du": pa.array([datetime.timedelta(days=1, microseconds=1)], pa.duration("us")),
            "neg": pa.array([datetime.timedelta(seconds=-1, microseconds=500_000)]),
            "ds": pa.array([[-90]], pa.list_(pa.duration("s"))),
        }
    )
    assert one(batch) == (
        b'{"d":"0001-01-01","d64":"9999-12-31","t":"13:01:02.000000","tn":"00:00:00.000007",'
        b'"du":"PT86400.000001S","neg":"-PT0.500000S","ds":["-PT90.000000S"]}'
    )


def test_maps_are_objects() -> None:
    batch = pa.record_batch(
        {
            "m": pa.array([[("a", 1), ("b", None)]], pa.map_(pa.string(), pa.int64())),
            "ints": pa.array([[(411, "x"), (-2, "y")]], pa.map_(pa.int64(), pa.string())),
            "flags": pa.array([[(True, 1.5)]], pa.map_(pa.bool_(), pa.float64())),
            "dec": pa.array(
                [[(decimal.Decimal("1.50"), [1])]],
                pa.map_(pa.decimal128(5, 2), pa.list_(pa.int8())),
            ),
            "day": pa.array(
                [[(datetime.date(2024, 1, 2), {})]], pa.map_(pa.date32(), pa.struct([]))
            ),
            "nan": pa.array([[(float("nan"), 0), (-0.5, 1)]], pa.map_(pa.float64(), pa.int8())),
            "bin": pa.array([[(b"\x00", 0)]], pa.map_(pa.binary(), pa.int8())),
            "quote": pa.array([[('a"\x00', 0)]], pa.map_(pa.string(), pa.int8())),
            "empty": pa.array([[]], pa.map_(pa.string(), pa.int8())),
        }
    )
    assert one(batch) == (
        b'{"m":{"a":1,"b":null},"ints":{"411":"x","-2":"y"},"flags":{"true":1.5},'
        b'"dec":{"1.50":[1]},"day":{"2024-01-02":{}},"nan":{"NaN":0,"-0.5":1},'
        b'"bin":{"AA==":0},"quote":{"a\\"\\u0000":0},"empty":{}}'
    )


def test_struct_map_keys_are_their_json_text() -> None:
    t = pa.map_(pa.struct([("a", pa.int32()), ("b", pa.string())]), pa.int8())
    batch = pa.record_batch({"m": pa.array([[({"a": 1, "b": "x"}, 0)]], t)})
    assert one(batch) == b'{"m":{"{\\"a\\":1,\\"b\\":\\"x\\"}":0}}'
    assert json.loads(one(batch)) == {"m": {'{"a":1,"b":"x"}': 0}}


def test_decimals_are_exact_strings_at_every_depth() -> None:
    d = decimal.Decimal
    t = pa.decimal128(38, 2)
    big = d("9" * 36 + ".99")  # the widest decimal128
    wide = d("-" + "9" * 74 + ".12")  # decimal256, wider than 38 digits
    batch = pa.record_batch(
        {
            "top": pa.array([d("1.50")], pa.decimal128(5, 2)),
            "big": pa.array([big], t),
            "wide": pa.array([wide], pa.decimal256(76, 2)),
            "list": pa.array([[d("1.50"), None]], pa.list_(pa.decimal128(5, 2))),
            "struct": pa.array([{"x": d("-0.05")}], pa.struct([("x", pa.decimal128(3, 2))])),
            "map": pa.array([[("k", d("411"))]], pa.map_(pa.string(), pa.decimal128(3, 0))),
        }
    )
    out = one(batch)
    assert out == (
        b'{"top":"1.50","big":"'
        + str(big).encode()
        + b'","wide":"'
        + str(wide).encode()
        + b'","list":["1.50",null],"struct":{"x":"-0.05"},"map":{"k":"411"}}'
    )
    assert d(json.loads(out)["wide"]) == wide


def test_non_finite_floats_are_strings_never_null() -> None:
    nan, inf = float("nan"), float("inf")
    batch = pa.record_batch(
        {
            "f": pa.array([nan]),
            "f32": pa.array([-inf], pa.float32()),
            "l": pa.array([[inf, -inf, nan, None, 1.5]]),
            "s": pa.array([{"x": nan}], pa.struct([("x", pa.float64())])),
            "m": pa.array([[("k", inf)]], pa.map_(pa.string(), pa.float64())),
        }
    )
    assert one(batch) == (
        b'{"f":"NaN","f32":"-Infinity","l":["Infinity","-Infinity","NaN",null,1.5],'
        b'"s":{"x":"NaN"},"m":{"k":"Infinity"}}'
    )


def test_finite_floats_are_shortest_numbers() -> None:
    batch = pa.record_batch(
        {
            "f": pa.array([[1.0, 0.1, 1e20, 1.5e-7, 5e-324, -0.0]]),
            "f32": pa.array([0.1], pa.float32()),  # the shortest text of the float32
            "f16": pa.array([[1.5]], pa.list_(pa.float16())),
        }
    )
    assert one(batch) == b'{"f":[1,0.1,1e+20,1.5e-7,5e-324,-0],"f32":0.1,"f16":[1.5]}'


def test_text_is_utf8_with_control_characters_escaped() -> None:
    batch = pa.record_batch(
        {
            "s": pa.array(['a\x00b"\\é\n\x1f\x7f\u2028😀']),
            "plain": pa.array(["é😀"], pa.large_string()),
            "l": pa.array([["\x00", 'x"']]),
            "é\x00": pa.array([1]),
        }
    )
    out = one(batch)
    assert (
        out
        == (
            '{"s":"a\\u0000b\\"\\\\é\\n\\u001f\x7f\u2028😀","plain":"é😀","l":["\\u0000","x\\""],'
            '"é\\u0000":1}'
        ).encode()
    )
    assert json.loads(out)["s"] == 'a\x00b"\\é\n\x1f\x7f\u2028😀'


def test_binary_is_base64_at_every_depth() -> None:
    batch = pa.record_batch(
        {
            "b": pa.array([b"\x00\xff"]),
            "fixed": pa.array([b"ab"], pa.binary(2)),
            "large": pa.array([[b"", b"\xfb\xff"]], pa.list_(pa.large_binary())),
            "s": pa.array([{"x": b"\x00"}], pa.struct([("x", pa.binary())])),
        }
    )
    assert one(batch) == b'{"b":"AP8=","fixed":"YWI=","large":["","+/8="],"s":{"x":"AA=="}}'


def test_nulls_integers_booleans_dictionaries_empty() -> None:
    batch = pa.record_batch(
        {
            "n": pa.nulls(2),
            "i": pa.array([-(2**63), None]),
            "u": pa.array([2**64 - 1, 0], pa.uint64()),
            "b": pa.array([True, False]),
            "dict": pa.array(["x", None]).dictionary_encode(),
            "ld": pa.array([["y"], []], pa.list_(pa.dictionary(pa.int8(), pa.string()))),
            "e": pa.array([{}, None], pa.struct([])),
            "sl": pa.array([None, {"x": None}], pa.struct([("x", pa.list_(pa.int8()))])),
        }
    )
    assert json_rows(batch) == [
        b'{"n":null,"i":-9223372036854775808,"u":18446744073709551615,"b":true,"dict":"x",'
        b'"ld":["y"],"e":{},"sl":null}',
        b'{"n":null,"i":null,"u":0,"b":false,"dict":null,"ld":[],"e":null,"sl":{"x":null}}',
    ]
    assert json_rows(pa.record_batch({"a": pa.array([], pa.int8())})) == []
    assert json_rows(pa.RecordBatch.from_pydict({})) == []


def test_sliced_batches_and_nulls_backed_by_values() -> None:
    """Slices and null lists, maps and structs whose children still hold values."""
    lists = pa.ListArray.from_arrays(
        pa.array([0, 2, 3, 4], pa.int32()),
        pa.array([1, 2, 3, 4]),
        mask=pa.array([False, True, False]),
    )
    maps = pa.MapArray.from_arrays(
        pa.array([0, 1, 2, 3], pa.int32()),
        pa.array(["a", "b", "c"]),
        pa.array([1, 2, 3]),
        mask=pa.array([False, True, False]),
    )
    batch = pa.record_batch({"l": lists, "m": maps})
    assert json_rows(batch) == [
        b'{"l":[1,2],"m":{"a":1}}',
        b'{"l":null,"m":null}',
        b'{"l":[4],"m":{"c":3}}',
    ]
    assert json_rows(batch.slice(1)) == json_rows(batch)[1:]
    assert json_rows(batch.slice(2, 1)) == json_rows(batch)[2:]


def test_values_behind_nulls_are_ignored() -> None:
    """Arrow leaves the value slot of a null undefined: out-of-range garbage there
    is neither written nor refused."""
    validity = pa.array([True, False]).buffers()[1]
    for t, garbage in [
        (pa.timestamp("us", "UTC"), 2**62),
        (pa.timestamp("s"), 2**62),
        (pa.duration("s"), 2**62),
        (pa.time64("ns"), -5),
        (pa.date64(), 5),
    ]:
        data = pa.array([0, garbage], pa.int64()).buffers()[1]
        column = pa.Array.from_buffers(t, 2, [validity, data], null_count=1)
        nested = pa.ListArray.from_arrays(pa.array([0, 2], pa.int32()), column)
        assert json_rows(pa.record_batch({"c": column}))[1] == b'{"c":null}'
        assert json.loads(json_rows(pa.record_batch({"l": nested}))[0])["l"][1] is None


# -- refusals: clear errors, before anything is sent --------------------------------------------

Y10000_US = 253_402_300_800_000_000  # 10000-01-01T00:00:00Z in microseconds since 1970
Y1_US = -62_135_596_800_000_000  # 0001-01-01T00:00:00Z


@pytest.mark.parametrize(
    ("column", "message"),
    [
        (pa.array([Y10000_US], pa.timestamp("us", "UTC")), "outside 0001-01-01"),
        (pa.array([Y10000_US - 1, Y1_US - 1], pa.timestamp("us")), "outside 0001-01-01"),
        # 9999-12-31T23:00 at -05:00 is 10000-01-01T04:00Z: out of range in UTC
        (pa.array([Y10000_US + 4 * 3600 * 10**6], pa.timestamp("us", "-05:00")), "in UTC"),
        (pa.array([-(2**62)], pa.timestamp("s")), "outside 0001-01-01"),
        (pa.array([[1_500]], pa.list_(pa.timestamp("ns", "UTC"))), "fraction of a microsecond"),
        (pa.array([1], pa.time64("ns")), "fraction of a microsecond"),
        (pa.array([86_400], pa.time32("s")), "before 24:00:00"),
        (pa.array([1], pa.duration("ns")), "fraction of a microsecond"),
        (pa.array([2**62], pa.duration("s")), "out of range"),
        (pa.array([2_932_897], pa.date32()), "outside 0001-01-01 to 9999-12-31"),
        (pa.array([1], pa.date64()), "not at midnight"),
        (pa.array([[(1, 0), (1, 1)]], pa.map_(pa.int64(), pa.int8())), "key '1' more than once"),
        (
            pa.array([[(float("nan"), 0), (float("nan"), 1)]], pa.map_(pa.float64(), pa.int8())),
            "key 'NaN' more than once",
        ),
    ],
)
def test_values_that_cannot_be_written_are_refused(column: pa.Array, message: str) -> None:
    batch = pa.record_batch({"ok": pa.array([1] * len(column)), "c": column})
    with pytest.raises(JSONEncodeError, match=re.escape(message)) as e:
        json_rows(batch)
    assert "'c" in str(e.value)  # names the column


def test_whole_microseconds_in_nanosecond_units_are_written() -> None:
    batch = pa.record_batch(
        {
            "t": pa.array([1_000], pa.timestamp("ns", "Asia/Kathmandu")),
            "tm": pa.array([2_000], pa.time64("ns")),
            "du": pa.array([-3_000], pa.duration("ns")),
        }
    )
    assert one(batch) == (
        b'{"t":"1970-01-01T00:00:00.000001Z","tm":"00:00:00.000002","du":"-PT0.000003S"}'
    )


UNSUPPORTED = [
    (pa.month_day_nano_interval(), "c"),
    (pa.dense_union([pa.field("a", pa.int8())]), "c"),
    (pa.list_(pa.month_day_nano_interval()), "c[]"),
    (pa.struct([("s", pa.map_(pa.string(), pa.month_day_nano_interval()))]), "c.s{value}"),
    (pa.struct([("x", pa.int8()), ("x", pa.int16())]), "c"),
    (pa.run_end_encoded(pa.int32(), pa.int8()), "c"),
    *([(pa.uuid(), "c")] if hasattr(pa, "uuid") else []),  # an extension type
]


@pytest.mark.parametrize(("t", "path"), UNSUPPORTED)
def test_types_that_cannot_be_written_fail_preflight(t: pa.DataType, path: str) -> None:
    schema = pa.schema([("id", pa.int64()), ("v", pa.string()), ("c", t)])
    with pytest.raises(PreflightError, match=re.escape(repr(path))):
        check_json_schema(schema)
    sink = KafkaSink("127.0.0.1:1", "t", sink_id="k")  # the schema check comes first
    with pytest.raises(PreflightError, match=re.escape(repr(path))):
        sink.preflight(schema)
    KafkaSink("127.0.0.1:1", "t", sink_id="k", value="v")._check_schema(schema)  # not JSON


def test_duplicate_column_names_fail_preflight() -> None:
    schema = pa.schema([("id", pa.int64()), ("id", pa.string())])
    with pytest.raises(PreflightError, match="two columns are named 'id'"):
        check_json_schema(schema)
    with pytest.raises(PreflightError, match="two columns are named 'id'"):
        KafkaSink("127.0.0.1:1", "t", sink_id="k").preflight(schema)
    batch = pa.RecordBatch.from_arrays([pa.array([1]), pa.array(["x"])], schema=schema)
    with pytest.raises(JSONEncodeError, match="two columns are named 'id'"):
        json_rows(batch)


def test_writer_refuses_before_opening_a_producer() -> None:
    """The writer encodes a batch before it opens a producer or sends anything: a
    refused value fails the task with nothing in a transaction (here no broker
    listens, so opening one would fail differently)."""
    sink = KafkaSink("127.0.0.1:1", "t", sink_id="k", key="id")
    ctx = WriteContext(JobScope("j", "p", "k", "a1b2c3d4e5f6"), 1, 0, 0, 100)
    batch = pa.record_batch(
        {"id": pa.array([1, 2]), "at": pa.array([0, Y10000_US], pa.timestamp("us", "UTC"))}
    )
    writer = sink.open_writer(ctx, batch.schema)
    with pytest.raises(JSONEncodeError, match=r"rows 0 to 1 of this task.*'at', row 1"):
        writer.write(batch)
    assert writer._producer is None  # type: ignore[attr-defined]
    writer.close(failed=True)


# -- fuzz: random schemas and values read back equal (hypothesis) -------------------------------

FUZZ = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI stays stable
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
UTC = datetime.timezone.utc
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=UTC)
US = datetime.timedelta(microseconds=1)
Check = Callable[[Any, Any], None]
"""check(parsed JSON value, the Python value that was written)"""


@dataclass(eq=False, repr=False)
class Kind:
    """An Arrow type, a strategy for its non-null Python values and the inverse of
    the encoding's rule for it, written independently of the encoder."""

    type: pa.DataType
    values: st.SearchStrategy[Any]
    check: Check
    key_check: Check | None = None
    """for map keys: check(the JSON object name, the key); None: not used as a key"""

    def __repr__(self) -> str:  # short, for hypothesis' failure reports
        return f"Kind({self.type})"


def nullable(kind: Kind) -> st.SearchStrategy[Any]:
    return st.none() | kind.values


def check_value(kind: Kind, parsed: Any, value: Any) -> None:
    if value is None:
        assert parsed is None
    else:
        kind.check(parsed, value)


def _int_kind(t: pa.DataType) -> Kind:
    lo, hi = (-(2 ** (t.bit_width - 1)), 2 ** (t.bit_width - 1) - 1)
    if pa.types.is_unsigned_integer(t):
        lo, hi = 0, 2**t.bit_width - 1

    def check(parsed: Any, v: int) -> None:
        assert type(parsed) is int and parsed == v

    def key_check(text: str, v: int) -> None:
        assert text == str(v)

    return Kind(t, st.integers(lo, hi) | st.sampled_from([lo, hi, 0]), check, key_check)


def _float_words(v: float) -> str | None:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Infinity" if v > 0 else "-Infinity"
    return None


def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _float_kind(t: pa.DataType) -> Kind:
    width = t.bit_width

    def same(read: float, v: float) -> bool:
        if width == 32:  # the shortest text of a float32 reads back to that float32
            read = _f32(read)
        return read == v

    def check(parsed: Any, v: float) -> None:
        words = _float_words(v)
        if words is not None:
            assert parsed == words
        else:
            assert type(parsed) in (int, float) and same(float(parsed), v), (parsed, v)

    def key_check(text: str, v: float) -> None:
        words = _float_words(v)
        assert text == words if words is not None else same(float(text), v)

    edges = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1.7976931348623157e308]
    if width == 32:  # the float32 values nearest to these
        edges = [_f32(x) for x in (math.nan, math.inf, -math.inf, -0.0, 1e-45, 3.4e38, 0.1)]
    return Kind(t, st.floats(width=width) | st.sampled_from(edges), check, key_check)


def _decimal_kind(t: pa.DataType) -> Kind:
    p, s = t.precision, t.scale
    top = 10**p - 1
    unscaled = st.integers(-top, top) | st.sampled_from([top, -top, 0, 1, -1])
    values = unscaled.map(lambda u: decimal.Decimal(f"{u}E{-s}"))
    shape = re.compile(r"-?\d+" + (rf"\.\d{{{s}}}" if s > 0 else ""))  # plain notation

    def check(parsed: Any, v: decimal.Decimal) -> None:
        assert isinstance(parsed, str) and shape.fullmatch(parsed), parsed
        assert decimal.Decimal(parsed) == v

    return Kind(t, values, check, check)


def _text_kind(t: pa.DataType) -> Kind:
    awkward = st.text(alphabet='\x00\x01\x1f\x7f"\\/\n\té\u2028😀a ', max_size=8)
    values = st.text(max_size=12) | awkward

    def check(parsed: Any, v: str) -> None:
        assert parsed == v

    return Kind(t, values, check, check)


def _binary_kind(t: pa.DataType) -> Kind:
    size = t.byte_width if pa.types.is_fixed_size_binary(t) else None
    values = st.binary(min_size=size or 0, max_size=size or 12)

    def check(parsed: Any, v: bytes) -> None:
        assert isinstance(parsed, str) and base64.b64decode(parsed, validate=True) == v

    return Kind(t, values, check, check)


def _bool_check(parsed: Any, v: bool) -> None:
    assert parsed is v


def _bool_key(text: str, v: bool) -> None:
    assert text == ("true" if v else "false")


def _date_check(parsed: Any, v: datetime.date) -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", parsed) and datetime.date.fromisoformat(parsed) == v


def _time_check(parsed: Any, v: datetime.time) -> None:
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{6}", parsed), parsed
    assert datetime.time.fromisoformat(parsed) == v


def _naive_check(parsed: Any, v: datetime.datetime) -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}", parsed), parsed
    assert datetime.datetime.fromisoformat(parsed) == v


def _utc_check(parsed: Any, v: datetime.datetime) -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", parsed), parsed
    assert datetime.datetime.fromisoformat(parsed[:-1]).replace(tzinfo=UTC) == v  # instants


def _duration_check(parsed: Any, v: datetime.timedelta) -> None:
    m = re.fullmatch(r"(-?)PT(\d+\.\d{6})S", parsed)
    assert m, parsed
    seconds = decimal.Decimal(m[2]) * (-1 if m[1] else 1)
    assert seconds * 1_000_000 == v // US


OFFSETS = [datetime.timezone(datetime.timedelta(minutes=m)) for m in (60, -330, 845, -720)]
ZONES = ["UTC", "+01:00", "-05:00", "Europe/Paris", "America/St_Johns", "Asia/Kathmandu"]
EDGES = st.sampled_from([datetime.datetime.min, datetime.datetime.max])
NAIVE = st.datetimes() | EDGES
AWARE = (EDGES | st.datetimes()).map(lambda d: d.replace(tzinfo=UTC)) | st.datetimes(
    min_value=datetime.datetime(2, 1, 1),
    max_value=datetime.datetime(9998, 12, 31),
    timezones=st.sampled_from(OFFSETS),
)
DAYS = st.dates() | st.sampled_from([datetime.date.min, datetime.date.max])
NS_RANGE = {"min_value": datetime.datetime(1678, 1, 1), "max_value": datetime.datetime(2261, 1, 1)}


def _leaves() -> list[Kind]:
    ints = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint32(), pa.uint64()]
    decimals = [
        pa.decimal128(1, 0),
        pa.decimal128(5, 2),
        pa.decimal128(18, 6),
        pa.decimal128(38, 0),
        pa.decimal128(38, 10),
        pa.decimal128(38, 38),
        pa.decimal128(5, -2),  # not from Spark
        pa.decimal256(39, 0),
        pa.decimal256(50, 20),
        pa.decimal256(76, 0),
        pa.decimal256(76, 76),
    ]
    texts = [pa.string(), pa.large_string(), pa.string_view()]
    binaries = [pa.binary(), pa.large_binary(), pa.binary(3), pa.binary_view()]
    return [
        *(_int_kind(t) for t in ints),
        _float_kind(pa.float32()),
        _float_kind(pa.float64()),
        *(_decimal_kind(t) for t in decimals),
        *(_text_kind(t) for t in texts),
        *(_binary_kind(t) for t in binaries),
        Kind(pa.bool_(), st.booleans(), _bool_check, _bool_key),
        Kind(pa.date32(), DAYS, _date_check, _date_check),
        Kind(pa.time64("us"), st.times(), _time_check, _time_check),
        Kind(pa.timestamp("us"), NAIVE, _naive_check, _naive_check),
        Kind(pa.timestamp("ns"), st.datetimes(**NS_RANGE), _naive_check, _naive_check),
        *(Kind(pa.timestamp("us", z), AWARE, _utc_check, _utc_check) for z in ZONES),
        Kind(
            pa.timestamp("ns", "+01:00"),
            st.datetimes(**NS_RANGE, timezones=st.just(UTC)),
            _utc_check,
            _utc_check,
        ),
        Kind(
            pa.duration("us"),
            st.timedeltas(-datetime.timedelta(days=10**8), datetime.timedelta(days=10**8)),
            _duration_check,
            _duration_check,
        ),
    ]


LEAVES = _leaves()
NULLS = Kind(pa.null(), st.nothing(), lambda parsed, v: None)
DICTIONARY = Kind(
    pa.dictionary(pa.int32(), pa.string()),
    st.sampled_from(["a", "é\x00", ""]),
    lambda parsed, v: _text_kind(pa.string()).check(parsed, v),
)


def _list_kind(item: Kind, which: str) -> Kind:
    field = pa.field("item", item.type)
    if which == "fixed":
        t: pa.DataType = pa.list_(field, 2)
        values = st.lists(nullable(item), min_size=2, max_size=2)
    else:
        make = {"list": pa.list_, "large": pa.large_list, "view": pa.list_view}[which]
        t, values = make(field), st.lists(nullable(item), max_size=4)

    def check(parsed: Any, v: list[Any]) -> None:
        assert isinstance(parsed, list) and len(parsed) == len(v)
        for p, x in zip(parsed, v, strict=True):
            check_value(item, p, x)

    return Kind(t, values, check)


def _struct_kind(fields: list[tuple[str, Kind]]) -> Kind:
    t = pa.struct([(name, k.type) for name, k in fields])
    values = st.fixed_dictionaries({name: nullable(k) for name, k in fields})

    def check(parsed: Any, v: dict[str, Any]) -> None:
        assert isinstance(parsed, dict) and list(parsed) == [name for name, _ in fields]
        for name, k in fields:
            check_value(k, parsed[name], v[name])

    return Kind(t, values, check)


def _key_id(v: Any) -> Any:
    """Keys with the same JSON text (NaN and NaN; 0.0 and -0.0 are kept apart by the
    encoding but treated as one here)."""
    return "NaN" if isinstance(v, float) and math.isnan(v) else v


def _map_kind(key: Kind, item: Kind) -> Kind:
    assert key.key_check is not None
    key_check = key.key_check
    t = pa.map_(key.type, item.type)
    entries = st.lists(
        st.tuples(key.values, nullable(item)), max_size=4, unique_by=lambda e: _key_id(e[0])
    )

    def check(parsed: Any, v: list[tuple[Any, Any]]) -> None:
        assert isinstance(parsed, dict) and len(parsed) == len(v)
        for (name, p), (k, x) in zip(parsed.items(), v, strict=True):
            key_check(name, k)
            check_value(item, p, x)

    return Kind(t, entries, check)


NAMES = st.text(max_size=4) | st.sampled_from(["id", "é", 'a"b', "\x00", ""])
KEYS = st.sampled_from([k for k in LEAVES if k.key_check is not None])


def _nested(children: st.SearchStrategy[Kind]) -> st.SearchStrategy[Kind]:
    lists = st.builds(_list_kind, children, st.sampled_from(["list", "large", "fixed", "view"]))
    structs = st.lists(st.tuples(NAMES, children), max_size=3, unique_by=lambda f: f[0]).map(
        _struct_kind
    )
    maps = st.builds(_map_kind, KEYS, children)
    return lists | structs | maps


KINDS = st.recursive(st.sampled_from([*LEAVES, NULLS, DICTIONARY]), _nested, max_leaves=5)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[tuple[str, Kind]], list[list[Any]], int]:
    kinds = st.sampled_from(LEAVES) | KINDS  # leaves at the top level too
    columns = draw(
        st.lists(st.tuples(NAMES, kinds), min_size=1, max_size=5, unique_by=lambda c: c[0])
    )
    n = draw(st.integers(1, 6))
    values = [draw(st.lists(nullable(k), min_size=n, max_size=n)) for _, k in columns]
    offset = draw(st.integers(0, n - 1))  # a sliced batch: its arrays have offsets
    return columns, values, offset


@FUZZ
@given(batches())
def test_fuzz_what_is_written_reads_back_equal(
    drawn: tuple[list[tuple[str, Kind]], list[list[Any]], int],
) -> None:
    columns, values, offset = drawn
    arrays = [pa.array(v, k.type) for (_, k), v in zip(columns, values, strict=True)]
    batch = pa.RecordBatch.from_arrays(arrays, names=[name for name, _ in columns])
    rows = json_rows(batch.slice(offset))
    assert len(rows) == batch.num_rows - offset
    for i, row in enumerate(rows, start=offset):
        parsed = json.loads(row.decode("utf-8"))  # strict UTF-8, strict JSON
        assert list(parsed) == [name for name, _ in columns]
        for (name, kind), column in zip(columns, values, strict=True):
            check_value(kind, parsed[name], column[i])


PER_S = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
FIRST_S, END_S = -62_135_596_800, 253_402_300_800  # 0001-01-01 and 10000-01-01, UTC
DAY = datetime.timedelta(days=1)
FUZZ_EDGES = settings(FUZZ, max_examples=60)


def _raw(edges: list[int], bits: int = 64) -> st.SearchStrategy[list[int]]:
    """Lists of raw values: anywhere, and at or next to the edges of the range."""
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    edges = [e for e in edges if lo <= e <= hi] + [lo, hi]
    near = st.sampled_from(edges).flatmap(lambda e: st.integers(e - 2, e + 2))
    value = st.integers(lo, hi) | st.sampled_from(edges) | near.filter(lambda v: lo <= v <= hi)
    return st.lists(value, min_size=1, max_size=4)


def _micros_since_epoch(text: str) -> int:
    return (datetime.datetime.fromisoformat(text) - datetime.datetime(1970, 1, 1)) // US


def _timestamp_edges(unit: str) -> list[int]:
    per_s = PER_S[unit]
    return [e * per_s for e in (FIRST_S, END_S, 0)]


@pytest.mark.parametrize("unit", list(PER_S))
def test_fuzz_timestamps_outside_the_range_are_refused(unit: str) -> None:
    """Raw timestamps in every unit, zoned or not, top level or nested: those from
    0001-01-01 to 9999-12-31 (in UTC if zoned) in whole microseconds are written,
    and read back as the same instant; any other makes the batch fail."""
    per_s = PER_S[unit]

    @FUZZ_EDGES
    @given(
        tz=st.sampled_from([None, "UTC", "+01:00", "America/St_Johns"]),
        raw=_raw(_timestamp_edges(unit)),
        nested=st.booleans(),
    )
    def run(tz: str | None, raw: list[int], nested: bool) -> None:
        t = pa.timestamp(unit, tz)
        column = pa.array([raw], pa.list_(t)) if nested else pa.array(raw, t)
        batch = pa.record_batch({"c": column})
        fits = all(
            FIRST_S * per_s <= r < END_S * per_s and (unit != "ns" or r % 1000 == 0) for r in raw
        )
        if not fits:
            with pytest.raises(JSONEncodeError, match="'c"):
                json_rows(batch)
            return
        parsed = [json.loads(row)["c"] for row in json_rows(batch)]
        texts = parsed[0] if nested else parsed
        for text, r in zip(texts, raw, strict=True):
            if tz is not None:
                assert text.endswith("Z")
                text = text[:-1]
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}", text)
            assert _micros_since_epoch(text) * per_s == r * 1_000_000

    run()


def _edges(t: pa.DataType) -> list[int]:
    if pa.types.is_date(t):
        return [FIRST_S // 86_400, END_S // 86_400, 0]
    per_s = PER_S[t.unit]
    if pa.types.is_time(t):
        return [0, 86_400 * per_s]
    return [0, (2**63 - 1) * per_s // 1_000_000, -(2**63) * per_s // 1_000_000]


def _duration_text_is(text: str, micros: int) -> None:
    m = re.fullmatch(r"(-?)PT(\d+)\.(\d{6})S", text)
    assert m, text
    assert (-1 if m[1] else 1) * (int(m[2]) * 1_000_000 + int(m[3])) == micros


@pytest.mark.parametrize(
    "t",
    [pa.time32("s"), pa.time32("ms"), pa.time64("us"), pa.time64("ns")]
    + [pa.duration(u) for u in PER_S]
    + [pa.date32()],
    ids=str,
)
def test_fuzz_dates_times_durations_outside_the_range_are_refused(t: pa.DataType) -> None:
    """Raw dates, times of day and durations in every unit: those in range and in
    whole microseconds are written and read back equal; any other fails the batch."""

    @FUZZ_EDGES
    @given(raw=_raw(_edges(t), t.bit_width))
    def run(raw: list[int]) -> None:
        if pa.types.is_date(t):
            fits = all(FIRST_S // 86_400 <= r < END_S // 86_400 for r in raw)
        else:
            per_s = PER_S[t.unit]
            whole = all(r * 1_000_000 % per_s == 0 for r in raw)
            if pa.types.is_time(t):
                fits = whole and all(0 <= r < 86_400 * per_s for r in raw)
            else:
                fits = whole and all(-(2**63) <= r * 1_000_000 // per_s < 2**63 for r in raw)
        batch = pa.record_batch({"c": pa.array(raw, t)})
        if not fits:
            with pytest.raises(JSONEncodeError, match="'c'"):
                json_rows(batch)
            return
        for row, r in zip(json_rows(batch), raw, strict=True):
            text = json.loads(row)["c"]
            if pa.types.is_date(t):
                assert datetime.date.fromisoformat(text) == datetime.date(1970, 1, 1) + r * DAY
            elif pa.types.is_time(t):
                assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{6}", text)
                clock = datetime.datetime.combine(
                    datetime.date.min, datetime.time.fromisoformat(text)
                )
                assert (clock - datetime.datetime.min) // US * per_s == r * 1_000_000
            else:
                _duration_text_is(text, r * 1_000_000 // per_s)

    run()
