"""The driver's two moves on a prepared Kafka transaction: commit and fence.

Commit: the transaction is *resumed* by sending EndTxn(transactional id,
producer id, epoch, commit) to its transaction coordinator (FindCoordinator,
key type transaction), never with ``init_transactions()``, which would abort
it. Idempotence:

* Apache Kafka answers NONE to a commit of a transaction that is already
  committed with that epoch, CONCURRENT_TRANSACTIONS while its markers are
  being written (retried), INVALID_TXN_STATE if it ended in an abort,
  PRODUCER_FENCED if its epoch was bumped (fenced by InitProducerId, or
  aborted by the broker after ``transaction.timeout.ms``) and
  INVALID_PRODUCER_ID_MAPPING if the id is unknown (expired after
  ``transactional.id.expiration.ms``).
* tansu answers NONE to EndTxn for any already completed transaction of that
  epoch (commit or abort alike, writing no second marker) and closes the
  connection for a wrong epoch or producer id.

Any answer but NONE (or a retriable error), and a dropped connection, is
settled by reading the log (:mod:`sinks.kafka.outcome`): COMMIT (already
committed: fine), ABORT (:class:`TransactionLostError`), or no marker yet
(:class:`StillOpen`, retried). Limit: on tansu, a commit after an abort *with
the same epoch* (only ``close(failed=True)`` on an executor does that, and its
committable never reaches the driver) answers NONE and is not detected.

A retry (``verify``: an earlier attempt of the same commit failed, so the
broker may have died in the middle of an EndTxn) settles NONE from the log as
well. tansu on S3 persists the decision (PrepareCommit) before it writes the
markers and does not finish the job after a restart: a later EndTxn answers
NONE and writes none of the missing markers, leaving the transaction open for
good. Without a COMMIT marker the commit is retried (:class:`StillOpen`) and
fails at ``commit_timeout`` saying so, rather than report rows committed that
no consumer will read. Apache Kafka writes its markers just after NONE, so
there the check waits a moment at most. Limit: the first attempt of a commit
(also the re-commit of a decided checkpoint by a restarted driver) trusts NONE.

Fence: InitProducerId with the transaction's id bumps its epoch, which aborts
the open transaction and fences any zombie still writing with it. Fencing what
is already aborted or committed is harmless.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kafka.errors as Errors

from sinks.errors import REWRITE_ADVICE, TransactionLostError
from sinks.kafka import outcome
from sinks.kafka.wire import KafkaWire

log = logging.getLogger("sinks.kafka")


class StillOpen(Errors.RetriableError):  # type: ignore[misc]  # kafka-python has no hints
    """EndTxn was refused but the transaction has no marker yet: try again."""


def commit(
    wire: KafkaWire,
    coordinator: Any,
    c: dict[str, Any],
    *,
    where: str,
    timeout_ms: int,
    verify: bool = False,
) -> None:
    """Commit the prepared transaction of committable ``c`` (see the module
    docstring); ``where`` and ``timeout_ms`` (its transaction timeout) go into
    the error of a lost transaction. With ``verify`` (a retry), a success
    answer counts only once the log holds the COMMIT marker."""
    tid = c["transactional_id"]
    try:
        error = wire.end_txn(coordinator, tid, int(c["producer_id"]), int(c["epoch"]), True)
    except Errors.KafkaConnectionError as e:
        # tansu refuses by closing the connection; a broker that is down looks
        # the same. The log tells which (and fails transiently if it is down).
        log.debug("EndTxn(commit) of %s: connection closed (%s); checking the log", tid, e)
        refusal = "the broker closed the connection"
    else:
        if error is Errors.NoError and not verify:
            return
        if issubclass(error, Errors.RetriableError):
            raise error(f"EndTxn(commit) of {tid}")
        refusal = "success" if error is Errors.NoError else error.__name__
    verdict = outcome.txn_outcome(wire, c)
    if verdict == outcome.COMMITTED:
        log.debug("%s was already committed (EndTxn answered: %s)", tid, refusal)
        return
    if verdict == outcome.OPEN and refusal == "success":
        raise StillOpen(
            f"EndTxn(commit) of {tid} answered success after an earlier attempt failed, but "
            "the log holds no COMMIT marker for it: the broker may have lost part of the "
            "commit when it died (tansu on S3 never writes the missing markers), and its "
            "rows stay invisible to read_committed consumers"
        )
    if verdict == outcome.OPEN:
        raise StillOpen(f"EndTxn(commit) of {tid} refused ({refusal}) while it is open")
    what = (
        "was aborted instead of being committed, so its rows are not in the topic"
        if verdict == outcome.ABORTED
        else "cannot be shown to be committed (its records or marker are gone from the log)"
    )
    raise TransactionLostError(
        f"{where}: Kafka transaction {tid} (producer id {c['producer_id']}, "
        f"epoch {c['epoch']}, {c.get('rows', '?')} rows) {what} (EndTxn answered: "
        f"{refusal}). Typical causes: transaction_timeout_ms ({timeout_ms} "
        "ms) expired before the checkpoint committed it, or another producer used the same "
        "transactional id. " + REWRITE_ADVICE
    )


_ENDED = (
    Errors.NoError,
    Errors.InvalidTxnStateError,  # ended already (committed or aborted)
    Errors.ProducerFencedError,  # a newer epoch exists: its InitProducerId aborted it
    Errors.InvalidProducerEpochError,
    Errors.InvalidProducerIdMappingError,  # the id expired, or its producer id rotated
)
"""EndTxn(abort) answers after which the transaction of that epoch has ended"""


def abort_own(wire: KafkaWire, transactions: dict[str, tuple[int, int]]) -> None:
    """End each transaction itself: EndTxn(abort) with its own producer id and
    epoch (``{transactional id: (producer id, epoch)}``), which cannot touch a
    newer transaction of a reused id (a wrong epoch is refused), where
    InitProducerId on the id would abort whatever is open on it. A broker that
    closes the connection instead (tansu, for a wrong epoch) is left to the
    registry's marker: an orphan still open there is tried again by the next
    sweep."""
    if not transactions:
        return
    coordinators = wire.find_coordinators(list(transactions))
    for tid, (producer_id, epoch) in transactions.items():
        try:
            error = wire.end_txn(coordinators[tid], tid, producer_id, epoch, False)
        except Errors.KafkaConnectionError as e:
            log.debug("EndTxn(abort) of %s (epoch %s): connection closed (%s)", tid, epoch, e)
            continue
        if error in _ENDED:
            continue
        if issubclass(error, Errors.RetriableError):
            raise error(f"EndTxn(abort) of {tid}")
        log.warning("EndTxn(abort) of %s (epoch %s) answered %s", tid, epoch, error)


def fence(wire: KafkaWire, transactional_ids: list[str], timeout_ms: int) -> None:
    """InitProducerId for each id: aborts its open transaction, fences zombies.

    All ids at once: Apache Kafka answers CONCURRENT_TRANSACTIONS to an id whose
    open transaction it starts aborting, and the abort completes within
    milliseconds, so those ids are asked again after a short pause (doubling)
    rather than one after another behind the caller's retry backoff. Ids are
    removed from the list as they are done, so a retry goes on where a
    transient error stopped it."""
    coordinators = wire.find_coordinators(transactional_ids)
    pause, waited = 0.005, 0.0
    while transactional_ids:
        answers = wire.init_producer_ids(coordinators, list(transactional_ids), timeout_ms)
        busy = [t for t in transactional_ids if answers[t] is Errors.ConcurrentTransactionsError]
        failed = [
            (t, e)
            for t, e in answers.items()
            if e is not Errors.NoError and e is not Errors.ConcurrentTransactionsError
        ]
        transactional_ids[:] = busy + [t for t, _ in failed]
        if failed:
            tid, error = failed[0]
            raise error(f"InitProducerId (abort) of {tid}")
        if busy:
            if waited > 30:
                raise Errors.ConcurrentTransactionsError(f"InitProducerId (abort) of {busy[0]}")
            time.sleep(pause)
            waited += pause
            pause = min(pause * 2, 0.25)
