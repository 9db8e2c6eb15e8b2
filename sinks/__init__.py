"""Exactly-once sinks for PySpark: the two-phase protocol and its adapters.

See :mod:`sinks.base` for the protocol every sink implements, and
:mod:`sinks.settings` for a sink's recorded settings and :func:`from_settings`
(:mod:`sinks.rebuild`) for the sink built again from them.
"""

from sinks.base import Committable, JobScope, LingeringTxn, Sink, SinkWriter, WriteContext
from sinks.delta import DeltaSink
from sinks.errors import (
    CommitError,
    CommitRefusedError,
    ConfigError,
    DataError,
    LockWaitError,
    PreflightError,
    PreparedLimitError,
    RecordTooLargeError,
    TransactionLostError,
    TwoPhaseError,
    UnconfirmedWriteError,
)
from sinks.kafka import KafkaSink
from sinks.keys import DuplicateKeyError, NullKeyError, NullValueError
from sinks.postgres import PostgresSink
from sinks.rebuild import from_settings

__all__ = [
    "CommitError",
    "CommitRefusedError",
    "Committable",
    "ConfigError",
    "DataError",
    "DeltaSink",
    "DuplicateKeyError",
    "JobScope",
    "KafkaSink",
    "LingeringTxn",
    "LockWaitError",
    "NullKeyError",
    "NullValueError",
    "PostgresSink",
    "PreflightError",
    "PreparedLimitError",
    "RecordTooLargeError",
    "Sink",
    "SinkWriter",
    "TransactionLostError",
    "TwoPhaseError",
    "UnconfirmedWriteError",
    "WriteContext",
    "from_settings",
]
