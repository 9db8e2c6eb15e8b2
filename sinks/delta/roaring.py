"""Row indexes as Delta's serialized ``RoaringBitmapArray``, the body of a
deletion vector.

The Delta protocol's "Deletion Vector Format" stores a vector as a 64-bit
roaring bitmap: the magic number ``1681511377`` (int32, little-endian), the
number of 32-bit bitmaps (int64), then for each its key (the high 32 bits,
int32) and the bitmap in the portable roaring format (the RoaringFormatSpec:
cookie ``12346``, one descriptive entry and one offset a container, then the
containers: sorted 16-bit values up to 4,096 of them, else a 65,536-bit set).
No run containers are written; readers take either. The rules:

1. **Only the serialization.** :func:`serialize` turns a set of row indexes
   into those bytes and nothing else; the vector file around them (the
   format's version byte, each vector's size and checksum) and its descriptor
   are written by delta-spark's own store (:mod:`sinks.delta.spark_dv`), which
   parses these bytes back with its own reader before it writes anything.
2. **Exact.** Duplicates count once, the order of the input does not matter,
   negative indexes are refused.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np

MAGIC = 1681511377
"""the first four bytes of a portable ``RoaringBitmapArray``"""
_COOKIE = 12346  # SERIAL_COOKIE_NO_RUNCONTAINER
_ARRAY_MAX = 4096  # above this cardinality a container is a bitset


def serialize(rows: Iterable[int]) -> bytes:
    """The portable ``RoaringBitmapArray`` of the row indexes ``rows``."""
    values = np.unique(np.fromiter(rows, dtype=np.int64))
    if values.size and values[0] < 0:
        raise ValueError(f"a row index is negative: {int(values[0])}")
    highs = (values >> 32).astype(np.uint64)
    keys, starts = np.unique(highs, return_index=True)
    out = [struct.pack("<iq", MAGIC, len(keys))]
    ends = [*starts[1:], values.size]
    for key, start, end in zip(keys, starts, ends, strict=True):
        out.append(struct.pack("<I", int(key)))
        out.append(_bitmap32((values[start:end] & 0xFFFFFFFF).astype(np.uint32)))
    return b"".join(out)


def _bitmap32(values: np.ndarray) -> bytes:
    """One 32-bit roaring bitmap of the sorted, distinct ``values``, portable."""
    highs = (values >> 16).astype(np.uint16)
    keys, starts, counts = np.unique(highs, return_index=True, return_counts=True)
    n = len(keys)
    header = struct.pack("<II", _COOKIE, n)
    descriptive = np.empty(2 * n, dtype="<u2")
    descriptive[0::2] = keys
    descriptive[1::2] = counts - 1
    offset = len(header) + 4 * n + 4 * n
    offsets = np.empty(n, dtype="<u4")
    bodies = []
    for i, (start, count) in enumerate(zip(starts, counts, strict=True)):
        low = (values[start : start + count] & 0xFFFF).astype("<u2")
        if count <= _ARRAY_MAX:
            body = low.tobytes()
        else:
            bits = np.zeros(65536, dtype=np.uint8)
            bits[low] = 1
            body = np.packbits(bits, bitorder="little").tobytes()
        offsets[i] = offset
        offset += len(body)
        bodies.append(body)
    return header + descriptive.tobytes() + offsets.tobytes() + b"".join(bodies)
