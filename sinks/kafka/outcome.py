"""How did a transaction end? Ask the log, the way a consumer would.

Used only when EndTxn does not give a clear answer: Apache Kafka refuses a
commit of a fenced or expired transaction (PRODUCER_FENCED,
INVALID_PRODUCER_ID_MAPPING, INVALID_TXN_STATE) whatever happened before, and
tansu closes the connection instead of answering. The partition log is the
authority: after a transaction's last data record, the first control batch of
its producer id on that partition is its marker, COMMIT or ABORT; no marker
yet means the transaction is still open.
"""

from __future__ import annotations

from typing import Any

from sinks.kafka.wire import KafkaWire

COMMITTED = "committed"
ABORTED = "aborted"
OPEN = "open"
UNKNOWN = "unknown"  # the data or the marker is no longer in the log (retention, deleted topic)


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
