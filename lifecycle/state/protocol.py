"""What every ledger backend offers: the :class:`Ledger` protocol, and what the
backends share (their errors, the incarnation id, the check of a batch).

The coordinator and the job type against :class:`Ledger`; the embedded
:class:`~lifecycle.state.file_ledger.FileLedger` and the
:class:`~lifecycle.state.pg_ledger.PostgresLedger` implement it, both on top of
:class:`~lifecycle.state.base.StateLedger` (reads from the state in memory,
changes as operations of :mod:`lifecycle.state.model`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from lifecycle.state.model import Batch, Checkpoint, Pending
from sinks.base import Committable
from sinks.errors import ConfigError, TwoPhaseError

T = TypeVar("T")


class LedgerLockedError(ConfigError):
    """Another process holds the ledger (a second run of the same job?)."""


class LedgerLostError(TwoPhaseError):
    """This process no longer holds the ledger it opened: another driver took it
    over (its fencing token moved on), or the session holding its lock ended.
    Nothing more is written through it; the driver must stop (a restart recovers)."""


def new_incarnation() -> str:
    """A fresh incarnation id: 12 lowercase hex characters."""
    return secrets.token_hex(6)


def check_batch(committables: dict[str, list[Committable]]) -> None:
    """Raise TypeError unless ``committables`` is a dict of sink id -> list of dicts."""
    if not isinstance(committables, dict) or not all(
        isinstance(sid, str) and isinstance(cs, list) and all(isinstance(c, dict) for c in cs)
        for sid, cs in committables.items()
    ):
        raise TypeError("committables must be a dict of sink id -> list of committables (dicts)")


class Ledger(Protocol):
    """A job's durable record of committables and checkpoints (see :mod:`lifecycle.ledger`).

    Every change is durable when it returns, and a crash leaves the state before
    or after it; reads answer from the state as of the last change."""

    @property
    def job(self) -> str: ...

    @property
    def run(self) -> int: ...

    @property
    def incarnation(self) -> str: ...

    def pending(self) -> Pending: ...

    def read_pending(self, read: Callable[[Pending], T]) -> T: ...

    def pending_pipelines(self) -> list[str]: ...

    def pending_batch_ids(self, pipeline: str) -> list[int]: ...

    def pending_batch(self, pipeline: str, batch_id: int) -> Batch | None: ...

    def is_owned(self, txn: str) -> bool: ...

    def owned_txns(self) -> set[str]: ...

    def decided(self) -> Checkpoint | None: ...

    def history(self) -> list[Checkpoint]: ...

    def finished(self) -> set[str]: ...

    def totals(self) -> dict[str, int]: ...

    def spark_completed(self, pipeline: str) -> int: ...

    def committed_cut(self, pipeline: str) -> int: ...

    def committed_digest(self, pipeline: str, batch_id: int) -> str | None: ...

    def abandoned(self) -> list[dict[str, Any]]: ...

    def abandoned_txns(self, checkpoint_id: int) -> set[str]: ...

    def sinks_settings(self) -> dict[str, dict[str, Any]]: ...

    def owed(self) -> dict[str, dict[int, dict[str, int]]]: ...

    def owed_parts(self, pipeline: str, batch_id: int) -> dict[str, list[int]]: ...

    def owed_work(self, pipeline: str, batch_id: int) -> dict[str, list[Committable]]: ...

    def begin_run(self) -> int: ...

    def record_batch(
        self,
        pipeline: str,
        batch_id: int,
        committables: dict[str, list[Committable]],
        digest: str | None = None,
    ) -> None: ...

    def drop_batches(self, pipeline: str, batch_ids: list[int]) -> None: ...

    def decide(self, kind: str, cut: dict[str, int], finished: list[str]) -> Checkpoint: ...

    def complete(
        self,
        cp: Checkpoint,
        rows: dict[str, int],
        evidence: dict[str, list[dict[str, Any]]] | None = None,
    ) -> Checkpoint: ...

    def evidence_floor(self, label: str) -> int | None: ...

    def record_spark_completed(self, pipeline: str, batch_id: int) -> None: ...

    def record_sinks(self, sinks: dict[str, dict[str, Any]]) -> bool: ...

    def record_abandoned(self, checkpoint_id: int, txns: list[str], note: str) -> None: ...

    def record_owed(
        self,
        pipeline: str,
        batches: dict[int, dict[str, int]],
        parts: dict[int, dict[str, list[int]]] | None = None,
    ) -> None: ...

    def record_repaying(
        self, pipeline: str, batch_id: int, work: dict[str, list[Committable]]
    ) -> None: ...

    def record_repaid(self, pipeline: str, batch_id: int, sinks: dict[str, int]) -> None: ...

    def close(self) -> None: ...
