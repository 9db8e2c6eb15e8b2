"""Errors raised by sinks and the lifecycle manager."""

from __future__ import annotations


class TwoPhaseError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(TwoPhaseError):
    """A bad configuration: the message names what is wrong and what to change."""


class PreflightError(TwoPhaseError):
    """The target cannot give exactly-once as configured; nothing was written."""


class TransactionLostError(TwoPhaseError):
    """Prepared work vanished without having been committed: data would be lost.

    Never swallowed: the job fails and the ledger keeps the decision. Its next
    start writes the batch again from the source (recovery rule 5 in
    :mod:`lifecycle.coordinator`), unless part of the batch committed already."""


REWRITE_ADVICE = (
    "Nothing is dropped silently: a Job writes the lost work again from its source by "
    "itself (recovery rule 5), during the run or at its next start, and only the lost "
    "tasks' share where the rest of the batch committed. It stops instead, and says "
    "why, when the source no longer has the batch (`twophase abandon --owed` decides), "
    "or when part of a later batch committed already or an operator abandoned part of "
    "the work (`twophase abandon` decides)."
)
"""What a :class:`TransactionLostError` message ends with."""


class CommitError(TwoPhaseError):
    """A commit did not go through after all retries; the decision stays recorded
    and the next start finishes it."""


class CommitRefusedError(CommitError):
    """The target refused a commit for a reason no retry can pass (a Delta table
    made append-only, a table feature the sink does not write): it fails at once,
    with the target's reason. The decision stays recorded; the next start
    finishes it only after what the message names is changed."""


class LockWaitError(TwoPhaseError):
    """A task waited longer than its sink's lock timeout for rows another
    transaction holds. The task fails so that Spark retries it (a retry rolls
    back this job's earlier executions of the partition) instead of hanging."""


class KeySpansTasksError(ConfigError):
    """Two tasks of one batch write one key, where the sink was told no key spans
    two of them (``PostgresSink(partitioned_by_key=True)``): one task waited
    for the other's prepared transaction, which only the checkpoint after the
    batch commits. Raised within seconds by the waiting task
    (:mod:`sinks.postgres.lock_watch`), never after ``lock_timeout``; Spark's
    retries fail the same way and the job stops with nothing of the batch
    committed. The message names the sink, the batch, both tasks and what to
    change."""


class DataError(TwoPhaseError):
    """The rows cannot be written as they are: a null key, different rows of one
    key in a batch, a value the target cannot hold exactly (out of the target
    type's range, a character it cannot store, a precision it would round away).
    Raised by a task's writer before its transaction is prepared, so nothing of
    the task is committed (Spark's retries fail the same way and the job stops);
    the message names the sink, the column or key, the row or value, and what
    to change."""


class RecordTooLargeError(DataError):
    """A Kafka record is larger than its topic takes (``max.message.bytes``,
    read at preflight): the message names its key, its size and both limits."""


class PreparedLimitError(TwoPhaseError):
    """PostgreSQL refused to prepare a transaction: its ``max_prepared_transactions``
    is reached. The message says which setting to raise."""


class UnconfirmedWriteError(TwoPhaseError):
    """The target acknowledged a write without confirming where it stored it
    (Kafka: DUPLICATE_SEQUENCE_NUMBER, no offset, after a produce was retried
    across a broker restart), so the task cannot show its transaction holds the
    rows. The task fails before it prepares; Spark's next attempt writes the
    partition again in a new transaction."""
