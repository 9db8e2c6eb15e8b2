"""LastWriteWins: one row per key from a sorted stream, the rules of sinks.keys
enforced across record-batch boundaries (no services)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from sinks import DuplicateKeyError, NullKeyError
from sinks.keys import KeyedWrite
from sinks.last_write import LastWriteWins


def _batch(**cols: Any) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(cols)


def _run(rules: KeyedWrite, batches: list[pa.RecordBatch]) -> list[tuple[dict[str, Any], bool]]:
    lww = LastWriteWins(rules, 7)
    out = []
    for w in [*(lww.feed(b) for b in batches), lww.finish()]:
        if w is not None:
            out += list(zip(w.rows.to_pylist(), w.deletes.tolist(), strict=True))
    return out


ORDERED = KeyedWrite.of("s", ["id"], "v", ("op", "D"))


def test_the_greatest_row_of_each_key_across_record_batches() -> None:
    got = _run(
        ORDERED,
        [
            _batch(id=[1, 1, 2], v=[1, 2, 1], op=["I", "U", "I"]),
            _batch(id=[2], v=[5], op=["D"]),
            _batch(id=[2, 3], v=[6, 1], op=["U", "D"]),
        ],
    )
    assert got == [
        ({"id": 1, "v": 2, "op": "U"}, False),
        ({"id": 2, "v": 6, "op": "U"}, False),
        ({"id": 3, "v": 1, "op": "D"}, True),
    ]


def test_a_tie_is_an_error_only_at_the_greatest_value() -> None:
    # tied below the greatest: decided by the greater row in the next record batch
    first = _batch(id=[1, 1], v=[2, 2], op=["I", "U"], x=["a", "b"])
    got = _run(ORDERED, [first, _batch(id=[1], v=[3], op=["U"], x=["c"])])
    assert got == [({"id": 1, "v": 3, "op": "U", "x": "c"}, False)]
    # tied at the greatest, the tie split over two record batches
    with pytest.raises(DuplicateKeyError, match=r"\(id=1\).*tied at their greatest 'v'"):
        _run(ORDERED, [first, _batch(id=[1, 2], v=[2, 1], op=["U", "I"], x=["c", "d"])])
    # a three-way tie where the last two agree
    with pytest.raises(DuplicateKeyError):
        _run(ORDERED, [_batch(id=[5, 5, 5], v=[1, 1, 1], op=["I", "U", "U"], x=["a", "b", "b"])])
    # rows that differ only in the delete_when column are one row
    got = _run(ORDERED, [_batch(id=[6, 6], v=[1, 1], op=["I", "U"], x=["a", "a"])])
    assert got == [({"id": 6, "v": 1, "op": "U", "x": "a"}, False)]


def test_deletes_agree_and_equal_rows_are_one() -> None:
    rules = KeyedWrite.of("s", ["id"], None, "gone")
    got = _run(
        rules, [_batch(id=[1, 1, 2, 2], x=["a", "b", "c", "c"], gone=[True, True, False, False])]
    )
    assert got == [
        ({"id": 1, "x": "b", "gone": True}, True),
        ({"id": 2, "x": "c", "gone": False}, False),
    ]
    with pytest.raises(DuplicateKeyError, match=r"\(id=3\).*order_by="):
        _run(rules, [_batch(id=[3, 3], x=["a", "a"], gone=[False, True])])


def test_nulls_nan_keys_and_composite_keys() -> None:
    rules = KeyedWrite.of("s", ["a", "b"], None, None)
    got = _run(rules, [_batch(a=[1, 1, 1], b=[1.0, float("nan"), float("nan")], x=[None, 2, 2])])
    assert [r["x"] for r, _ in got] == [None, 2]  # NaN is one key, greater than numbers
    with pytest.raises(NullKeyError, match="key column 'b'"):
        _run(rules, [_batch(a=[1], b=[None], x=[1])])


def test_unsorted_input_is_refused() -> None:
    with pytest.raises(RuntimeError, match="must come sorted"):
        _run(ORDERED, [_batch(id=[2, 1], v=[1, 1], op=["I", "I"])])
    with pytest.raises(RuntimeError, match="must come sorted"):  # across record batches
        _run(ORDERED, [_batch(id=[1, 2], v=[1, 1], op=["I", "I"]), _batch(id=[1], v=[2], op=["U"])])
    with pytest.raises(RuntimeError, match="must come sorted"):  # order_by going down
        _run(ORDERED, [_batch(id=[1, 1], v=[2, 1], op=["I", "I"])])
