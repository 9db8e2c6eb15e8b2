"""sinks.kafka.records: Kafka v2 record batches from Arrow, checked against kafka-python.

Pure unit tests (no broker): every batch is decoded with kafka-python's
``MemoryRecords`` / ``DefaultRecordBatch`` (CRC, producer fields, records), and
uncompressed batches are compared byte for byte with kafka-python's own
``DefaultRecordBatchBuilder`` fed the same rows. The one field that differs is
``partitionLeaderEpoch``: -1 here (as the Java producer writes it), 0 in
kafka-python; it lies outside the CRC, so the comparison patches it.
"""

from __future__ import annotations

import struct
from typing import Any

import kafka.codec as codecs
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.partitioner.default import murmur2 as kafka_murmur2
from kafka.record import MemoryRecords
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from sinks.errors import ConfigError
from sinks.kafka.partitioner import murmur2, partition_indexes
from sinks.kafka.records import HEADER_SIZE, EncodedBatch, batches_by_partition, record_batches

PRODUCER = {
    "producer_id": 4242,
    "producer_epoch": 7,
    "transactional": True,
    "timestamp_ms": 1_700_000_000_123,
}
CODECS = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
HAS_CODEC = {
    "gzip": codecs.has_gzip(),
    "snappy": codecs.has_snappy(),
    "lz4": codecs.has_lz4(),
    "zstd": codecs.has_zstd(),
}

Headers = list[tuple[str, list[bytes | None]]]


def _arrays(
    keys: list[bytes | None] | None,
    values: list[bytes | None] | None,
    headers: Headers = (),  # type: ignore[assignment]
    type_: pa.DataType | None = None,
) -> tuple[pa.Array | None, pa.Array | None, list[tuple[str, pa.Array]]]:
    type_ = type_ or pa.binary()
    return (
        None if keys is None else pa.array(keys, type_),
        None if values is None else pa.array(values, type_),
        [(name, pa.array(vals, type_)) for name, vals in headers],
    )


def _row_headers(headers: Headers, i: int) -> list[tuple[str, bytes]]:
    return [(name, vals[i]) for name, vals in headers if vals[i] is not None]  # type: ignore[misc]


def _reference(
    keys: list[bytes | None] | None,
    values: list[bytes | None] | None,
    headers: Headers,
    *,
    n: int,
    base_sequence: int,
    max_batch_bytes: int,
    codec: int = 0,
    producer_id: int,
    producer_epoch: int,
    transactional: bool,
    timestamp_ms: int,
) -> list[tuple[bytes, int]]:
    """kafka-python's batches of the rows, as its producer fills them
    (``batch_size=max_batch_bytes``), with their record counts."""
    out: list[tuple[bytes, int]] = []
    sequence = base_sequence
    builder = None
    offset = 0
    for i in range(n):
        key = None if keys is None else keys[i]
        value = None if values is None else values[i]
        hdrs = _row_headers(headers, i)
        for _ in range(2):
            if builder is None:
                builder = DefaultRecordBatchBuilder(
                    2, codec, transactional, producer_id, producer_epoch, sequence, max_batch_bytes
                )
                offset = 0
            if builder.append(offset, timestamp_ms, key, value, hdrs) is not None:
                offset += 1
                break
            out.append((bytes(builder.build()), offset))
            sequence = (sequence + offset) % 2**31
            builder = None
        else:
            raise AssertionError("a record did not fit in an empty batch")
    if builder is not None:
        out.append((bytes(builder.build()), offset))
    return out


def _with_epoch(data: bytes, epoch: int) -> bytes:
    return data[:12] + struct.pack(">i", epoch) + data[16:]


def _decode(data: bytes) -> list[DefaultRecordBatch]:
    """The batches of ``data`` (one or more, back to back), CRCs checked."""
    records = MemoryRecords(data)
    batches = []
    while records.has_next():
        batch = records.next_batch()
        assert isinstance(batch, DefaultRecordBatch)
        assert batch.validate_crc()
        batches.append(batch)
    return batches


def _check(
    out: list[EncodedBatch],
    keys: list[bytes | None] | None,
    values: list[bytes | None] | None,
    headers: Headers,
    *,
    n: int,
    base_sequence: int,
    codec: int = 0,
    producer_id: int,
    producer_epoch: int,
    transactional: bool,
    timestamp_ms: int,
) -> None:
    """Decode every batch with kafka-python and compare it with the rows."""
    row = 0
    sequence = base_sequence
    for encoded in out:
        (batch,) = _decode(encoded.data)
        assert batch.size_in_bytes == len(encoded.data)
        assert batch.magic == 2
        assert batch.base_offset == 0
        assert batch.leader_epoch == -1
        assert batch.compression_type in (0, codec)
        assert batch.timestamp_type == 0
        assert batch.is_transactional is transactional
        assert not batch.is_control_batch
        assert batch.producer_id == producer_id
        assert batch.producer_epoch == producer_epoch
        assert batch.base_sequence == sequence == encoded.base_sequence
        assert batch.records_count == encoded.records
        assert batch.last_offset_delta == encoded.records - 1
        assert batch.first_timestamp == batch.max_timestamp == timestamp_ms
        got = list(batch)
        assert len(got) == encoded.records
        for delta, record in enumerate(got):
            assert record.offset == delta
            assert record.timestamp == timestamp_ms
            assert record.key == (None if keys is None else keys[row])
            assert record.value == (None if values is None else values[row])
            assert record.headers == _row_headers(headers, row)
            row += 1
        if sequence >= 0:
            sequence = (sequence + encoded.records) % 2**31
    assert row == n


ROWS: dict[str, Any] = {
    "plain": ([b"k1", b"key-2", b"k3"], [b"v1", b"value-2" * 30, b""], []),
    "nulls": (
        [None, b"", b"k", None],
        [b"v", None, b"", None],
        [("trace", [b"t1", None, b"", b"t4"]), ("caf\u00e9 \u2615", [None, b"x", None, b"yy"])],
    ),
    "no keys": (None, [b"a", b"bb", None], [("h", [b"1", b"2", b"3"])]),
    "no values": ([b"a", b"b"], None, []),
    "headers only": (None, None, [("only", [b"x", None, b""])]),
    "long fields": (
        [b"k" * 200, b"K" * 20_000],
        [b"v" * 70_000, b"w" * 130],
        [("n" * 150, [b"h" * 300, None])],
    ),
}


@pytest.mark.parametrize("transactional", [True, False])
@pytest.mark.parametrize("name", list(ROWS))
def test_same_bytes_as_kafka_python_builder(name: str, transactional: bool) -> None:
    keys, values, headers = ROWS[name]
    n = len(next(x for x in (keys, values, headers and headers[0][1]) if x is not None))
    params = {**PRODUCER, "transactional": transactional}
    out = record_batches(*_arrays(keys, values, headers), base_sequence=17, **params)
    ref = _reference(
        keys, values, headers, n=n, base_sequence=17, max_batch_bytes=1 << 20, **params
    )
    assert [(_with_epoch(b.data, 0), b.records) for b in out] == ref
    _check(out, keys, values, headers, n=n, base_sequence=17, **params)


@pytest.mark.parametrize("codec", list(CODECS))
def test_compressed_batches_decode(codec: str) -> None:
    if not HAS_CODEC[codec]:
        pytest.skip(f"no {codec} library (pip install 'twophase[compression]')")
    n = 3000
    keys = [None if i % 7 == 0 else b"key-%d" % (i % 50) for i in range(n)]
    values = [None if i % 11 == 0 else b'{"id": %d, "name": "customer"}' % i for i in range(n)]
    headers: Headers = [("h", [None if i % 3 else b"%d" % i for i in range(n)])]
    out = record_batches(
        *_arrays(keys, values, headers),
        base_sequence=0,
        compression=codec,
        max_batch_bytes=16384,
        **PRODUCER,
    )
    assert len(out) > 1
    for b in out:
        # Compressible rows: every batch is compressed, and the codec is the one asked for.
        (batch,) = _decode(b.data)
        assert batch.compression_type == CODECS[codec]
    _check(out, keys, values, headers, n=n, base_sequence=0, codec=CODECS[codec], **PRODUCER)
    ref = _reference(
        keys,
        values,
        headers,
        n=n,
        base_sequence=0,
        max_batch_bytes=16384,
        codec=CODECS[codec],
        **PRODUCER,
    )
    assert [b.records for b in out] == [count for _, count in ref]
    if codec != "gzip":  # gzip writes the time into its header
        assert [_with_epoch(b.data, 0) for b in out] == [data for data, _ in ref]


@pytest.mark.parametrize("codec", list(CODECS))
def test_incompressible_batch_is_sent_plain(codec: str) -> None:
    if not HAS_CODEC[codec]:
        pytest.skip(f"no {codec} library")
    rng = np.random.default_rng(1)
    values = [rng.bytes(40) for _ in range(3)]
    (b,) = record_batches(None, pa.array(values), base_sequence=0, compression=codec, **PRODUCER)
    (batch,) = _decode(b.data)
    assert batch.compression_type == 0  # as kafka-python does when nothing is saved
    assert [r.value for r in batch] == values


def test_unknown_or_missing_codec_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    values = pa.array([b"x"])
    with pytest.raises(ConfigError, match="compression must be"):
        record_batches(None, values, base_sequence=0, compression="brotli", **PRODUCER)
    monkeypatch.setattr(codecs, "zstd", None)
    with pytest.raises(ConfigError, match="twophase\\[compression\\]"):
        record_batches(None, values, base_sequence=0, compression="zstd", **PRODUCER)


# -- splitting ---------------------------------------------------------------


def test_split_by_max_batch_bytes() -> None:
    rng = np.random.default_rng(7)
    n = 2000
    sizes = rng.integers(0, 300, n)
    values = [b"v" * int(s) for s in sizes]
    values[100] = b"big" * 2000  # bigger than a batch: alone in its own
    values[101] = b"x" * 5000  # right after it, too big as well: alone too
    keys = [b"%d" % i for i in range(n)]
    limit = 4096
    out = record_batches(
        *_arrays(keys, values), base_sequence=1000, max_batch_bytes=limit, **PRODUCER
    )
    assert sum(b.records for b in out) == n
    starts = np.cumsum([0] + [b.records for b in out])
    for b, start in zip(out, starts, strict=False):
        if b.records > 1:
            assert len(b.data) <= limit
        else:
            assert len(b.data) > limit or start not in (100, 101)
        assert b.base_sequence == 1000 + start
    big = [int(s) for b, s in zip(out, starts, strict=False) if len(b.data) > limit]
    assert big == [100, 101]
    assert next(b for b, s in zip(out, starts, strict=False) if s == 100).records == 1
    # Exactly where kafka-python's producer would cut (greedy, same size rule).
    ref = _reference(keys, values, [], n=n, base_sequence=1000, max_batch_bytes=limit, **PRODUCER)
    assert [(_with_epoch(b.data, 0), b.records) for b in out] == ref
    _check(out, keys, values, [], n=n, base_sequence=1000, **PRODUCER)


def test_batch_fills_up_to_the_limit_exactly() -> None:
    values = [b"x" * 10] * 10
    (one,) = record_batches(None, pa.array(values), base_sequence=0, **PRODUCER)
    size = len(one.data)
    assert (
        len(
            record_batches(
                None, pa.array(values), base_sequence=0, max_batch_bytes=size, **PRODUCER
            )
        )
        == 1
    )
    two = record_batches(
        None, pa.array(values), base_sequence=0, max_batch_bytes=size - 1, **PRODUCER
    )
    assert [b.records for b in two] == [9, 1]


def test_offset_deltas_past_one_varint_byte() -> None:
    # Offset deltas 64+ take two varint bytes, 8192+ three: batch boundaries and
    # record lengths account for it.
    n = 20_000
    values = pa.array([b"v"] * n)
    out = record_batches(None, values, base_sequence=0, max_batch_bytes=100_000, **PRODUCER)
    ref = _reference(
        None, [b"v"] * n, [], n=n, base_sequence=0, max_batch_bytes=100_000, **PRODUCER
    )
    assert [(_with_epoch(b.data, 0), b.records) for b in out] == ref


def test_sequence_wraps_after_int32_max() -> None:
    values = pa.array([b"x" * 50] * 10)
    out = record_batches(None, values, base_sequence=2**31 - 3, max_batch_bytes=200, **PRODUCER)
    assert [b.records for b in out] == [2] * 5
    assert [b.base_sequence for b in out] == [2**31 - 3, 2**31 - 1, 1, 3, 5]
    for b in out:
        (batch,) = _decode(b.data)
        assert batch.base_sequence == b.base_sequence


def test_no_sequence_numbers() -> None:
    values = pa.array([b"x" * 50] * 10)
    out = record_batches(
        None,
        values,
        base_sequence=-1,
        max_batch_bytes=200,
        producer_id=-1,
        producer_epoch=-1,
        transactional=False,
        timestamp_ms=5,
    )
    assert len(out) == 5
    assert {b.base_sequence for b in out} == {-1}
    assert {_decode(b.data)[0].base_sequence for b in out} == {-1}


def test_empty_input() -> None:
    assert record_batches(pa.array([], pa.binary()), None, base_sequence=0, **PRODUCER) == []
    assert (
        record_batches(None, None, [("h", pa.array([], pa.binary()))], base_sequence=0, **PRODUCER)
        == []
    )
    assert (
        record_batches(
            pa.chunked_array([], pa.binary()),
            pa.array([], pa.large_binary()),
            base_sequence=0,
            **PRODUCER,
        )
        == []
    )


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="same length"):
        record_batches(pa.array([b"a"]), pa.array([b"a", b"b"]), base_sequence=0, **PRODUCER)
    with pytest.raises(ValueError, match="count the rows"):
        record_batches(None, None, base_sequence=0, **PRODUCER)
    with pytest.raises(TypeError, match="values must be a binary"):
        record_batches(None, pa.array([1, 2]), base_sequence=0, **PRODUCER)
    with pytest.raises(ValueError, match="max_batch_bytes"):
        record_batches(
            None, pa.array([b"a"]), base_sequence=0, max_batch_bytes=HEADER_SIZE, **PRODUCER
        )


# -- Arrow inputs --------------------------------------------------------------


def test_sliced_chunked_large_and_string_inputs() -> None:
    keys = [b"k%d" % i if i % 4 else None for i in range(50)]
    values = [b"value %d" % i if i % 5 else None for i in range(50)]
    hv = [b"h%d" % i if i % 3 else None for i in range(50)]
    lo, hi = 7, 41
    expected = record_batches(
        pa.array(keys[lo:hi]),
        pa.array(values[lo:hi]),
        [("h", pa.array(hv[lo:hi]))],
        base_sequence=3,
        **PRODUCER,
    )
    assert len(expected) == 1
    variants = {
        "sliced": lambda xs, t: pa.array(xs, t).slice(lo, hi - lo),
        "chunked": lambda xs, t: pa.chunked_array(
            [pa.array(xs[lo:20], t), pa.array(xs[20:hi], t).slice(0)]
        ),
        "sliced chunks": lambda xs, t: pa.chunked_array(
            [pa.array(xs, t).slice(lo, 3), pa.array(xs, t).slice(lo + 3, hi - lo - 3)]
        ),
    }
    for make in variants.values():
        for t in (pa.binary(), pa.large_binary()):
            got = record_batches(
                make(keys, t),
                make(values, t),
                [("h", make(hv, t))],
                base_sequence=3,
                **PRODUCER,
            )
            assert got == expected
    text = [None if v is None else v.decode() for v in values[lo:hi]]
    for t in (pa.string(), pa.large_string()):
        got = record_batches(
            pa.array(keys[lo:hi]),
            pa.array(text, t),
            [("h", pa.array(hv[lo:hi], pa.large_binary()))],
            base_sequence=3,
            **PRODUCER,
        )
        assert got == expected


def test_null_slots_with_bytes_behind_them() -> None:
    # Arrow lets a null slot span bytes of the data buffer (after some kernels):
    # they are neither written nor hashed.
    def with_hidden_bytes() -> pa.Array:
        offsets = np.array([0, 3, 6, 9], dtype=np.int32)
        validity = pa.array([True, False, True]).buffers()[1]
        return pa.Array.from_buffers(
            pa.binary(), 3, [validity, pa.py_buffer(offsets), pa.py_buffer(b"abcdefghi")]
        )

    arr = with_hidden_bytes()
    assert arr.to_pylist() == [b"abc", None, b"ghi"]
    out = record_batches(arr, arr, [("h", arr)], base_sequence=0, **PRODUCER)
    rows = [b"abc", None, b"ghi"]
    headers: Headers = [("h", rows)]
    _check(out, rows, rows, headers, n=3, base_sequence=0, **PRODUCER)
    assert murmur2(arr).view(np.uint32).tolist() == _kafka_hashes(rows)


def test_header_values_empty_versus_null_and_unicode_names() -> None:
    headers: Headers = [
        ("\u00fcber-\u65e5\u672c-\U0001f600", [b"", None, b"\x00\xff"]),
        ("", [None, b"", b"v"]),  # an empty name is still a name
        ("x", [None, None, None]),
    ]
    out = record_batches(
        None,
        pa.array([b"1", b"2", b"3"]),
        *[_arrays(None, None, headers)[2]],
        base_sequence=0,
        **PRODUCER,
    )
    (batch,) = _decode(out[0].data)
    assert [r.headers for r in batch] == [
        [("\u00fcber-\u65e5\u672c-\U0001f600", b"")],
        [("", b"")],
        [("\u00fcber-\u65e5\u672c-\U0001f600", b"\x00\xff"), ("", b"v")],
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(
            st.none() | st.binary(max_size=20),
            st.none() | st.binary(max_size=300),
            st.none() | st.binary(max_size=10),
            st.none() | st.binary(max_size=10),
        ),
        min_size=1,
        max_size=60,
    ),
    max_batch_bytes=st.integers(HEADER_SIZE + 1, 2000),
    base_sequence=st.integers(0, 2**31 - 1),
    large=st.booleans(),
    transactional=st.booleans(),
)
def test_random_rows_match_kafka_python(
    rows: list[tuple[bytes | None, ...]],
    max_batch_bytes: int,
    base_sequence: int,
    large: bool,
    transactional: bool,
) -> None:
    keys = [r[0] for r in rows]
    values = [r[1] for r in rows]
    headers: Headers = [("a", [r[2] for r in rows]), ("\u00df", [r[3] for r in rows])]
    params = {**PRODUCER, "transactional": transactional}
    t = pa.large_binary() if large else pa.binary()
    out = record_batches(
        *_arrays(keys, values, headers, t),
        base_sequence=base_sequence,
        max_batch_bytes=max_batch_bytes,
        **params,
    )
    ref = _reference(
        keys,
        values,
        headers,
        n=len(rows),
        base_sequence=base_sequence,
        max_batch_bytes=max_batch_bytes,
        **params,
    )
    assert [(_with_epoch(b.data, 0), b.records) for b in out] == ref
    _check(out, keys, values, headers, n=len(rows), base_sequence=base_sequence, **params)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 4),  # the partition index
            st.none() | st.binary(max_size=20),
            st.none() | st.binary(max_size=300),
            st.none() | st.binary(max_size=10),
        ),
        min_size=1,
        max_size=80,
    ),
    max_batch_bytes=st.integers(HEADER_SIZE + 1, 1500),
    near_wrap=st.booleans(),
    with_keys=st.booleans(),
)
def test_partitions_framed_together_match_kafka_python_per_partition(
    rows: list[tuple[Any, ...]], max_batch_bytes: int, near_wrap: bool, with_keys: bool
) -> None:
    """batches_by_partition frames every partition's rows in one pass: each
    partition gets exactly kafka-python's batches of its own rows, in row order,
    from its own sequence (some near the 2**31 wrap), none spanning two."""
    partitions = [3, 9, 0, 7, 5]
    indexes = np.array([r[0] for r in rows], dtype=np.int64)
    keys = [r[1] for r in rows] if with_keys else None
    values = [r[2] for r in rows]
    headers: Headers = [("h", [r[3] for r in rows])]
    start = {p: (2**31 - 5 if near_wrap else 0) + 11 * i for i, p in enumerate(partitions)}
    asked: list[int] = []

    def sequence(p: int) -> int:
        asked.append(p)
        return start[p] % 2**31

    out = batches_by_partition(
        indexes,
        partitions,
        *_arrays(keys, values, headers),
        sequence=sequence,
        max_batch_bytes=max_batch_bytes,
        **PRODUCER,
    )
    used = sorted(set(indexes.tolist()))
    assert list(out) == [partitions[i] for i in used] == asked
    for i in used:
        p = partitions[i]
        mine = [n for n, r in enumerate(rows) if r[0] == i]
        ref = _reference(
            None if keys is None else [keys[n] for n in mine],
            [values[n] for n in mine],
            [("h", [headers[0][1][n] for n in mine])],
            n=len(mine),
            base_sequence=start[p] % 2**31,
            max_batch_bytes=max_batch_bytes,
            **PRODUCER,
        )
        assert [(_with_epoch(b.data, 0), b.records) for b in out[p]] == ref


def test_partitions_framed_together_bad_arguments() -> None:
    values = pa.array([b"a", b"b"])
    with pytest.raises(ValueError, match="3 partition indexes for 2 rows"):
        batches_by_partition(
            np.array([0, 1, 1]), [0, 1], None, values, [], sequence=lambda p: 0, **PRODUCER
        )
    for bad in (2**31, -5):
        with pytest.raises(ValueError, match="partition 1: base sequence"):
            batches_by_partition(
                np.array([0, 1]),
                [0, 1],
                None,
                values,
                [],
                sequence=lambda p, bad=bad: bad if p == 1 else 0,
                **PRODUCER,
            )
    with pytest.raises(ConfigError, match="compression"):
        batches_by_partition(
            np.array([0, 1]),
            [0, 1],
            None,
            values,
            [],
            sequence=lambda p: 0,
            compression="brotli",
            **PRODUCER,
        )


# -- murmur2 and partitions ------------------------------------------------------


def _kafka_hashes(keys: list[bytes | None]) -> list[int]:
    return [0 if k is None else kafka_murmur2(k) for k in keys]


@settings(max_examples=100, deadline=None)
@given(
    keys=st.lists(st.none() | st.binary(max_size=40), max_size=80),
    long=st.lists(st.binary(min_size=100, max_size=3000), max_size=3),
    large=st.booleans(),
)
def test_murmur2_matches_kafka_python(
    keys: list[bytes | None], long: list[bytes], large: bool
) -> None:
    keys = keys + long
    arr = pa.array(keys, pa.large_binary() if large else pa.binary())
    got = murmur2(arr)
    assert got.dtype == np.int32
    assert got.view(np.uint32).tolist() == _kafka_hashes(keys)


def test_murmur2_shapes() -> None:
    rng = np.random.default_rng(3)
    same = [rng.bytes(12) for _ in range(100)]  # every row the same number of chunks
    assert murmur2(pa.array(same)).view(np.uint32).tolist() == _kafka_hashes(same)
    # A few keys much longer than the rest (finished one by one), among short ones.
    mixed = [rng.bytes(int(n)) for n in rng.integers(0, 30, 500)]
    mixed[10] = rng.bytes(100_000)
    mixed[400] = rng.bytes(5_001)
    mixed[401] = None
    assert murmur2(pa.array(mixed)).view(np.uint32).tolist() == _kafka_hashes(mixed)
    # Sliced and chunked; an empty array; only empty and null keys.
    arr = pa.array(mixed).slice(5, 300)
    assert murmur2(arr).view(np.uint32).tolist() == _kafka_hashes(mixed[5:305])
    chunked = pa.chunked_array([pa.array(mixed[:7]), pa.array(mixed[7:20])])
    assert murmur2(chunked).view(np.uint32).tolist() == _kafka_hashes(mixed[:20])
    assert murmur2(pa.array([], pa.binary())).tolist() == []
    assert murmur2(pa.array([b"", None, b""])).view(np.uint32).tolist() == _kafka_hashes(
        [b"", None, b""]
    )
    # Strings hash as their UTF-8 bytes.
    assert murmur2(pa.array(["caf\u00e9"])).view(np.uint32).tolist() == _kafka_hashes(
        ["caf\u00e9".encode()]
    )


@pytest.mark.parametrize("n", [1, 3, 12, 1000])
def test_partition_indexes(n: int) -> None:
    rng = np.random.default_rng(n)
    keys = [None if i % 9 == 0 else rng.bytes(int(rng.integers(0, 30))) for i in range(500)]
    rr = n - 1
    got = partition_indexes(pa.array(keys), n, rr)
    expected = [rr if k is None else (kafka_murmur2(k) & 0x7FFFFFFF) % n for k in keys]
    assert got.tolist() == expected
    assert partition_indexes(None, n, rr, rows=4).tolist() == [rr] * 4
    with pytest.raises(ValueError, match="rows="):
        partition_indexes(None, n, rr)
    with pytest.raises(ValueError, match="round_robin"):
        partition_indexes(pa.array(keys), n, n)
