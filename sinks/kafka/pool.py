"""The Kafka sink's bounded pool of transactional ids.

Apache Kafka keeps every transactional id's state in its transaction
coordinator for ``transactional.id.expiration.ms`` (7 days by default). One id
per batch, partition and attempt would leave millions behind (64 partitions, a
batch a second); Flink's ever-new ids are known to strain brokers (FLINK-34554).
So the ids are reused, fenced by epoch, and their number stays flat however
long the job runs.

**Lanes.** The driver leases each batch a *lane* (:meth:`IdPool.lease`, in
the committer's ``lease``, before the batch's tasks start); a task's transactional id is
its scope's, the lane, its partition and its attempt number::

    <prefix>tp3.<job>.<pipeline>.<sink>.i<incarnation>.l<lane>.p<partition>.a<attempt>

so concurrent attempts of a partition (retries, speculative copies) never
share an id, and neither do two batches whose transactions are open at once;
a batch run again in the same run (a drain's replay, a repayment) takes a lane
of its own too. (A stage Spark runs again after a lost shuffle numbers its
attempts from 0 again while tasks of the earlier one may still run: PySpark
does not tell the stage attempt, so there the writers' check below keeps
them apart.)
The ids in use are lanes x partitions x attempts: a few lanes (the batches
prepared and not yet committed, plus one), the job's partitions, the attempt
numbers Spark reaches.

**An id returns to the pool only after its transaction ended.** A lane is
released (:meth:`IdPool.release`) once its batch is settled (its checkpoint
committed it, or it was aborted, and the sweep that follows aborted the batch's
orphans: the committer's ``settled``), the registry shows no transaction of the lane's
ids still open or committed without its tombstone, *and* the broker shows none
open: DescribeTransactions of every id the pool has seen in the lane (in
announcements, committables aborted, the registry), one request per
coordinator, asked only for the lanes about to be released. The registry alone
would not do: a transaction a zombie opened after the driver ended its
attempt's (below) was never announced. A lane found open stays leased, and the
next checkpoint's settle asks again. Until then a new batch takes another lane
(a new one if none is free). At a start every lane is free: recovery settles
every transaction of earlier runs before the first batch (commit, abort,
sweep).

**Why the announcement carries the name.** The registry is keyed by
transactional id, so a reused id's announcement replaces the previous one (which
ended), and a batch can no longer be read from an id: each announcement carries
its transaction's name (batch, partition, attempt, run, incarnation).

**Who may bump an id's epoch.** InitProducerId on an id aborts whatever
transaction is open on it, whatever epoch the request names, so:

* a task's own InitProducerId runs only on an id of its lane, which no other
  batch holds; before it (before every attempt of it), the writer asks
  DescribeTransactions and refuses an id whose transaction is open (an attempt
  of an earlier lease that started late: a zombie), failing its own attempt
  instead of aborting another's prepared work. The window left is one
  InitProducerId in flight. Ids are pooled only on a broker that answers
  DescribeTransactions (Kafka 3.0 and later; not tansu): elsewhere every
  transaction has an id of its own, as before;
* once batches run, the driver fences a pooled id only at a known epoch
  (:func:`sinks.kafka.txn.fence_own`): to end an orphan (an announced
  transaction no ledger entry owns) or abort a batch, it asks
  DescribeTransactions and sends InitProducerId with the transaction's own
  producer id and epoch only while the id is at that epoch; a newer epoch (a
  later lease's transaction) is left alone. The bump is the point: an
  EndTxn(abort) with that epoch would end the transaction without it, and a
  zombie of the attempt (a speculative copy, a task Spark gave up on) would go
  on to open another transaction with the same epoch, never announced, that
  no sweep finds. Once fenced, its AddPartitionsToTxn and its produce are
  refused. The window left: the transaction ends between the
  DescribeTransactions and the InitProducerId (its attempt aborts it, or the
  broker at its timeout) and a writer begins another on the id in between,
  which the InitProducerId then aborts, as a timeout would. Writers refuse an
  open id and a lane is leased again only once the broker shows none of its
  ids open, so that writer can only be a later lease's, on a lane whose orphan
  began after its release (an attempt of an earlier lease that started late).
  Recovery, at a start before the first lease, fences pooled ids blindly as it
  fences every id: nothing of this run holds one yet, and the bumped epoch
  stops zombies of the last.

A release waits for the tombstones of the lane's ids too: a tombstone written
after a new announcement of the id would hide that one from the sweep.
Downgrading to a version before the pool strands its ids (that version cannot
read them): finish or stop the job with this one first.

Ids of the first two name formats (one per transaction, ``tp1.``/``tp2.``)
still commit, abort and sweep as before; writers opened without a lease (the
sink's API used directly, outside a job) name their transaction that way.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sinks.base import JobScope

_POOLED = re.compile(r"\.l(?P<lane>\d+)\.p(?P<partition>\d+)\.a(?P<attempt>\d+)$")


def pooled_id(id_prefix: str, scope: JobScope, lane: int, partition: int, attempt: int) -> str:
    """The transactional id of ``partition``'s attempt number ``attempt`` in ``lane``."""
    assert scope.incarnation is not None, "pooled ids belong to an incarnation"
    return (
        f"{id_prefix}tp3.{scope.job}.{scope.pipeline}.{scope.sink_id}.i{scope.incarnation}"
        f".l{lane}.p{partition}.a{attempt}"
    )


def pool_prefix(id_prefix: str, scope: JobScope) -> str:
    """The prefix of every pooled id of ``scope``."""
    return f"{id_prefix}tp3.{scope.job}.{scope.pipeline}.{scope.sink_id}.i{scope.incarnation}."


def lane_of(transactional_id: str, id_prefix: str) -> int | None:
    """The lane of a pooled id (None for an id of the earlier formats)."""
    if not transactional_id.startswith(id_prefix + "tp3."):
        return None
    found = _POOLED.search(transactional_id)
    return int(found["lane"]) if found else None


@dataclass
class _Lease:
    batch: int
    settled: bool = False


class IdPool:
    """The lanes of one sink, on the driver (module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[tuple[str, int], _Lease] = {}  # (scope key, lane) -> lease
        self._lanes: dict[str, int] = {}  # scope key -> lanes ever made
        self._leasing: set[str] = set()  # scope keys that leased since the last reset
        self._seen: dict[tuple[str, int], set[str]] = {}  # (scope key, lane) -> pooled ids

    def lease(self, scope: JobScope, batch: int, busy: Iterable[int] = ()) -> int:
        """A lane for ``batch`` of ``scope``: the lowest lane neither leased nor
        in ``busy`` (lanes with ids the registry still shows), else a new one.
        A batch written again in the same run gets another lane: the tasks of
        its earlier run may still be alive on the first."""
        key = scope.key()
        with self._lock:
            self._leasing.add(key)
            taken = {lane for (k, lane) in self._leases if k == key} | set(busy)
            lane = next(i for i in range(self._lanes.get(key, 0) + 1) if i not in taken)
            self._lanes[key] = max(self._lanes.get(key, 0), lane + 1)
            self._leases[(key, lane)] = _Lease(batch)
            return lane

    def settle(self, scope: JobScope, through_batch: int) -> None:
        """Every batch of ``scope`` up to ``through_batch`` is settled."""
        key = scope.key()
        with self._lock:
            for (k, _), held in self._leases.items():
                if k == key and held.batch <= through_batch:
                    held.settled = True

    def remember(self, scope: JobScope, transactional_ids: Iterable[str], id_prefix: str) -> None:
        """Note the pooled ids of ``scope`` among ``transactional_ids`` (others are
        ignored), by lane: :meth:`seen` names them before their lane is released."""
        prefix = pool_prefix(id_prefix, scope)
        key = scope.key()
        with self._lock:
            for tid in transactional_ids:
                lane = lane_of(tid, id_prefix) if tid.startswith(prefix) else None
                if lane is not None:
                    self._seen.setdefault((key, lane), set()).add(tid)

    def seen(self, scope: JobScope, lanes: Iterable[int]) -> Mapping[str, int]:
        """``{transactional id: lane}`` of every id :meth:`remember` noted in
        ``lanes`` of ``scope``."""
        key = scope.key()
        with self._lock:
            return {tid: lane for lane in lanes for tid in self._seen.get((key, lane), ())}

    def releasable(self, scope: JobScope, busy: Iterable[int]) -> list[int]:
        """The lanes :meth:`release` would return to the pool now."""
        key = scope.key()
        busy = set(busy)
        with self._lock:
            return sorted(
                lane
                for (k, lane), held in self._leases.items()
                if k == key and held.settled and lane not in busy
            )

    def release(self, scope: JobScope, busy: Iterable[int]) -> list[int]:
        """Return to the pool every settled lane of ``scope`` not in ``busy``
        (lanes whose ids the registry shows open or not yet tombstoned, or the
        broker open); the lanes released."""
        key = scope.key()
        busy = set(busy)
        with self._lock:
            done = [
                lane
                for (k, lane), held in self._leases.items()
                if k == key and held.settled and lane not in busy
            ]
            for lane in done:
                del self._leases[(key, lane)]
            return done

    def reset(self, scope: JobScope) -> None:
        """Forget ``scope``'s leases and the ids seen in them (a job starts:
        nothing of an earlier run is in flight once recovery has run)."""
        key = scope.key()
        with self._lock:
            for k, lane in [k for k in self._leases if k[0] == key]:
                del self._leases[(k, lane)]
            for k, lane in [k for k in self._seen if k[0] == key]:
                del self._seen[(k, lane)]
            self._leasing.discard(key)

    def leasing(self, scope: JobScope) -> bool:
        """Whether ``scope`` leased a lane since the job started: until then
        (recovery) no task holds a pooled id, and fencing one is safe."""
        with self._lock:
            return scope.key() in self._leasing

    def size(self, scope: JobScope) -> int:
        """How many lanes ``scope`` has made (the pool's size, in lanes)."""
        with self._lock:
            return self._lanes.get(scope.key(), 0)
