"""The Kafka committer's claims and progress: who may commit to a topic, and
what it committed.

:class:`RegistryClaims` gives :class:`~sinks.kafka.committer.KafkaCommitter`
its ``claim``, ``progress`` and ``forget`` (progress records, then tombstones
of the announcements they replace), all read and written in the sink's registry
topic (:mod:`sinks.kafka.progress` says how claims are ordered and what
survives a crash). Without a registry (``registry_topic=None``) the sink keeps
no progress and holds no claim, and says so.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from sinks._retry import retry_transient
from sinks.committer import Committable
from sinks.kafka.connections import DriverConnections
from sinks.kafka.pool import IdPool
from sinks.kafka.progress import ProgressStore
from sinks.kafka.registry import write_tombstones
from sinks.kafka.wire import TRANSIENT
from sinks.naming import TxnName
from sinks.progress import SinkProgress
from sinks.scope import JobScope

log = logging.getLogger("sinks.kafka")

REGISTRY_TIMEOUT_S = 30.0
"""seconds a write to the registry (a claim, progress records, tombstones) waits
for its acknowledgement"""


class RegistryClaims:
    """Claims and progress in the registry topic (a mixin of the Kafka committer)."""

    # (claim, then progress, then forget: in the order a job calls them)

    where: str
    commit_timeout: float
    conns: DriverConnections
    store: ProgressStore | None
    pool: IdPool

    def progress(self, scope: JobScope) -> SinkProgress:
        """The owner of ``scope`` and the highest batch it committed, as the
        registry says; no owner without a registry."""
        store = self.store
        if store is None:
            return SinkProgress(owner=None)

        def read() -> SinkProgress:
            with self.conns.wire() as wire:
                return store.read(wire, scope)

        return retry_transient(
            read,
            what=f"read of the progress of {scope.key()} in {self.where}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )

    def claim(self, scope: JobScope, *, start_over_from: str | None = None) -> SinkProgress:
        """Append a claim record for ``scope.incarnation`` unless it holds the
        claim already (:meth:`~sinks.kafka.progress.ProgressStore.claim`); the
        pool of ids starts afresh (recovery ends every earlier transaction
        first)."""
        ours = scope.incarnation
        assert ours is not None
        self.pool.reset(scope)
        store = self.store
        if store is None:
            log.warning(
                "%s: registry_topic=None, so this sink keeps no progress and holds no claim: "
                "nothing stops another copy of job %s writing the same topic",
                self.where,
                scope.job,
            )
            return SinkProgress(owner=ours)
        nonce = uuid.uuid4().hex[:16]  # one per claim: a retry appends the same claim

        def claim() -> SinkProgress:
            with self.conns.wire() as wire, self.conns.producer() as producer:
                return store.claim(
                    wire, producer, scope, start_over_from, nonce, REGISTRY_TIMEOUT_S
                )

        return retry_transient(
            claim,
            what=f"claim of {scope.key()} in {self.where}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )

    # -- forget: progress records and tombstones ----------------------------------------------

    def forget(self, committables: Sequence[Committable]) -> None:
        """Record the committed batches in a progress record, then tombstone
        their announcements (which said the same until then)."""
        ids = sorted({c["transactional_id"] for c in committables})
        names = [TxnName.require(c["txn"]) for c in committables]
        if ids and self._record_committed(names):
            self._tombstone(ids)

    def _record_committed(self, names: list[TxnName], *, as_named: bool = False) -> bool:
        """Append the progress records of the committed transactions ``names``
        (see :meth:`ProgressStore.record_committed`); False (and the
        announcements must stay) when they could not be written."""
        store = self.store
        if store is None:
            return True
        try:
            with self.conns.wire() as wire, self.conns.producer() as producer:
                store.record_committed(wire, producer, names, REGISTRY_TIMEOUT_S, as_named=as_named)
        except Exception as e:
            log.warning(
                "could not record the progress of %d committed transaction(s) in registry %s "
                "(%r); their announcements stay and say the same",
                len(names),
                store.registry,
                e,
            )
            return False
        return True

    def _tombstone(self, ids: list[str]) -> None:
        """Mark ids resolved in the registry. Best effort: a missed tombstone only
        makes a later sweep see an already finished id again (harmless)."""
        if not ids or self.store is None:
            return
        try:
            with self.conns.producer() as producer:
                write_tombstones(producer, self.store.registry, ids, timeout_s=REGISTRY_TIMEOUT_S)
        except Exception as e:
            log.warning(
                "could not tombstone %d id(s) in registry %s (%r); harmless, a later sweep retries",
                len(ids),
                self.store.registry,
                e,
            )
            return
        self.store.view.forget(ids)
