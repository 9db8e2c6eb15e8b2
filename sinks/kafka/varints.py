"""Zigzag varints of whole columns, and rows of bytes framed from them, with numpy.

The column-wise machinery of :mod:`sinks.kafka.records`, which knows nothing of
Kafka: :func:`varints` zigzags a column of int64 values (protobuf's sint32 and
sint64) and sizes their varints at once; a :class:`RowFrame` lays fixed-width
fields (those varints, constant bytes), each present in every row or only
where a mask says, side by side as one 2-D byte matrix and compacts it with its
validity mask into an Arrow binary array of one byte string per row. Python
loops per field and per varint byte, never per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Varints:
    """The zigzag values (uint64) of a column of int64 values and the sizes of
    their varints."""

    z: np.ndarray
    size: np.ndarray

    def rows(self, rows: slice) -> Varints:
        return Varints(self.z[rows], self.size[rows])


def varints(v: np.ndarray) -> Varints:
    """The zigzag values of the int64 values ``v`` and the sizes of their varints."""
    z = zigzag(v)
    return Varints(z, varint_size(z))


def zigzag(v: np.ndarray) -> np.ndarray:
    """Zigzag of int64 values, as uint64."""
    v = v.astype(np.int64, copy=False)
    z = v << 1
    if len(v) and v.min() < 0:
        z ^= v >> 63
    return z.view(np.uint64)


def varint_size(z: np.ndarray) -> np.ndarray:
    """Bytes of the varint of every zigzagged value ``z`` (uint64 array)."""
    top = int(z.max()) if len(z) else 0
    if top < 1 << 7:
        return np.ones(len(z), dtype=np.int64)
    size = (z >= np.uint64(1 << 7)).astype(np.int64)
    size += 1
    shift = 14
    while top >> shift:
        size += z >= np.uint64(1 << shift)
        shift += 7
    return size


def varint_bytes(v: int) -> bytes:
    """The zigzag varint of ``v``."""
    return zigzag_bytes((v << 1) ^ (v >> 63))


def zigzag_bytes(z: int) -> bytes:
    """The varint of the zigzag value ``z``."""
    out = bytearray()
    while z > 0x7F:
        out.append(0x80 | (z & 0x7F))
        z >>= 7
    out.append(z)
    return bytes(out)


class RowFrame:
    """Per-row byte strings made of fixed-width fields (varints, constant bytes),
    built as one (width x rows) byte matrix and its validity mask, then compacted
    into an Arrow binary array."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        # (zigzag values or constant bytes, varint sizes, rows where present)
        self.fields: list[tuple[np.ndarray | bytes, np.ndarray | None, np.ndarray | None]] = []
        self.lengths = np.zeros(rows, dtype=np.int64)
        self.fixed = True  # every row the same bytes

    def varint(self, v: Varints, present: np.ndarray | None = None) -> None:
        """The varints ``v`` (one per row), where ``present``."""
        z, size = v.z, v.size
        if present is None and self.rows and z.min() == z.max():
            self.const(zigzag_bytes(int(z[0])))
            return
        self.fields.append((z, size, present))
        self.fixed = False
        self.lengths += size if present is None else np.where(present, size, 0)

    def const(self, data: bytes, present: np.ndarray | None = None) -> None:
        """The same bytes in every row, where ``present``."""
        if present is not None and present.all():
            present = None
        self.fields.append((data, None, present))
        self.fixed = self.fixed and present is None
        self.lengths += len(data) if present is None else present * len(data)

    def build(self) -> pa.Array:
        if self.fixed:
            row = np.frombuffer(b"".join(f for f, _, _ in self.fields), dtype=np.uint8)  # type: ignore[misc]
            packed = np.tile(row, self.rows)
            offsets = np.arange(self.rows + 1, dtype=np.int32) * np.int32(len(row))
        else:
            packed, offsets = self._compact()
        return pa.Array.from_buffers(
            pa.binary(), self.rows, [None, pa.py_buffer(offsets), pa.py_buffer(packed)]
        )

    def _compact(self) -> tuple[np.ndarray, np.ndarray]:
        widths = [len(field) if size is None else int(size.max()) for field, size, _ in self.fields]
        # Column-major: every byte position of the rows is one contiguous row here.
        matrix = np.empty((sum(widths), self.rows), dtype=np.uint8)
        mask = np.empty((sum(widths), self.rows), dtype=bool)
        col = 0
        for (field, size, present), width in zip(self.fields, widths, strict=True):
            if isinstance(field, bytes):
                matrix[col : col + width] = np.frombuffer(field, dtype=np.uint8)[:, None]
                mask[col : col + width] = True if present is None else present
            else:
                assert size is not None  # a column field has its sizes
                z = field.astype(np.uint32) if width <= 4 else field
                np.greater(size, 0, out=mask[col])
                for b in range(width):
                    byte = matrix[col + b]
                    np.right_shift(z, 7 * b, out=byte, casting="unsafe")
                    byte &= 0x7F
                    if b + 1 < width:
                        more = mask[col + b + 1]
                        np.greater(size, b + 1, out=more)
                        byte |= more.view(np.uint8) << 7
                if present is not None:
                    mask[col : col + width] &= present
            col += width
        offsets = np.zeros(self.rows + 1, dtype=np.int32)
        np.cumsum(self.lengths, out=offsets[1:])
        return matrix.T[mask.T], offsets
