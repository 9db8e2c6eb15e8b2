"""Kafka's default partitioner, column-wise: murmur2 of every key at once.

Rows with a key go to ``(murmur2(key) & 0x7fffffff) % n`` of the sorted
partitions, as Kafka's Java ``BuiltInPartitioner`` and kafka-python place keyed
records; keyless rows go where the caller says (the writer's round-robin, one
partition per Arrow batch).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from sinks import _binaries as _b

__all__ = ["murmur2", "partition_indexes"]

_M = np.uint32(0x5BD1E995)
_SEED = 0x9747B28C


def murmur2(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Kafka's murmur2 hash (``org.apache.kafka.common.utils.Utils.murmur2``, as
    ``kafka.partitioner.default.murmur2``) of every key, as an int32 array.

    ``keys`` is a binary or large_binary array (strings are hashed as their UTF-8
    bytes); null keys hash to 0, for the caller to mask. The result is Java's
    signed int: ``kafka.partitioner.default.murmur2`` returns the same 32 bits as
    an unsigned Python int (``result.view(np.uint32)``).

    Vectorised over rows: one numpy step per 4-byte chunk index, over the rows
    whose keys are still that long (a few rows with much longer keys than the
    rest are finished one at a time, over numpy arrays of their chunks).
    """
    keys = _b.binary(keys, "keys")
    n = len(keys)
    off = _b.offsets(keys)
    starts = off[:-1]
    lengths = off[1:] - starts
    valid = _b.valid(keys)
    if valid is not None:
        lengths = np.where(valid, lengths, 0)
    data = _b.data(keys)

    h = (np.uint32(_SEED) ^ lengths.astype(np.uint32)).astype(np.uint32)
    chunks = lengths >> 2
    max_chunks = int(chunks.max()) if n else 0
    if max_chunks:
        # The little-endian uint32 that starts at every byte of the data buffer
        # (an unaligned, overlapping view: no copy).
        words = np.ndarray(shape=(len(data) - 3,), dtype="<u4", buffer=data, offset=0, strides=(1,))
        _murmur2_chunks(h, words, starts, chunks, max_chunks)

    # The last 1-3 bytes, then the final mix.
    body = starts + (lengths & ~3)
    extra = lengths & 3
    for i in (2, 1):
        rows = np.flatnonzero(extra > i)
        if len(rows):
            h[rows] ^= data[body[rows] + i].astype(np.uint32) << np.uint32(8 * i)
    rows = np.flatnonzero(extra > 0)
    if len(rows):
        h[rows] ^= data[body[rows]].astype(np.uint32)
        h[rows] *= _M
    h ^= h >> np.uint32(13)
    h *= _M
    h ^= h >> np.uint32(15)
    if valid is not None:
        h[~valid] = 0
    return h.view(np.int32)


def _mix(k: np.ndarray) -> np.ndarray:
    k *= _M
    k ^= k >> np.uint32(24)
    k *= _M
    return k


def _murmur2_chunks(
    h: np.ndarray, words: np.ndarray, starts: np.ndarray, chunks: np.ndarray, max_chunks: int
) -> None:
    """Mix the whole 4-byte chunks of every row into ``h`` (in place)."""
    # How many rows have more than j chunks, for every j.
    longer = len(chunks) - np.cumsum(np.bincount(chunks, minlength=max_chunks + 1))
    if longer[0] == len(chunks):
        # Every row has a chunk: step all rows until the first one runs out.
        j = 0
        while j < max_chunks and longer[j] == len(chunks):
            h *= _M
            h ^= _mix(words[starts + 4 * j])
            j += 1
        if j == max_chunks:
            return
    else:
        j = 0
    rows = np.flatnonzero(chunks > j)
    hs = h[rows]
    pos = starts[rows] + 4 * j
    left = chunks[rows]
    while j < max_chunks:
        if longer[j] < len(rows):
            keep = left > j
            h[rows[~keep]] = hs[~keep]
            rows, hs, pos, left = rows[keep], hs[keep], pos[keep], left[keep]
        if len(rows) <= 8 and max_chunks - j > 64:
            # A few long keys left: finish them one by one.
            for r, hr, p, c in zip(
                rows.tolist(), hs.tolist(), pos.tolist(), left.tolist(), strict=True
            ):
                ks = _mix(words[p + 4 * np.arange(c - j, dtype=np.int64)].astype(np.uint32))
                m = int(_M)
                for k in ks.tolist():
                    hr = ((hr * m) & 0xFFFFFFFF) ^ k
                h[r] = hr
            return
        hs *= _M
        hs ^= _mix(words[pos])
        pos += 4
        j += 1
    h[rows] = hs


def partition_indexes(
    keys: pa.Array | pa.ChunkedArray | None,
    n: int,
    round_robin: int,
    *,
    rows: int | None = None,
) -> np.ndarray:
    """Per row, the index of its partition in the sorted list of ``n`` partitions,
    as Kafka's default partitioner picks it for a keyed record:
    ``(murmur2(key) & 0x7fffffff) % n``. Rows with a null key get ``round_robin``
    (the caller's choice for unkeyed records). ``keys=None`` means every key is
    null; then ``rows`` gives the row count. Returns an int32 array.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    if not 0 <= round_robin < n:
        raise ValueError(f"round_robin must be in [0, {n}), not {round_robin}")
    if keys is None:
        if rows is None:
            raise ValueError("partition_indexes(None, ...) needs rows=")
        return np.full(rows, round_robin, dtype=np.int32)
    keys = _b.binary(keys, "keys")
    if rows is not None and rows != len(keys):
        raise ValueError(f"rows={rows} but keys has {len(keys)} rows")
    idx = ((murmur2(keys).view(np.uint32) & np.uint32(0x7FFFFFFF)) % np.uint32(n)).astype(np.int32)
    valid = _b.valid(keys)
    if valid is not None:
        idx[~valid] = round_robin
    return idx
