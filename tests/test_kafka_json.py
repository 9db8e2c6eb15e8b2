"""Arrow -> Kafka bytes (:mod:`sinks.kafka.encode`): keys, headers and JSON values.

Pure Arrow and Python: no broker, no Spark.
"""

from __future__ import annotations

import decimal

import pyarrow as pa
import pytest

from sinks.kafka.encode import to_bytes

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
