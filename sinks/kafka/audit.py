"""Audit of the Kafka sink: each committed transaction, found again in the log.

A committable records where its records went: per partition the first and last
offset the broker gave them, the producer id and epoch. The audit reads each
partition raw (Fetch at read_uncommitted, control batches included) from the
lowest such offset, counts the data records of each producer id and epoch
inside its offsets, and finds the first control batch of that producer id
after them: a COMMIT marker is the commit's evidence. It never trusts a
``read_committed`` consumer (tansu's does not filter aborted records).

Verdicts (:class:`sinks.audit.Verdict`): ``ok`` when the records are there in
the number the ledger says and a COMMIT marker follows; ``expired`` when
retention deleted offsets the committable names (the log starts after them);
``expired`` too when offsets between the first and the last are missing from
the log (compaction, ``cleanup.policy=compact``, removed records: what is left
cannot be counted against the ledger); ``mismatch`` otherwise (a topic or
partition that does not exist, missing or extra records, an ABORT marker, no
marker at all, records of the producer id with another epoch at those
offsets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sinks.audit import CheckpointEvidence, Finding, Verdict
from sinks.kafka.wire import KafkaWire


def evidence(c: Mapping[str, Any]) -> dict[str, Any]:
    """What the ledger keeps of a committed Kafka committable for an audit."""
    return {
        "txn": c["txn"],
        "rows": int(c.get("rows", 0)),
        "pid": c.get("producer_id"),
        "epoch": c.get("epoch"),
        "topic": c.get("topic"),
        "partitions": c.get("partitions") or {},
    }


@dataclass
class _Wanted:
    checkpoint: int
    txn: str
    pid: int
    epoch: int
    rows: int
    counted: int = 0
    partitions: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    outcome: dict[tuple[str, int], str] = field(default_factory=dict)  # commit | abort
    expired: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)  # partitions that do not exist
    seen: dict[tuple[str, int], int] = field(default_factory=dict)  # offsets found in range
    strangers: int = 0  # records of the producer id with another epoch inside the offsets


def audit(wire: KafkaWire, checkpoints: Sequence[CheckpointEvidence]) -> list[Finding]:
    """Check every committable of ``checkpoints`` against the log (module docstring)."""
    wanted: list[_Wanted] = []
    found: list[Finding] = []
    for cp in checkpoints:
        for c in cp.committed:
            rows = int(c.get("rows", 0))
            if c.get("pid") is None or not c.get("topic"):
                found.append(
                    Finding(cp.checkpoint, c["txn"], Verdict.UNVERIFIABLE, "no offsets kept", rows)
                )
                continue
            w = _Wanted(cp.checkpoint, c["txn"], int(c["pid"]), int(c["epoch"]), rows)
            for p, (first, last) in (c.get("partitions") or {}).items():
                w.partitions[(str(c["topic"]), int(p))] = (int(first), int(last))
            wanted.append(w)
    by_partition: dict[tuple[str, int], list[_Wanted]] = {}
    for w in wanted:
        for key in w.partitions:
            by_partition.setdefault(key, []).append(w)
    leaders: dict[str, dict[int, int] | None] = {}
    for (topic, partition), ws in sorted(by_partition.items()):
        if topic not in leaders:
            leaders[topic] = wire.partition_leaders(topic)
        leader = (leaders[topic] or {}).get(partition)
        if leader is None:
            for w in ws:
                w.gone.append(f"{topic}/{partition} does not exist")
            continue
        _scan(wire, leader, topic, partition, ws)
    found.extend(_verdict(w) for w in wanted)
    return found


def _scan(wire: KafkaWire, leader: Any, topic: str, partition: int, ws: list[_Wanted]) -> None:
    key = (topic, partition)
    start = min(w.partitions[key][0] for w in ws)
    probe = wire.fetch(leader, topic, partition, start)
    log_start = probe.log_start_offset if probe is not None else 0
    live = []
    for w in ws:
        first, _last = w.partitions[key]
        if first < log_start:
            w.expired.append(f"{topic}/{partition} starts at offset {log_start} now, after {first}")
        else:
            live.append(w)
    open_ = {id(w): w for w in live}
    if not open_:
        return
    for batch in wire.batches(leader, topic, partition, start=max(start, log_start)):
        pid = batch.producer_id
        if batch.is_control_batch:
            outcome = _control_outcome(batch)
            for w in open_.values():  # a marker holds an offset too
                first, last = w.partitions[key]
                if first <= batch.base_offset <= last:
                    w.seen[key] = w.seen.get(key, 0) + 1
            for w in list(open_.values()):
                if outcome and w.pid == pid and batch.base_offset > w.partitions[key][1]:
                    w.outcome[key] = outcome
                    del open_[id(w)]
            if not open_:
                return
            continue
        offsets: list[int] | None = None  # a batch's records can be iterated once
        for w in open_.values():
            first, last = w.partitions[key]
            if batch.next_offset <= first or batch.base_offset > last:
                continue
            if offsets is None:
                offsets = [r.offset for r in batch]
            inside = sum(1 for o in offsets if first <= o <= last)
            w.seen[key] = w.seen.get(key, 0) + inside
            if pid != w.pid:
                continue  # another writer's records, interleaved on the partition
            if batch.producer_epoch == w.epoch:
                w.counted += inside
            else:
                w.strangers += inside


def _control_outcome(batch: Any) -> str | None:
    """``commit`` or ``abort``: what a control batch's marker says (None: no record)."""
    for marker in batch:
        return "commit" if marker.commit else "abort"
    return None


def _verdict(w: _Wanted) -> Finding:
    if w.gone:
        return Finding(w.checkpoint, w.txn, Verdict.MISMATCH, "; ".join(w.gone), w.rows)
    holes = [
        f"{t}/{p} offsets {first}..{last}"
        for (t, p), (first, last) in sorted(w.partitions.items())
        if w.seen.get((t, p), 0) < last - first + 1
    ]
    if holes:
        w.expired.append(
            "records are missing between its offsets (" + ", ".join(holes) + "): the log "
            "was compacted (cleanup.policy=compact) or its records deleted"
        )
    if w.expired:
        return Finding(w.checkpoint, w.txn, Verdict.EXPIRED, "; ".join(w.expired), w.rows)
    problems = []
    if w.counted != w.rows:
        problems.append(
            f"{w.counted} record(s) of producer {w.pid} epoch {w.epoch} at its offsets, "
            f"the ledger says {w.rows}"
        )
    for (topic, partition), (first, last) in sorted(w.partitions.items()):
        outcome = w.outcome.get((topic, partition))
        where = f"{topic}/{partition} offsets {first}..{last}"
        if outcome == "abort":
            problems.append(f"{where}: an ABORT marker ended the transaction")
        elif outcome is None:
            problems.append(f"{where}: no COMMIT marker (the transaction is still open)")
    if w.strangers:
        problems.append(
            f"{w.strangers} record(s) of producer {w.pid} with another epoch at its offsets"
        )
    if problems:
        return Finding(w.checkpoint, w.txn, Verdict.MISMATCH, "; ".join(problems), w.rows)
    return Finding(w.checkpoint, w.txn, Verdict.OK, "", w.rows)
