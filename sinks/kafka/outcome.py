"""How did a transaction end? Ask the broker, then the log, never a clock.

:func:`verdicts` (before a commit, and for the committer's ``classify``): the broker's
transaction coordinator (DescribeTransactions) vouches for a transaction that
is open or committed with its own producer id and epoch; for any other answer
(its epoch bumped by a fence or by the broker's timeout, an abort, an id the
broker forgot) the log decides.

The log (:func:`txn_outcome`), also when EndTxn does not give a clear answer:
Apache Kafka refuses a commit of a fenced or expired transaction
(PRODUCER_FENCED, INVALID_PRODUCER_ID_MAPPING, INVALID_TXN_STATE) whatever
happened before, and tansu closes the connection instead of answering. The
partition log is the authority: after a transaction's last data record, the
first control batch of its producer id on that partition is its marker, COMMIT
or ABORT; no marker yet means the transaction is still open.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sinks.committer import Outcome
from sinks.kafka.wire import KafkaWire

COMMITTED = "committed"
ABORTED = "aborted"
OPEN = "open"
UNKNOWN = "unknown"  # the data or the marker is no longer in the log (retention, deleted topic)


_COMMITTABLE_STATES = ("Ongoing", "PrepareCommit")
"""coordinator states of a transaction a commit would still go through for"""
_COMMITTED_STATE = "CompleteCommit"


def verdicts(
    wire: KafkaWire,
    committables: Sequence[dict[str, Any]],
    coordinators: Mapping[str, Any] | None = None,
) -> dict[str, Outcome] | None:
    """The :class:`~sinks.committer.Outcome` of each of ``committables`` (by
    name; ``coordinators``: their transaction coordinators when the caller
    looked them up already): what the broker says of its transactional id when that speaks of
    the transaction's own producer id and epoch (Ongoing or PrepareCommit:
    prepared; CompleteCommit: committed), else the log's markers
    (:func:`verdict_of`). None on a broker that cannot describe
    transactions (tansu, Kafka before 3.0)."""
    ids = sorted({c["transactional_id"] for c in committables})
    if coordinators is None:
        coordinators = wire.find_coordinators(ids)
    states = wire.describe_transactions({t: coordinators[t] for t in ids})
    if states is None:
        return None
    found: dict[str, Outcome] = {}
    for c in committables:
        state = states.get(c["transactional_id"])
        own = (
            state is not None
            and state.producer_id == int(c["producer_id"])
            and state.epoch == int(c["epoch"])
        )
        if own and state is not None and state.state in _COMMITTABLE_STATES:
            found[c["txn"]] = Outcome.PREPARED
        elif own and state is not None and state.state == _COMMITTED_STATE:
            found[c["txn"]] = Outcome.COMMITTED
        else:
            found[c["txn"]] = verdict_of(wire, c)
    return found


def verdict_of(wire: KafkaWire, committable: dict[str, Any]) -> Outcome:
    """The log's :func:`txn_outcome` in :meth:`sinks.committer.Committer.classify`'s terms:
    COMMIT marker: committed; no marker yet: prepared; ABORT marker, or its
    records gone: lost."""
    verdict = txn_outcome(wire, committable)
    if verdict == COMMITTED:
        return Outcome.COMMITTED
    return Outcome.PREPARED if verdict == OPEN else Outcome.LOST


def txn_outcome(wire: KafkaWire, committable: dict[str, Any]) -> str:
    """COMMITTED, ABORTED, OPEN or UNKNOWN for a committable of :class:`KafkaSink`."""
    topic = committable["topic"]
    producer_id = int(committable["producer_id"])
    leaders = wire.partition_leaders(topic)
    if leaders is None:
        return UNKNOWN
    results = set()
    for p, (first, last) in committable["partitions"].items():
        leader = leaders.get(int(p))
        if leader is None:
            return UNKNOWN
        results.add(_partition_outcome(wire, leader, topic, int(p), first, last, producer_id))
    for verdict in (ABORTED, UNKNOWN, OPEN):
        if verdict in results:
            return verdict
    return COMMITTED


def _partition_outcome(
    wire: KafkaWire, leader: Any, topic: str, partition: int, first: int, last: int, pid: int
) -> str:
    seen_data = False
    for batch in wire.batches(leader, topic, partition, start=first):
        if batch.producer_id != pid:
            continue
        if not batch.is_control_batch:
            if batch.base_offset <= first < batch.next_offset:
                seen_data = True
            continue
        if batch.base_offset <= last:
            continue  # cannot happen for one transaction per producer id; be safe
        if not seen_data:
            return UNKNOWN
        record = next(iter(batch))
        return COMMITTED if record.commit else ABORTED
    return OPEN if seen_data else UNKNOWN
