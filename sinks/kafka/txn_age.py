"""How long the Kafka sink's transactions stay open, measured, against the timeout.

A Kafka transaction opens when a task writes its first record (the writer's
announcement) and stays open until the checkpoint that commits it; the broker
aborts it after ``transaction_timeout_ms`` and its rows are lost. Preflight can
only assume a batch duration (:func:`sinks.kafka.checks.min_safe_timeout_ms`);
each committable records when its transaction opened (``opened_at``, the
executor's clock, seconds since the epoch), so the driver sees the real ages:

* after a batch is recorded, its oldest transaction's age plus one checkpoint
  interval plus the commit's retries is the age it may reach at its commit. At
  half the timeout or more, the sink warns and asks for the next checkpoint at
  once (:meth:`sinks.capabilities.HoldsPreparedWork.checkpoint_pressure`);
* at the commit, a transaction older than 80 % of the timeout is warned about.

(tansu, the test broker, never expires transactions; Apache Kafka does.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from sinks.base import Committable

log = logging.getLogger("sinks.kafka")

PRESSURE_SHARE = 0.5
"""projected age at commit, as a share of the timeout, that asks for a checkpoint"""
COMMIT_SHARE = 0.8
"""age at commit, as a share of the timeout, that is warned about"""


def oldest_age(committables: Sequence[Committable], now: float | None = None) -> float | None:
    """Seconds the oldest of ``committables``' transactions has been open (None
    when none says when it opened: work of an earlier version)."""
    opened = [c["opened_at"] for c in committables if c.get("opened_at") is not None]
    if not opened:
        return None
    return max(0.0, (time.time() if now is None else now) - min(opened))


def pressure(
    what: str,
    batch: Sequence[Committable],
    *,
    timeout_ms: int,
    checkpoint_interval_s: float,
    commit_timeout_s: float,
) -> str | None:
    """A reason to checkpoint now (and a warning) when ``batch``'s transactions
    may reach half of ``timeout_ms`` by their commit; else None."""
    age = oldest_age(batch)
    if age is None:
        return None
    projected = age + checkpoint_interval_s + commit_timeout_s
    if projected * 1000 < PRESSURE_SHARE * timeout_ms:
        return None
    reason = (
        f"{what}: a transaction of the last batch has been open {age:.0f}s; with the "
        f"checkpoint interval ({checkpoint_interval_s:g}s) and commit_timeout "
        f"({commit_timeout_s:g}s) it may be {projected:.0f}s old at its commit, against "
        f"transaction_timeout_ms={timeout_ms}"
    )
    log.warning(
        "%s. Kafka aborts a transaction older than the timeout and its rows are lost: "
        "raise transaction_timeout_ms (and the brokers' transaction.max.timeout.ms), make "
        "batches shorter, or checkpoint more often. Checkpointing now",
        reason,
    )
    return reason


def check_at_commit(what: str, committables: Sequence[Committable], *, timeout_ms: int) -> None:
    """Warn when a transaction about to be committed is close to its timeout."""
    age = oldest_age(committables)
    if age is not None and age * 1000 >= COMMIT_SHARE * timeout_ms:
        log.warning(
            "%s: committing a transaction open for %.0fs, %.0f%% of transaction_timeout_ms=%d; "
            "a little later the broker would have aborted it. Raise transaction_timeout_ms or "
            "checkpoint more often",
            what,
            age,
            100 * age * 1000 / timeout_ms,
            timeout_ms,
        )
