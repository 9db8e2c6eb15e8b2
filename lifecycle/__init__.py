"""Lifecycle manager: jobs of bounded and unbounded pipelines, the ledger, the
checkpoint coordinator and recovery."""

from lifecycle.coordinator import Coordinator
from lifecycle.job import Job, JobFailedError, JobResult
from lifecycle.ledger import Checkpoint, FileLedger
from lifecycle.pipeline import PipelineState

__all__ = [
    "Checkpoint",
    "Coordinator",
    "FileLedger",
    "Job",
    "JobFailedError",
    "JobResult",
    "PipelineState",
]
