"""The plan of a keyed Delta merge: which files of the snapshot may hold a changed key.

The driver plans on the snapshot the commit builds on, from the table's log and
the change files' metadata alone (:func:`plan`): the candidates are the files
of the changes' partitions when every partition column is a key column, and of
those the ones whose statistics' range of the first key column (integers and
dates, whose statistics are exact) meets a change file's range. Files without
statistics are candidates. The merge (:mod:`sinks.delta.merge`) rewrites the
candidates and removes them (:func:`removes`); a replace removes its slice's
files the same way (:mod:`sinks.delta.replace`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.transaction import RemoveAction

from sinks.base import Committable
from sinks.delta.changes import range_value
from sinks.delta.layout import Layout, partition_value
from sinks.keys import KeyedWrite
from sinks.naming import TxnName


@dataclass(frozen=True)
class Change:
    """One staged change file of a batch."""

    path: str
    batch: int
    size: int
    rows: int
    key_range: tuple[Any, Any] | None
    partitions: list[tuple[str | None, ...]] | None


def changes_of(committables: Sequence[Committable]) -> list[Change]:
    """The change files of ``committables``, in batch order."""
    found = []
    for c in committables:
        batch = TxnName.require(c["txn"]).batch_id
        for ch in c.get("changes", ()):
            kr = ch.get("key_range")
            parts = ch.get("partitions")
            found.append(
                Change(
                    ch["path"],
                    batch,
                    int(ch["size"]),
                    int(ch["rows"]),
                    (kr[0], kr[1]) if kr else None,
                    [tuple(p) for p in parts] if parts is not None else None,
                )
            )
    return sorted(found, key=lambda ch: (ch.batch, ch.path))


@dataclass(frozen=True)
class Candidate:
    """A table file that may hold a changed key: rewritten and removed."""

    path: str
    size: int
    rows: int | None
    partition_values: dict[str, str | None]

    @classmethod
    def of(cls, action: dict[str, Any], partition_by: Sequence[str]) -> Candidate:
        """The file of a row of ``DeltaTable.get_add_actions(flatten=True)``."""
        return cls(
            unquote(str(action["path"])),  # the log's paths are URL-encoded
            int(action["size_bytes"]),
            None if action.get("num_records") is None else int(action["num_records"]),
            {c: partition_value(action.get(f"partition.{c}")) for c in partition_by},
        )


def _exact_range_type(t: pa.DataType) -> bool:
    """Key types whose Delta statistics are exact (strings are cut to a prefix,
    timestamps to milliseconds)."""
    return pa.types.is_integer(t) or pa.types.is_date(t)


def plan(
    dt: DeltaTable, layout: Layout, rules: KeyedWrite, changes: Sequence[Change]
) -> list[Candidate]:
    """The files of ``dt``'s snapshot that may hold a key of ``changes``."""
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    parts = layout.partition_by
    by_partition = bool(parts) and set(parts) <= set(rules.key)
    allowed: set[tuple[str | None, ...]] | None = None
    if by_partition and all(ch.partitions is not None for ch in changes):
        allowed = {p for ch in changes for p in ch.partitions or ()}
    first = rules.key[0]
    ranges: list[tuple[Any, Any]] | None = None
    if (
        first not in parts
        and _exact_range_type(layout.schema.field(first).type)
        and all(ch.key_range is not None for ch in changes)
    ):
        ranges = [ch.key_range for ch in changes if ch.key_range is not None]
    # statistics are keyed by physical names on a column-mapped table (partition
    # values by logical ones, as deltalake gives them)
    stat = layout.mapping.name(first) if layout.mapping is not None else first
    found = []
    for a in actions:
        candidate = Candidate.of(a, parts)
        pv = candidate.partition_values
        if allowed is not None and tuple(pv[c] for c in parts) not in allowed:
            continue
        if ranges is not None:
            low, high = range_value(a.get(f"min.{stat}")), range_value(a.get(f"max.{stat}"))
            if (
                low is not None
                and high is not None
                and not any(lo <= high and low <= hi for lo, hi in ranges)
            ):
                continue
        found.append(candidate)
    return found


def removes(candidates: Sequence[Candidate]) -> list[RemoveAction]:
    """The remove actions of ``candidates``, stamped now."""
    now = int(time.time() * 1000)
    return [
        RemoveAction(
            path=c.path,
            data_change=True,
            deletion_timestamp=now,
            size=c.size,
            partition_values=c.partition_values,
        )
        for c in candidates
    ]
