"""Kafka v2 record batches (magic 2, KIP-98) encoded column-wise from Arrow.

Longer than 450 lines because the batch and record layout below, the pass that
sizes every record and splits the rows into batches, and the pass that frames
them must agree byte for byte, so they are read together.

The encoding half of a producer: given the keys, values and headers of the rows
bound for one partition, build the exact bytes of the record batches a Produce
request carries. Nothing here talks to a broker.

Batch layout (big-endian, 61 bytes of header)::

    baseOffset int64 (0)           batchLength int32 (bytes after this field)
    partitionLeaderEpoch int32 (-1) magic int8 (2)
    crc uint32: CRC-32C of everything from attributes to the end
    attributes int16: bits 0-2 codec (0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd),
        bit 3 timestamp type (0, create time), bit 4 transactional, bit 5 control (0)
    lastOffsetDelta int32  baseTimestamp int64  maxTimestamp int64
    producerId int64  producerEpoch int16  baseSequence int32  recordCount int32
    records (compressed as one block when a codec is set)

and each record::

    length varint, attributes int8 (0), timestampDelta varlong (0),
    offsetDelta varint (0..n-1), keyLength varint (-1: null), key,
    valueLength varint (-1: null, a tombstone), value,
    headerCount varint, headers [keyLength varint, key, valueLength varint, value]

Varints are zigzag-encoded (protobuf's sint32).

Everything is done per column, never per record in Python: the record framing
(length prefix, fixed fields, length varints, header names) is computed as a
2-D byte matrix per group of adjacent fields, compacted with its validity mask
into an Arrow binary array (:mod:`sinks.kafka.varints`), and joined with the
keys, values and header values row by row by ``binary_join_element_wise``,
whose data buffer is then exactly the records section of consecutive batches.
Python loops only per batch (header, CRC, compression) and per header column.
Partitioning is :mod:`sinks.kafka.partitioner`.

Where this differs from kafka-python's ``DefaultRecordBatchBuilder`` (which the
tests compare against byte for byte): ``partitionLeaderEpoch`` is -1, as the
Java producer writes it (kafka-python writes 0; the field is outside the CRC
and brokers overwrite it). Like kafka-python, a batch whose compressed records
are not smaller than the plain ones is sent uncompressed (codec bits 0).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import kafka.codec as codecs
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sinks import _binaries as _b
from sinks.errors import ConfigError, DataError
from sinks.kafka.varints import RowFrame, Varints, varint_bytes, varint_size, varints, zigzag

__all__ = ["EncodedBatch", "batches_by_partition", "record_batches"]

# baseOffset .. recordCount, as kafka-python's DefaultRecordBase.HEADER_STRUCT.
_HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = _HEADER.size  # 61
_CRC_OFFSET = 17  # after baseOffset, batchLength, partitionLeaderEpoch, magic
_ATTRIBUTES_OFFSET = 21  # the CRC covers everything from here on
_AFTER_LENGTH_OFFSET = 12  # batchLength counts the bytes after itself

_TRANSACTIONAL = 0x10
_CODECS = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
# As DefaultRecordBatchBuilder._maybe_compress calls them (but gzip at level 6,
# snappy in xerial framing, lz4 frames without linked blocks).
_ENCODERS: dict[str, tuple[Callable[[], bool], Callable[[bytes], bytes]]] = {
    # level 6, zlib's default and the Java producer's (kafka-python uses 9: 5x slower)
    "gzip": (codecs.has_gzip, lambda b: codecs.gzip_encode(b, compresslevel=6)),
    "snappy": (codecs.has_snappy, lambda b: codecs.snappy_encode(b)),
    "lz4": (codecs.has_lz4, lambda b: codecs.lz4_encode(b)),
    "zstd": (codecs.has_zstd, lambda b: codecs.zstd_encode(b)),
}

_INT32_MAX = 2**31 - 1
# Records of several batches are framed together, up to about this many bytes.
_GROUP_BYTES = 64 << 20


@dataclass(frozen=True)
class EncodedBatch:
    """One record batch as it goes on the wire.

    ``data`` is the whole batch (header and records, compressed or not),
    ``records`` its record count and ``base_sequence`` the sequence number of
    its first record (-1 when the producer sends without sequence numbers).
    """

    data: bytes
    records: int
    base_sequence: int


# -- record batches ----------------------------------------------------------


def record_batches(
    keys: pa.Array | pa.ChunkedArray | None,
    values: pa.Array | pa.ChunkedArray | None,
    headers: Sequence[tuple[str, pa.Array | pa.ChunkedArray]] = (),
    *,
    producer_id: int,
    producer_epoch: int,
    base_sequence: int,
    transactional: bool,
    timestamp_ms: int,
    compression: str | None = None,
    max_batch_bytes: int = 1 << 20,
) -> list[EncodedBatch]:
    """The record batches (magic 2) of the given rows, in row order.

    ``keys`` and ``values`` are binary or large_binary arrays (string types are
    taken as their UTF-8 bytes) of the same length; a null key or value is
    written with length -1 (a null value is a tombstone), and ``None`` stands
    for all null. ``headers`` are (name, values) pairs in the order they are
    written; a null value leaves that header out of that row's record (an
    empty value is written as an empty value).

    Every record gets timestamp ``timestamp_ms`` (create time, delta 0),
    attributes 0 and its offset delta in its batch. Batches are filled greedily
    in row order, as kafka-python's ``DefaultRecordBatchBuilder`` does with
    ``batch_size=max_batch_bytes``: a batch's size before compression (61 header
    bytes and its records) stays at most ``max_batch_bytes``, except that a
    record too big for that gets a batch of its own. The first batch starts at
    sequence ``base_sequence``, the next ones after the records before them,
    wrapping after 2**31-1 to 0 as Kafka does; ``base_sequence=-1`` (no
    sequence numbers, a producer without idempotence) stays -1 in every batch.

    ``compression`` is None or one of "gzip", "snappy", "lz4", "zstd", done with
    kafka-python's ``kafka.codec`` exactly as its own builder does it (a batch
    that does not get smaller is sent uncompressed). Returns ``[]`` for no rows.
    """
    _check_options(compression, max_batch_bytes)
    _check_sequence(base_sequence, "base_sequence")
    n = _row_count(keys, values, headers)
    (out,) = _encode(
        keys,
        values,
        headers,
        np.array([0, n], dtype=np.int64),
        [base_sequence],
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        transactional=transactional,
        timestamp_ms=timestamp_ms,
        compression=compression,
        max_batch_bytes=max_batch_bytes,
    )
    return out


def _check_options(compression: str | None, max_batch_bytes: int) -> None:
    if compression is not None:
        if compression not in _ENCODERS:
            raise ConfigError(
                f"compression must be None, 'gzip', 'snappy', 'lz4' or 'zstd', not {compression!r}"
            )
        if not _ENCODERS[compression][0]():
            raise ConfigError(
                f"{compression} compression needs its library: "
                "pip install 'twophase[compression]' (lz4, zstandard, python-snappy)"
            )
    if max_batch_bytes <= HEADER_SIZE:
        raise ValueError(f"max_batch_bytes must be more than {HEADER_SIZE}")


def _check_sequence(sequence: int, what: str) -> None:
    if sequence < -1 or sequence > _INT32_MAX:
        raise ValueError(f"{what} must be -1 or in [0, 2**31-1], not {sequence}")


def _row_count(
    keys: pa.Array | pa.ChunkedArray | None,
    values: pa.Array | pa.ChunkedArray | None,
    headers: Sequence[tuple[str, pa.Array | pa.ChunkedArray]],
) -> int:
    columns = [a for a in (keys, values) if a is not None] + [a for _, a in headers]
    if not columns:
        raise ValueError("record_batches needs keys, values or headers to count the rows")
    n = len(columns[0])
    if any(len(a) != n for a in columns):
        raise ValueError(
            "keys, values and headers must have the same length, not "
            + ", ".join(str(len(a)) for a in columns)
        )
    return n


def _encode(
    keys: pa.Array | pa.ChunkedArray | None,
    values: pa.Array | pa.ChunkedArray | None,
    headers: Sequence[tuple[str, pa.Array | pa.ChunkedArray]],
    segments: np.ndarray,
    base_sequences: Sequence[int],
    *,
    producer_id: int,
    producer_epoch: int,
    transactional: bool,
    timestamp_ms: int,
    compression: str | None,
    max_batch_bytes: int,
) -> list[list[EncodedBatch]]:
    """The record batches of consecutive row ranges (``segments``: boundaries
    ``[0, ..., n]``), each range its own batches starting at its own sequence:
    one framing pass over all rows (several partitions' records at once), no
    batch across a boundary. The caller checked the options (``_check_options``)."""
    keys = None if keys is None else _b.binary(keys, "keys")
    values = None if values is None else _b.binary(values, "values")
    named = [(name, _b.binary(arr, f"header {name!r}")) for name, arr in headers]
    n = int(segments[-1])
    out: list[list[EncodedBatch]] = [[] for _ in base_sequences]
    if n == 0:
        return out
    # Sizes of every record's fields but its length prefix and offset delta.
    key_len = np.full(n, -1, dtype=np.int64) if keys is None else _b.lengths(keys)
    value_len = np.full(n, -1, dtype=np.int64) if values is None else _b.lengths(values)
    key_varint, value_varint = varints(key_len), varints(value_len)
    # + attributes and timestampDelta (one byte each)
    body = 2 + _field_size(key_varint, key_len) + _field_size(value_varint, value_len)
    header_count = np.zeros(n, dtype=np.int64)
    header_fields = []
    for name, arr in named:
        name_bytes = name.encode("utf-8")
        h_len = _b.lengths(arr)
        present = h_len >= 0
        prefix = varint_bytes(len(name_bytes)) + name_bytes
        h_varint = varints(h_len)
        header_fields.append((prefix, h_varint, present, arr))
        header_count += present
        body += present * (len(prefix) + _field_size(h_varint, h_len))
    count_varint = varints(header_count)
    body += count_varint.size

    limit = max_batch_bytes - HEADER_SIZE
    batches = np.concatenate(
        [[0]]
        + [
            _split(body[lo:hi], limit)[1:] + lo
            for lo, hi in zip(segments[:-1].tolist(), segments[1:].tolist(), strict=True)
            if hi > lo
        ]
    ).astype(np.int64)
    # the segment of every batch, by its first row
    segment_of = np.searchsorted(segments, batches[:-1], side="right") - 1
    counts = np.diff(batches)
    offset_delta = varints(np.arange(n, dtype=np.int64) - np.repeat(batches[:-1], counts))
    record_len = varints(body + offset_delta.size)
    ends = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(body, out=ends[1:])
    ends[1:] += np.cumsum(offset_delta.size + record_len.size)
    batch_bytes = ends[batches[1:]] - ends[batches[:-1]]
    if int(batch_bytes.max()) > _INT32_MAX - HEADER_SIZE:
        row = int(batches[int(np.argmax(batch_bytes))])
        raise DataError(f"row {row} is too big for a Kafka record (over 2 GiB)")

    attributes = _TRANSACTIONAL if transactional else 0
    codec = 0 if compression is None else _CODECS[compression]
    encoder = None if compression is None else _ENCODERS[compression][1]
    sequences = list(base_sequences)
    group_start = 0
    nb = len(counts)
    while group_start < nb:
        # Batches group_start..group_end-1 are framed together.
        group_end = group_start + 1
        first_byte = ends[batches[group_start]]
        while group_end < nb and ends[batches[group_end + 1]] - first_byte <= _GROUP_BYTES:
            group_end += 1
        lo, hi = int(batches[group_start]), int(batches[group_end])
        section_ends = ends[batches[group_start : group_end + 1]] - first_byte
        data = _frame(
            lo,
            hi,
            keys,
            values,
            key_varint,
            value_varint,
            offset_delta,
            record_len,
            count_varint,
            header_fields,
        )
        if len(data) != section_ends[-1]:
            raise AssertionError("record framing does not add up")  # pragma: no cover
        view = memoryview(data)
        for b in range(group_start, group_end):
            records = int(counts[b])
            seg = int(segment_of[b])
            sequence = sequences[seg]
            section = view[section_ends[b - group_start] : section_ends[b - group_start + 1]]
            out[seg].append(
                _batch(
                    section,
                    records,
                    attributes,
                    producer_id,
                    producer_epoch,
                    sequence,
                    timestamp_ms,
                    codec,
                    encoder,
                )
            )
            if sequence >= 0:
                sequences[seg] = (sequence + records) % (_INT32_MAX + 1)
        group_start = group_end
    return out


def batches_by_partition(
    indexes: np.ndarray,
    partitions: Sequence[int],
    keys: pa.Array | None,
    values: pa.Array,
    headers: Sequence[tuple[str, pa.Array]],
    *,
    sequence: Callable[[int], int],
    **batch: Any,
) -> dict[int, list[EncodedBatch]]:
    """The record batches of rows bound for several partitions: row ``i`` goes to
    ``partitions[indexes[i]]`` (see :mod:`sinks.kafka.partitioner`). Rows are
    grouped by partition with one stable sort, keeping their order within each,
    and framed in one pass; each partition's batches start at
    ``sequence(partition)``. ``batch`` holds the other arguments of
    :func:`record_batches`. The same bytes as :func:`record_batches` called per
    partition on that partition's rows."""
    n = _row_count(keys, values, headers)
    if len(indexes) != n:
        raise ValueError(f"{len(indexes)} partition indexes for {n} rows")
    counts = np.bincount(indexes, minlength=len(partitions))
    used = np.flatnonzero(counts)
    if len(used) > 1:
        order = pa.array(np.argsort(indexes, kind="stable"))
        keys = keys.take(order) if keys is not None else None
        values = values.take(order)
        headers = [(name, col.take(order)) for name, col in headers]
    compression = batch.pop("compression", None)
    max_batch_bytes = batch.pop("max_batch_bytes", 1 << 20)
    _check_options(compression, max_batch_bytes)
    if not len(used):
        return {}
    segments = np.zeros(len(used) + 1, dtype=np.int64)
    np.cumsum(counts[used], out=segments[1:])
    targets = [partitions[int(i)] for i in used]
    sequences = [sequence(p) for p in targets]
    for p, seq in zip(targets, sequences, strict=True):
        _check_sequence(seq, f"partition {p}: base sequence")
    encoded = _encode(
        keys,
        values,
        headers,
        segments,
        sequences,
        compression=compression,
        max_batch_bytes=max_batch_bytes,
        **batch,
    )
    return dict(zip(targets, encoded, strict=True))


def _field_size(length_varint: Varints, lengths: np.ndarray) -> np.ndarray:
    """Bytes of a nullable bytes field: its length varint and its bytes."""
    return length_varint.size + np.maximum(lengths, 0)


def _split(body: np.ndarray, limit: int) -> np.ndarray:
    """Row boundaries of the batches ([0, ..., n]): greedily as many records as fit
    in ``limit`` bytes of records, at least one per batch. A record's size is
    ``body`` plus its offset delta's varint plus its length varint."""
    n = len(body)
    bounds = [0]
    start = 0
    # a first window about one batch long: most calls then need one pass
    window = max(256, int(limit / max(1.0, float(body.mean()) + 2)) + 16) if n else 256
    while start < n:
        while True:
            end = min(n, start + window)
            size = body[start:end] + varint_size(zigzag(np.arange(end - start)))
            size += varint_size(zigzag(size))
            fit = int(np.searchsorted(np.cumsum(size), limit, side="right"))
            if fit < end - start or end == n:
                break
            window *= 2
        start += max(fit, 1)
        bounds.append(start)
        window = max(256, 2 * max(fit, 1))
    return np.asarray(bounds, dtype=np.int64)


def _frame(
    lo: int,
    hi: int,
    keys: pa.Array | None,
    values: pa.Array | None,
    key_len: Varints,
    value_len: Varints,
    offset_delta: Varints,
    record_len: Varints,
    header_count: Varints,
    header_fields: list[tuple[bytes, Varints, np.ndarray, pa.Array]],
) -> pa.Buffer:
    """The records of rows lo..hi-1, one after the other, as one buffer."""
    rows = hi - lo
    rng = slice(lo, hi)

    def piece(arr: pa.Array) -> pa.Array:
        arr = arr.slice(lo, rows)
        return arr.cast(pa.binary()) if pa.types.is_large_binary(arr.type) else arr

    head = RowFrame(rows)
    head.varint(record_len.rows(rng))
    head.const(b"\x00\x00")  # attributes, timestampDelta
    head.varint(offset_delta.rows(rng))
    head.varint(key_len.rows(rng))
    pieces = [head.build()]
    if keys is not None:
        pieces.append(piece(keys))
    mid = RowFrame(rows)
    mid.varint(value_len.rows(rng))
    pieces.append(mid.build())
    if values is not None:
        pieces.append(piece(values))
    tail = RowFrame(rows)
    tail.varint(header_count.rows(rng))
    for prefix, h_len, present, arr in header_fields:
        tail.const(prefix, present[rng])
        tail.varint(h_len.rows(rng), present[rng])
        pieces.append(tail.build())
        pieces.append(piece(arr))
        tail = RowFrame(rows)
    if tail.fields:
        pieces.append(tail.build())
    if len(pieces) == 1:
        joined = pieces[0]
    else:
        joined = pc.binary_join_element_wise(
            *pieces, pa.scalar(b"", pa.binary()), null_handling="skip"
        )
    offsets = np.frombuffer(joined.buffers()[1], dtype=np.int32)
    start, end = int(offsets[joined.offset]), int(offsets[joined.offset + rows])
    return joined.buffers()[2][start:end]


def _batch(
    section: memoryview,
    records: int,
    attributes: int,
    producer_id: int,
    producer_epoch: int,
    base_sequence: int,
    timestamp_ms: int,
    codec: int,
    encoder: Callable[[bytes], bytes] | None,
) -> EncodedBatch:
    """One batch: header, CRC and records, compressed with ``encoder`` (codec id
    ``codec``) when that makes them smaller."""
    body: bytes | memoryview = section
    if encoder is not None:
        plain = bytes(section)
        packed = encoder(plain)
        if len(packed) < len(plain):
            body = packed
            attributes |= codec
    header = bytearray(
        _HEADER.pack(
            0,  # baseOffset: the broker assigns offsets
            HEADER_SIZE - _AFTER_LENGTH_OFFSET + len(body),
            -1,  # partitionLeaderEpoch: set by the broker
            2,  # magic
            0,  # crc, below
            attributes,
            records - 1,  # lastOffsetDelta
            timestamp_ms,
            timestamp_ms,
            producer_id,
            producer_epoch,
            base_sequence,
            records,
        )
    )
    crc = crc32c.crc32c(body, value=crc32c.crc32c(memoryview(header)[_ATTRIBUTES_OFFSET:]))
    struct.pack_into(">I", header, _CRC_OFFSET, crc)
    return EncodedBatch(b"".join((header, body)), records, base_sequence)
