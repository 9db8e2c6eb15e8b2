"""The Kafka committer's leases: a lane of pooled transactional ids per batch.

:class:`PooledLanes` is the :class:`~sinks.capabilities.LeasesIds` capability
of :class:`~sinks.kafka.committer.KafkaCommitter`: before a batch's tasks
start, :meth:`~PooledLanes.lease` gives it a lane no earlier batch still holds
(:mod:`sinks.kafka.pool` says how ids are named and why they are bounded), and
:meth:`~PooledLanes.settled` gives lanes back once their batches are decided
and the broker shows none of their ids open.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sinks.capabilities import LeasesIds
from sinks.kafka import txn
from sinks.kafka.connections import DriverConnections
from sinks.kafka.pool import IdPool, lane_of, pool_prefix
from sinks.kafka.progress import ProgressStore
from sinks.scope import JobScope

log = logging.getLogger("sinks.kafka")


class PooledLanes(LeasesIds):
    """Leases lanes of pooled ids to batches (a mixin of the Kafka committer)."""

    where: str
    id_prefix: str
    conns: DriverConnections
    store: ProgressStore | None
    pool: IdPool
    pooled_ids: Callable[[], bool]
    """whether the broker answers DescribeTransactions (found at preflight)"""

    def lease(self, scope: JobScope, batch_id: int) -> int | None:
        """The lane of pooled transactional ids ``batch_id``'s writers use; None
        (an id per transaction, as before the pool) on a broker that cannot
        describe a transaction (tansu, Kafka before 3.0: a writer could not
        tell another's open transaction on its id) or for a ledger that never
        claimed."""
        if scope.incarnation is None or not self.pooled_ids():
            return None
        return self.pool.lease(scope, batch_id, self._busy_lanes(scope))

    def settled(self, scope: JobScope, through_batch: int) -> None:
        """Release the lanes of settled batches once their ids have ended: the
        registry (as last read) shows none of them, and the broker none open
        (DescribeTransactions of every id the pool has seen in the lanes about
        to be released: a transaction a zombie opened after the driver ended
        its attempt's was never announced). A lane found open, or that could
        not be asked about, stays leased; the next checkpoint's settle asks
        again."""
        self.pool.settle(scope, through_batch)
        busy = self._busy_lanes(scope)
        seen = self.pool.seen(scope, self.pool.releasable(scope, busy))
        if seen:
            try:
                with self.conns.wire() as wire:
                    still_open = txn.open_ids(wire, seen) or {}
            except Exception as e:
                log.warning(
                    "%s: could not ask the broker whether lanes %s of %s hold open "
                    "transactions (%r); they stay leased until a later settle",
                    self.where,
                    sorted(set(seen.values())),
                    scope,
                    e,
                )
                busy |= set(seen.values())
            else:
                if still_open:
                    ongoing = any(s.state == "Ongoing" for s in still_open.values())
                    log.log(
                        logging.WARNING if ongoing else logging.INFO,
                        "%s: lanes %s of %s stay leased: the broker shows open transactions "
                        "on their ids: %s",
                        self.where,
                        sorted({seen[t] for t in still_open}),
                        scope,
                        sorted(still_open.items())[:5],
                    )
                busy |= {seen[t] for t in still_open}
        released = self.pool.release(scope, busy)
        if released:
            log.debug("%s: lanes %s of %s back in the pool", self.where, released, scope)

    def _busy_lanes(self, scope: JobScope) -> set[int]:
        """Lanes of ``scope`` with an id the registry (as last read) still shows:
        its transaction open, or ended and not yet tombstoned (a tombstone
        written after a new announcement of the id would hide that one). The
        pool remembers those ids (:meth:`settled` asks the broker about them)."""
        if self.store is None:
            return set()
        prefix = pool_prefix(self.id_prefix, scope)
        live = [tid for tid in self.store.view.live() if tid.startswith(prefix)]
        self.pool.remember(scope, live, self.id_prefix)
        return {lane for tid in live for lane in [lane_of(tid, self.id_prefix)] if lane is not None}

    def pool_size(self, scope: JobScope) -> int:
        """How many lanes of pooled ids ``scope`` has used in this run."""
        return self.pool.size(scope)
