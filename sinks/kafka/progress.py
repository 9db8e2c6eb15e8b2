"""The Kafka sink's memory of its own progress, and its claim (see :mod:`sinks.progress`).

Everything lives in the sink's registry topic (:mod:`sinks.kafka.registry`),
next to the announcements of transactional ids. A target is a topic, so every
record below is keyed by (target topic, job, pipeline, sink id): two jobs of
the same name writing different topics never meet.

* **Announcements** (transactional, one per writer, the first record of its own
  transaction): the announcement names the transaction (incarnation, batch), and
  the COMMIT marker of its producer id that follows it on its registry
  partition proves the transaction, hence the batch, committed. Read from the
  raw log with the control markers (never a read_committed consumer: on tansu
  it returns aborted records too). They are tombstoned once the ledger has
  recorded the commit (``forget``).
* **Progress records** (non-transactional, acks=all, partition 0): key
  ``progress/<topic>/<job>/<pipeline>/<sink>/<incarnation>``, value
  ``{"kind": "progress", "topic", "scope", "incarnation", "batch"}``: the
  highest batch of that incarnation whose commit the ledger has recorded.
  ``forget`` appends it, and waits for it, *before* it tombstones the
  announcements it replaces, so at every instant one of the two says the batch
  committed. Compaction keeps the latest per key, and each incarnation writes
  only its own key, with a batch that never goes down.
* **Versions**: claim and progress records carry ``"v": 1`` (one without
  is of version 1 too). One of this sink's target with a later version (a newer
  twophase wrote it) is refused where it is read
  (:class:`~sinks.versions.NewerVersionError`, naming its key, version and
  offset), never replayed as if it were of version 1.
* **Claims** (non-transactional, acks=all, all on partition 0 so the log orders
  them): key ``claim/<topic>/<job>/<pipeline>/<sink>/<incarnation>/<nonce>``,
  value ``{"kind": "claim", "topic", "scope", "incarnation",
  "start_over_from", "nonce"}``. The owner is decided by replaying the claims of
  the scope in log order: a claim is accepted iff the owner so far is nobody,
  its own incarnation, or its ``start_over_from``; a second copy of a nonce (a
  producer retry) is ignored. Every reader replays the same log to the same
  answer, so of two claims made at the same instant the first in the log wins
  and the second claimer, reading past its own record, refuses. Keys are unique
  per claim, so compaction never drops one and the replay never changes; a
  claim is appended only when the owner is not this incarnation already (one
  record per change of owner, or per lost race).

What the sink holds committed for the owner is ``max(its latest progress
record, the batches of its committed announcements still in the registry)``.
It survives a crash at any instant: the announcement commits atomically with
the data, and the progress record is durable before the announcement goes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import kafka.errors as Errors
from kafka import KafkaProducer

from sinks.base import ClaimedScopes, JobScope
from sinks.kafka.registry import COMMITTED, RegistryView, announced_name
from sinks.kafka.wire import KafkaWire
from sinks.naming import TxnName, scope_prefix
from sinks.progress import SinkProgress, conflict, may_claim
from sinks.versions import check_version

PARTITION = 0
"""The registry partition of every claim and progress record (partition 0 exists
however many partitions the registry has, and adding partitions never moves it)."""

_CLAIM = "claim"
_PROGRESS = "progress"
RECORD_VERSION = 1
"""the version of the claim and progress records this one writes, and the newest it reads"""


@dataclass
class _Claims:
    owner: str | None = None
    previous: str | None = None
    nonces: set[str] = field(default_factory=set)


class ProgressBook:
    """Replays the claims and progress records of one target topic (pure, no I/O).

    Fed by :class:`~sinks.kafka.registry.RegistryView` in log order; a record
    of ``target`` whose version is later than :data:`RECORD_VERSION` raises
    :class:`~sinks.versions.NewerVersionError` (``registry``: the topic read,
    for its message)."""

    def __init__(self, target: str, registry: str | None = None) -> None:
        self.target = target
        self.registry = registry
        self._claims: dict[str, _Claims] = {}
        self._settled: dict[tuple[str, str], int] = {}  # (scope key, incarnation) -> batch

    def reset(self) -> None:
        self._claims.clear()
        self._settled.clear()

    def apply(self, partition: int, key: str, value: bytes, offset: int | None = None) -> None:
        if partition != PARTITION or not key.startswith((_CLAIM + "/", _PROGRESS + "/")):
            return
        if key.split("/", 2)[1] == self.target:  # the target topic is in the key
            self._check_version(key, value, offset)
        try:
            rec: dict[str, Any] = json.loads(value)
            kind, scope, inc = rec["kind"], str(rec["scope"]), rec["incarnation"]
            batch = int(rec["batch"]) if kind == _PROGRESS else -1
        except (ValueError, KeyError, TypeError):
            return  # not one of ours
        if rec.get("topic") != self.target or not isinstance(inc, str):
            return
        if kind == _PROGRESS:
            at = (scope, inc)
            self._settled[at] = max(self._settled.get(at, -1), batch)
        elif kind == _CLAIM:
            self._claim(scope, inc, rec.get("start_over_from"), str(rec.get("nonce")))

    def _check_version(self, key: str, value: bytes, offset: int | None) -> None:
        try:
            marker = json.loads(value).get("v")
        except (ValueError, AttributeError):
            return  # not one of ours
        where = f"registry topic {self.registry}, " if self.registry else ""
        at = f", offset {offset}" if offset is not None else ""
        check_version(
            marker, RECORD_VERSION, f"the record {key} ({where}partition {PARTITION}{at})"
        )

    def _claim(self, scope: str, inc: str, start_over_from: str | None, nonce: str) -> None:
        state = self._claims.setdefault(scope, _Claims())
        if nonce in state.nonces:
            return  # the same claim again (a producer retry): decided already
        state.nonces.add(nonce)
        if state.owner != inc and may_claim(SinkProgress(state.owner), inc, start_over_from):
            state.owner, state.previous = inc, state.owner

    def owner(self, scope: JobScope) -> tuple[str | None, str | None]:
        """(owner, the incarnation it took the claim from) of ``scope``."""
        state = self._claims.get(scope.key())
        return (None, None) if state is None else (state.owner, state.previous)

    def settled(self, scope: JobScope, incarnation: str | None) -> int:
        """The highest batch ``incarnation`` recorded in a progress record (-1)."""
        if incarnation is None:
            return -1
        return self._settled.get((scope.key(), incarnation), -1)


def claim_key(target: str, scope: JobScope, nonce: str) -> bytes:
    return f"{_CLAIM}/{target}/{scope.key()}/{scope.incarnation}/{nonce}".encode()


def progress_key(target: str, scope: JobScope) -> bytes:
    return f"{_PROGRESS}/{target}/{scope.key()}/{scope.incarnation}".encode()


class ProgressStore:
    """Reads and writes the progress and the claims of one Kafka sink (one
    target topic) in its registry topic. The caller brings the connection and a
    plain (non-transactional, acks=all) producer, and retries transient errors."""

    def __init__(self, registry: str, target: str, id_prefix: str, where: str) -> None:
        self.registry = registry
        self.target = target
        self.id_prefix = id_prefix
        self.where = where
        self.book = ProgressBook(target, registry)
        self.view = RegistryView(registry, self.book, target)
        self.claims = ClaimedScopes()

    # -- reading ----------------------------------------------------------------------

    def read(self, wire: KafkaWire, scope: JobScope) -> SinkProgress:
        """The progress record of ``scope``, read from the registry (incrementally)."""
        self.view.refresh(wire)
        return self._current(scope)

    def _current(self, scope: JobScope) -> SinkProgress:
        owner, previous = self.book.owner(scope)
        if owner is None:
            return SinkProgress(owner=None)
        batch = max(self.book.settled(scope, owner), self.committed_batch(scope, owner))
        return SinkProgress(owner=owner, batch=batch, previous=previous)

    def committed_batch(self, scope: JobScope, incarnation: str) -> int:
        """The highest batch among ``incarnation``'s committed announcements of
        this target still in the registry (-1). Call after a refresh."""
        prefix = scope_prefix(scope.job, scope.pipeline, scope.sink_id, incarnation)
        best = -1
        for tid, found in self.view.live().items():
            if found.state != COMMITTED or found.topic != self.target:
                continue
            name = announced_name(tid, found, self.id_prefix)
            if name is not None and str(name).startswith(prefix):
                best = max(best, name.batch_id)
        return best

    def settled(self, scope: JobScope) -> int:
        """The batch up to which the ledger recorded ``scope.incarnation``'s commits
        (its progress record; -1). Call after a refresh."""
        return self.book.settled(scope, scope.incarnation)

    # -- claims -----------------------------------------------------------------------

    def claim(
        self,
        wire: KafkaWire,
        producer: KafkaProducer,
        scope: JobScope,
        start_over_from: str | None,
        nonce: str,
        timeout_s: float,
    ) -> SinkProgress:
        """Make ``scope.incarnation`` the owner (see the module docstring); raise
        :class:`~sinks.progress.IncarnationConflictError` when another holds it."""
        ours = scope.incarnation
        assert ours is not None
        found = self.read(wire, scope)
        if not may_claim(found, ours, start_over_from):
            raise conflict(self.where, scope.key(), found, ours)  # nothing appended
        if found.owner == ours:
            self.claims.remember(scope)
            return found
        value = {
            "kind": _CLAIM,
            "v": RECORD_VERSION,
            "topic": self.target,
            "scope": scope.key(),
            "incarnation": ours,
            "start_over_from": start_over_from,
            "nonce": nonce,
            "at": int(time.time() * 1000),
        }
        offset = self._append(producer, claim_key(self.target, scope, nonce), value, timeout_s)
        self._read_past(wire, offset, timeout_s)
        found = self._current(scope)
        if found.owner != ours:
            assert found.owner is not None
            raise conflict(self.where, scope.key(), found, ours)
        self.claims.remember(scope)
        return found

    def replays(self, wire: KafkaWire, pending: dict[str, dict[str, Any]]) -> list[str]:
        """Before a commit of ``pending`` (committables by transactional id): raise
        when another incarnation took a claim over, and return the ids that
        re-write batches their incarnation recorded committed already (replays,
        never to be committed)."""
        self.view.refresh(wire)
        names = {TxnName.require(c["txn"]): tid for tid, c in pending.items()}
        replays: list[str] = []
        for scope, group in self.claims.group(names).items():
            if scope.incarnation is None:
                continue  # first-format work of a ledger that never claimed
            self.check_owner(scope)
            settled = self.settled(scope)
            replays += [names[n] for n in group if n.batch_id <= settled]
        return sorted(replays)

    def check_owner(self, scope: JobScope) -> None:
        """Raise when another incarnation holds the claim (at commit time; call
        after a refresh)."""
        owner, _ = self.book.owner(scope)
        ours = scope.incarnation
        assert ours is not None
        if owner is not None and owner != ours:
            raise conflict(self.where, scope.key(), self._current(scope), ours, at_commit=True)

    # -- progress ---------------------------------------------------------------------

    def record_settled(
        self,
        wire: KafkaWire,
        producer: KafkaProducer,
        scope: JobScope,
        batch: int,
        timeout_s: float,
    ) -> None:
        """Append (durably) the progress record of ``scope.incarnation`` at
        ``batch``, never below what it recorded before."""
        self.view.refresh(wire)
        batch = max(batch, self.settled(scope))
        value = {
            "kind": _PROGRESS,
            "v": RECORD_VERSION,
            "topic": self.target,
            "scope": scope.key(),
            "incarnation": scope.incarnation,
            "batch": batch,
            "at": int(time.time() * 1000),
        }
        self._append(producer, progress_key(self.target, scope), value, timeout_s)
        # applied locally at once: the next read must not depend on a refresh
        self.book.apply(PARTITION, progress_key(self.target, scope).decode(), _json(value))

    def record_committed(
        self,
        wire: KafkaWire,
        producer: KafkaProducer,
        names: Iterable[TxnName],
        timeout_s: float,
        *,
        as_named: bool = False,
    ) -> None:
        """Append the progress record of every scope among the committed
        transactions ``names`` (before their announcements are tombstoned).

        Each is recorded under the incarnation in its name; a first-format name
        under the incarnation this sink claimed its scope for, except with
        ``as_named`` (a sweep settling what another incarnation committed, e.g.
        after a start-over), where first-format names record nothing."""
        names = list(names)
        if as_named:
            names = [n for n in names if n.incarnation is not None]
        for scope, group in self.claims.group(names).items():
            if scope.incarnation is not None:  # first-format work: no progress to record
                batch = max(n.batch_id for n in group)
                self.record_settled(wire, producer, scope, batch, timeout_s)

    # -- plumbing ---------------------------------------------------------------------

    def _append(
        self, producer: KafkaProducer, key: bytes, value: dict[str, Any], timeout_s: float
    ) -> int:
        future = producer.send(self.registry, key=key, value=_json(value), partition=PARTITION)
        producer.flush(timeout=timeout_s)
        return int(future.get(timeout=timeout_s).offset)

    def _read_past(self, wire: KafkaWire, offset: int, timeout_s: float) -> None:
        """Refresh until the view has read the record at ``offset`` of partition 0."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.view.refresh(wire)
            if self.view.next_offset(PARTITION) > offset:
                return
            if time.monotonic() > deadline:
                raise Errors.KafkaTimeoutError(
                    f"registry {self.registry}/{PARTITION}: offset {offset} was acknowledged "
                    "but is not readable yet"
                )
            time.sleep(0.05)


def _json(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True).encode()
