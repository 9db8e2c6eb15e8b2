"""Lifecycle manager: jobs of bounded and unbounded pipelines, the ledger, the
checkpoint coordinator and recovery. The kinds of failure are in
:mod:`lifecycle.errors`; :func:`configure_logging` is the logging switch."""

from lifecycle.coordinator import Coordinator
from lifecycle.errors import (
    CheckpointCommitError,
    JobFailedError,
    PipelineFailedError,
    RecoveryRefusedError,
    TaskFailedError,
)
from lifecycle.job import Job, JobResult
from lifecycle.ledger import Checkpoint, FileLedger, PostgresLedger
from lifecycle.logs import configure_logging
from lifecycle.pipeline import PipelineState

__all__ = [
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
    "configure_logging",
]
