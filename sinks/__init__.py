"""Exactly-once sinks for PySpark: the two-phase protocol and its adapters.

See :mod:`sinks.base` for the protocol every sink implements (its committer:
:mod:`sinks.committer`; what only some sinks need: :mod:`sinks.capabilities`), and
:mod:`sinks.settings` for a sink's recorded settings and :func:`from_settings`
(:mod:`sinks.rebuild`) for the sink built again from them.
"""

from sinks.base import (
    Committable,
    Committer,
    JobScope,
    LingeringTxn,
    Outcome,
    Sink,
    SinkWriter,
    WriteContext,
)
from sinks.delta import DeltaSink
from sinks.errors import (
    CommitError,
    CommitRefusedError,
    ConfigError,
    DataError,
    KeySpansTasksError,
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
    "Committer",
    "ConfigError",
    "DataError",
    "DeltaSink",
    "DuplicateKeyError",
    "JobScope",
    "KafkaSink",
    "KeySpansTasksError",
    "LingeringTxn",
    "LockWaitError",
    "NullKeyError",
    "NullValueError",
    "Outcome",
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
