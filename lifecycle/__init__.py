"""Lifecycle manager: jobs of bounded and unbounded pipelines, the ledger, the
checkpoint coordinator and recovery. The kinds of failure are in
:mod:`lifecycle.errors`; :func:`configure_logging` is the logging switch.

Names are imported lazily: ``import lifecycle`` alone loads nothing heavy (the
test kit's pytest plugin, :mod:`lifecycle.testing.plugin`, is imported in every
pytest run where the package is installed)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lifecycle.adopt import Adopted, AdoptionRefusedError, adopt_checkpoint
    from lifecycle.coordinator import Coordinator
    from lifecycle.errors import (
        BatchLostError,
        CheckpointCommitError,
        JobFailedError,
        PipelineFailedError,
        RecoveryRefusedError,
        TaskFailedError,
    )
    from lifecycle.job import Job
    from lifecycle.job_result import JobResult
    from lifecycle.ledger import Checkpoint, FileLedger, PostgresLedger
    from lifecycle.logs import configure_logging
    from lifecycle.pipeline import PipelineState

_EXPORTS = {
    "Adopted": "lifecycle.adopt",
    "AdoptionRefusedError": "lifecycle.adopt",
    "adopt_checkpoint": "lifecycle.adopt",
    "BatchLostError": "lifecycle.errors",
    "Checkpoint": "lifecycle.ledger",
    "CheckpointCommitError": "lifecycle.errors",
    "Coordinator": "lifecycle.coordinator",
    "FileLedger": "lifecycle.ledger",
    "Job": "lifecycle.job",
    "JobFailedError": "lifecycle.errors",
    "JobResult": "lifecycle.job_result",
    "PipelineFailedError": "lifecycle.errors",
    "PipelineState": "lifecycle.pipeline",
    "PostgresLedger": "lifecycle.ledger",
    "RecoveryRefusedError": "lifecycle.errors",
    "TaskFailedError": "lifecycle.errors",
    "configure_logging": "lifecycle.logs",
}

__all__ = [
    "Adopted",
    "AdoptionRefusedError",
    "BatchLostError",
    "Checkpoint",
    "CheckpointCommitError",
    "Coordinator",
    "FileLedger",
    "Job",
    "JobFailedError",
    "JobResult",
    "PipelineFailedError",
    "PipelineState",
    "PostgresLedger",
    "RecoveryRefusedError",
    "TaskFailedError",
    "adopt_checkpoint",
    "configure_logging",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lifecycle' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
