"""Byte-level views of Arrow binary and string arrays, without copies: offsets,
validity, data buffer, lengths (the Kafka record encoder and partitioner), and
the bytes a column's values span (scans for characters by the Kafka JSON
encoder and the PostgreSQL value checks)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def binary(arr: pa.Array | pa.ChunkedArray, what: str) -> pa.Array:
    """``arr`` as one binary or large_binary array (chunks combined, strings viewed
    as their UTF-8 bytes); TypeError for any other type."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return arr
    if pa.types.is_string(t):
        return arr.view(pa.binary())
    if pa.types.is_large_string(t):
        return arr.view(pa.large_binary())
    raise TypeError(f"{what} must be a binary or large_binary Arrow array, not {t}")


def offsets(arr: pa.Array) -> np.ndarray:
    """The ``len(arr) + 1`` value offsets of a (possibly sliced) binary array, as
    int64 positions in its data buffer."""
    if len(arr) == 0:
        return np.zeros(1, dtype=np.int64)
    dtype = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    raw = np.frombuffer(arr.buffers()[1], dtype=dtype)
    return raw[arr.offset : arr.offset + len(arr) + 1].astype(np.int64, copy=False)


def valid(arr: pa.Array) -> np.ndarray | None:
    """A bool mask of the non-null rows, or None when no row is null."""
    if arr.null_count == 0:
        return None
    return arr.is_valid().to_numpy(zero_copy_only=False)


def data(arr: pa.Array) -> np.ndarray:
    """The data buffer of a binary array as uint8 (empty when it has none)."""
    buf = arr.buffers()[2]
    if buf is None:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def lengths(arr: pa.Array) -> np.ndarray:
    """Per row: the value's length in bytes, -1 for null (Kafka's null length)."""
    off = offsets(arr)
    sizes = off[1:] - off[:-1]
    mask = valid(arr)
    if mask is not None:
        sizes[~mask] = -1
    return sizes


def used_bytes(arr: pa.Array) -> np.ndarray:
    """The bytes the values of a (possibly sliced) binary or string array span in
    its data buffer, as uint8: the text of every row back to back (the bytes
    behind a null included, if any)."""
    arr = binary(arr, "values")
    off = offsets(arr)
    return data(arr)[int(off[0]) : int(off[-1])]
