"""Auditing what a sink committed against the ledger: the shared vocabulary.

After a checkpoint commits, the ledger keeps its *evidence* for a window of
checkpoints: per sink, each committed transaction in the compact form the sink
gives (:meth:`sinks.capabilities.Audits.evidence`): its name, its row count, and what the
sink needs to find it again (a PostgreSQL gid, a Kafka producer id and the
offsets it wrote, the Parquet files of a Delta version). An audit
(:meth:`sinks.capabilities.Audits.audit`, ``twophase audit``) asks the sink's own records
whether each one is there as the ledger says: the commit-marker row, the
Kafka control marker that committed the records at those offsets, the Delta
version with its app transaction, add actions and ``numRecords``.

It checks evidence, not contents: retention, compaction, VACUUM, OPTIMIZE and
later upserts legitimately change what a target holds. When the sink no longer
keeps the record (Kafka retention deleted the offsets, Delta's log cleanup
removed the version), the verdict is ``expired``, apart from ``mismatch``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class Verdict(str, enum.Enum):
    """What an audit says of one committed transaction."""

    OK = "ok"
    """the sink's own record matches the ledger's evidence"""
    MISMATCH = "mismatch"
    """the record is missing or says something else (rows, producer, outcome)"""
    EXPIRED = "expired"
    """the sink no longer keeps the record (retention, log cleanup)"""
    UNVERIFIABLE = "unverifiable"
    """the evidence is too old to check (written before evidence was kept) or the
    sink cannot be audited"""


@dataclass(frozen=True)
class CheckpointEvidence:
    """One checkpoint's evidence for one sink: the compact committables it committed."""

    checkpoint: int
    committed_at: float
    committed: Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Finding:
    """The audit's verdict on one transaction of one checkpoint."""

    checkpoint: int
    txn: str
    verdict: Verdict
    detail: str = ""
    rows: int = 0
