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
is already aborted or committed is harmless. Two kinds:

* :func:`fence`, blind (producer id and epoch -1): ends whatever is open on the
  id, so only where no task of this run can hold the id (every id of the
  first name formats; a pooled id at recovery, before the first lease);
* :func:`fence_own`, at the known epoch, for a pooled id while batches run
  (:mod:`sinks.kafka.pool`): it ends the transaction of one (producer id,
  epoch), and the zombie that wrote it, and leaves a newer epoch's alone.
  Not EndTxn(abort) with that epoch (:func:`abort_own`, kept for a broker
  that cannot describe transactions): under the classic protocol the sink
  speaks (EndTxn v3, InitProducerId v4), that ends the transaction without
  bumping the epoch, so a zombie still writing with it opens a new
  transaction on its next AddPartitionsToTxn, one the registry never hears of
  (it announces once, when it begins).

What Apache Kafka 4.2 (transactions version 1 and 2 alike) answers
InitProducerId with an expected producer id and epoch, by the id's state:
Ongoing (whatever its epoch): the coordinator bumps the epoch, writes the ABORT
markers with the bumped one, and answers CONCURRENT_TRANSACTIONS; from then on
the partitions refuse a produce at the old epoch (INVALID_PRODUCER_EPOCH) and
the coordinator its AddPartitionsToTxn (PRODUCER_FENCED). CompleteCommit,
CompleteAbort (and Empty) at the expected epoch: the epoch is bumped (NONE)
and no marker written; the coordinator refuses the old epoch as above, and a
partition refuses it only by asking the coordinator (partition verification,
on by default since Kafka 3.6). Limit: on a broker without it, a zombie whose
transaction had already ended at that epoch (by an EndTxn) may still append
to a partition it wrote before, a transaction the coordinator does not know.
Asked again, the same request answers NONE with the epoch it gave after a
Complete* state; after an Ongoing one, PRODUCER_FENCED under transactions
version 1 and NONE (the id then Empty) under version 2. Another producer id:
PRODUCER_FENCED.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import kafka.errors as Errors

from sinks.errors import REWRITE_ADVICE, TransactionLostError
from sinks.kafka import outcome
from sinks.kafka.wire import OPEN_STATES, KafkaWire, TxnState

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


def commit_each(
    wire: KafkaWire,
    coordinators: dict[str, Any],
    committables: list[dict[str, Any]],
    *,
    where: str,
    timeout_ms: int,
    verify: bool,
    committed: Callable[[dict[str, Any]], None],
) -> None:
    """:func:`commit` of each of ``committables``, in order, calling
    ``committed(c)`` after each. The first is committed alone; the EndTxn of
    the others go out a few at a time without waiting for each answer
    (:meth:`KafkaWire.end_txns`), and every answer but a plain success (a
    refusal, a closed connection) is settled by :func:`commit` of that
    transaction alone, which asks again and reads the log. ``verify`` (a
    retry) commits each alone. So the commit costs a round trip per few
    transactions, not one each; a crash after the first leaves the others
    undecided only when their EndTxn had not gone out yet."""

    def alone(c: dict[str, Any]) -> None:
        tid = c["transactional_id"]
        commit(wire, coordinators[tid], c, where=where, timeout_ms=timeout_ms, verify=verify)
        committed(c)

    if not committables:
        return
    alone(committables[0])
    rest = committables[1:]
    if verify:
        for c in rest:
            alone(c)
        return
    answers = wire.end_txns(
        coordinators,
        {c["transactional_id"]: (int(c["producer_id"]), int(c["epoch"])) for c in rest},
        True,
    )
    for c in rest:
        if answers[c["transactional_id"]] is Errors.NoError:
            committed(c)
        else:
            alone(c)


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
    newer transaction of a reused id (a wrong epoch is refused). It does not
    bump the epoch, so a zombie of that epoch may begin another transaction
    (module docstring): only for a broker that cannot describe transactions,
    where :func:`fence_own` cannot tell what it would fence. A broker that
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


_FENCE = "fence"
_WAIT = "wait"
_DONE = "done"

_FENCED = (
    Errors.ProducerFencedError,  # another producer id, or a newer epoch than the expected one
    Errors.InvalidProducerEpochError,
    Errors.InvalidProducerIdMappingError,
)
"""InitProducerId answers to an expected (producer id, epoch) that is no longer
the id's: that epoch's transaction ended, and so did its producer"""


def fence_own(wire: KafkaWire, transactions: dict[str, tuple[int, int]], timeout_ms: int) -> None:
    """End each transaction and fence its producer at its known epoch
    (``{transactional id: (producer id, epoch)}``): DescribeTransactions (one
    request per coordinator), then, by what it tells of each id:

    * another producer id, or a higher epoch: a newer epoch exists, so the
      transaction of this one ended and its producer is fenced: nothing to do
      (never touching the newer one: a later lease's);
    * PrepareCommit, PrepareAbort: ending; asked again shortly;
    * that producer id and epoch, Ongoing (the transaction, or one its zombie
      began after an EndTxn), Empty, CompleteCommit or CompleteAbort:
      InitProducerId with that producer id and epoch, which bumps it (module
      docstring); CONCURRENT_TRANSACTIONS (an Ongoing one being aborted) is
      asked again and then shows the bumped epoch; PRODUCER_FENCED,
      INVALID_PRODUCER_EPOCH: ended already.

    Apache Kafka fences an Ongoing transaction whatever the epoch the request
    expects, hence the DescribeTransactions first. The window left: the
    transaction ends between the two requests and a writer begins another on
    the id, which the InitProducerId then aborts. Lanes keep writers off such
    an id (:mod:`sinks.kafka.pool`, "Who may bump an id's epoch": a writer
    refuses an open id, a lane is leased again only once the broker shows
    none of its ids open).

    On a broker that cannot describe transactions (tansu) this is
    :func:`abort_own`. Ids are removed from ``transactions`` as they are done,
    so a retry goes on where a transient error stopped it."""
    if not transactions:
        return
    coordinators = wire.find_coordinators(list(transactions))
    pause, waited = 0.005, 0.0
    while transactions:
        states = wire.describe_transactions({t: coordinators[t] for t in transactions})
        if states is None:
            abort_own(wire, transactions)
            transactions.clear()
            return
        moves = {t: _fence_move(t, states[t], *transactions[t]) for t in transactions}
        for tid in [t for t, move in moves.items() if move == _DONE]:
            del transactions[tid]
        fencing = sorted(t for t, move in moves.items() if move == _FENCE)
        if fencing:
            answers = wire.init_producer_ids(
                coordinators, fencing, timeout_ms, {t: transactions[t] for t in fencing}
            )
            for tid, error in sorted(answers.items()):
                if error is Errors.NoError or error in _FENCED:
                    del transactions[tid]
                elif error is not Errors.ConcurrentTransactionsError:
                    raise error(f"InitProducerId (fence at epoch {transactions[tid][1]}) of {tid}")
        if transactions:
            if waited > 30:
                tid = min(transactions)
                raise Errors.ConcurrentTransactionsError(f"fence of {tid}: still ending")
            time.sleep(pause)
            waited += pause
            pause = min(pause * 2, 0.25)


def _fence_move(tid: str, state: TxnState | None, producer_id: int, epoch: int) -> str:
    """What :func:`fence_own` does next about ``tid``, which its coordinator
    describes as ``state`` (None: unknown, expired), to end the transaction of
    (``producer_id``, ``epoch``)."""
    if state is None or state.producer_id != producer_id or state.epoch > epoch:
        return _DONE
    if state.epoch < epoch:
        log.warning(
            "Kafka transactional id %s (producer id %s) is at epoch %s, below its "
            "transaction's %s: left alone",
            tid,
            producer_id,
            state.epoch,
            epoch,
        )
        return _DONE
    if state.state in ("PrepareCommit", "PrepareAbort", "PrepareEpochFence"):
        return _WAIT
    return _FENCE


def open_ids(wire: KafkaWire, transactional_ids: Iterable[str]) -> dict[str, TxnState] | None:
    """Those of ``transactional_ids`` whose coordinator shows a transaction that
    has not ended (:data:`sinks.kafka.wire.OPEN_STATES`), whatever its epoch, with their state:
    one FindCoordinator and one DescribeTransactions per coordinator. None on a
    broker that cannot describe transactions."""
    ids = sorted(set(transactional_ids))
    if not ids:
        return {}
    states = wire.describe_transactions(wire.find_coordinators(ids))
    if states is None:
        return None
    return {t: s for t, s in states.items() if s is not None and s.state in OPEN_STATES}


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
