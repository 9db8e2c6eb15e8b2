"""Exactly-once sinks for PySpark: the two-phase protocol and its adapters.

See :mod:`sinks.base` for the protocol every sink implements.
"""

from sinks.base import Committable, JobScope, Sink, SinkWriter, WriteContext
from sinks.delta import DeltaSink
from sinks.errors import (
    CommitError,
    ConfigError,
    LockWaitError,
    PreflightError,
    TransactionLostError,
    TwoPhaseError,
)
from sinks.kafka import KafkaSink
from sinks.postgres import PostgresSink

__all__ = [
    "CommitError",
    "Committable",
    "ConfigError",
    "DeltaSink",
    "JobScope",
    "KafkaSink",
    "LockWaitError",
    "PostgresSink",
    "PreflightError",
    "Sink",
    "SinkWriter",
    "TransactionLostError",
    "TwoPhaseError",
    "WriteContext",
]
