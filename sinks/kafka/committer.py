"""The driver side of the Kafka sink: its :class:`~sinks.committer.Committer`.

Commit, abort, classify, sweep and forget prepared transactions here; claims
and progress (:mod:`sinks.kafka.claims`) and the lanes of pooled ids
(:mod:`sinks.kafka.lanes`) are mixed in.

Commit and abort (:mod:`sinks.kafka.txn`): the transaction is resumed by EndTxn
(never ``init_transactions()``, which aborts), idempotently, the transactions
of a checkpoint over a few connections at once, each connection's first alone
and the others' EndTxn sent a few at a time without waiting for each answer
(:func:`sinks.kafka.txn.commit_each`); any refusal is settled from the
control markers in the log, and so is a success answered to a retry (a broker
that died inside an EndTxn may answer success without having written every
marker). Abort fences (InitProducerId). Retried (tenacity) on retriable errors
and dropped connections, bounded by ``commit_timeout``.

Lingering transactions (``sweep``): the driver cannot list them from
Kafka portably (ListTransactions needs Kafka 3.0+ and DESCRIBE rights; tansu
lacks it) nor derive them (Spark task attempt ids are not enumerable). Every
writer therefore announces its transactional id in a registry topic before it
writes data (:mod:`sinks.kafka.registry`); the sweep reads the registry
incrementally, asks ``is_orphan`` about each id announced for this topic under
``scope.own_prefixes()`` (this incarnation's, and first-format names: never
another incarnation's, unless the coordinator passes that incarnation's scope
after a start-over), ends the orphans and tombstones them once the registry
shows them aborted. An orphan is ended by a fence: a pooled id while batches
run only at the transaction's known producer id and epoch
(:func:`sinks.kafka.txn.fence_own`: a later lease may hold the id; the bumped
epoch stops a zombie of the attempt from opening a transaction no registry
entry names), any other id, and every id at recovery, blindly. Limits:
``registry_topic=None`` disables the sweep (Apache Kafka then aborts orphans
only after ``transaction.timeout.ms``; until then they hold back
read_committed consumers) and the memory of progress below;
every transactional id leaves coordinator state for
``transactional.id.expiration.ms`` (7 days by default): with the pool, lanes
x partitions x attempts of them; without it, one per task and batch.
A future option on Apache Kafka >= 3.0: ListTransactions (state Ongoing) as a
second source of candidates.

What is committed (:mod:`sinks.kafka.progress`): a writer's announcement is the
first record of its own transaction, so its COMMIT marker proves the batch
committed, atomically with the data. ``forget`` (after the ledger recorded the
commit) first appends a progress record ``{incarnation, batch}`` (acks=all,
waited for), then tombstones the announcements. The highest committed batch is
the max of the owner's progress record and its committed announcements still
there.

Guarantees across a crash at any instant: a batch's data and its announcement
commit together; the progress record is durable before its announcements are
tombstoned, so one of them always says the batch committed (a sweep that finds
a committed announcement left by a missed ``forget`` records its progress
before tombstoning it). Before each commit the claim (:mod:`sinks.kafka.claims`)
is re-read (incrementally): another owner refuses the commit (``at_commit``),
and committables of a batch at or below this incarnation's progress record are
replays: fenced, never committed (a retried commit of the same transactions
stays idempotent, since the progress record is written only after the commit
completed). Limits: the registry must keep its records: compaction is safe
(claims have unique keys, progress keys keep their latest record, announcements
go only after their progress record), but ``cleanup.policy=delete`` with a
retention would forget claims and progress, and deleting the registry topic
forgets everything (``registry_topic=None`` likewise keeps nothing). The check
before a commit and the EndTxn are two steps: a takeover between them is caught
at the next commit.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sinks import _faults
from sinks._parallel import slices
from sinks._retry import retry_transient
from sinks.audit import CheckpointEvidence, Finding
from sinks.capabilities import Audits
from sinks.committer import REPAYS, Committable, Committer, LingeringTxn, OrphanTest, Outcome
from sinks.errors import REWRITE_ADVICE, TransactionLostError
from sinks.kafka import audit as kafka_audit
from sinks.kafka import outcome, txn, txn_age
from sinks.kafka.claims import RegistryClaims
from sinks.kafka.connections import DriverConnections
from sinks.kafka.lanes import PooledLanes
from sinks.kafka.pool import IdPool, lane_of
from sinks.kafka.progress import ProgressStore
from sinks.kafka.registry import (
    ABORTED,
    COMMITTED,
    OPEN,
    Announcement,
    announced_name,
)
from sinks.kafka.wire import TRANSIENT, KafkaWire
from sinks.naming import TxnName, scope_prefixes
from sinks.scope import JobScope

log = logging.getLogger("sinks.kafka")


@dataclass
class KafkaCommitter(RegistryClaims, PooledLanes, Audits, Committer):
    """Commits, aborts, classifies and sweeps one Kafka sink's transactions, and
    records what committed in the sink's registry topic.

    Lives on the driver only: :meth:`KafkaSink.committer
    <sinks.kafka.sink.KafkaSink.committer>` makes it with the sink's
    driver-side state (connections, progress store, pool of ids)."""

    where: str
    """the sink, for messages"""
    sink_id: str
    topic: str
    """the target topic: only its announcements are swept"""
    id_prefix: str
    """the sink's ``transactional_id_prefix`` (or ``""``)"""
    transaction_timeout_ms: int
    commit_timeout: float
    commit_connections: int
    conns: DriverConnections
    store: ProgressStore | None
    """None without a registry topic: no progress, no sweep, no tombstones"""
    pool: IdPool
    pooled_ids: Callable[[], bool]
    """whether the broker answers DescribeTransactions (found at preflight)"""

    # -- commit ---------------------------------------------------------------------------

    def commit(self, committables: Sequence[Committable]) -> None:
        """EndTxn(commit) for every transaction of ``committables``, batch by
        batch in ascending order; replays of batches this sink holds committed
        are fenced instead, and tombstoned.

        Before the first EndTxn, every transaction is checked with the broker
        (:meth:`_check_alive`): when one is gone, none is committed and
        :class:`TransactionLostError` names the lost ones (the coordinator then
        owes their batches, rule 5). One can still be lost between that check
        and its EndTxn (it reaches its timeout in between): the commit then
        raises having committed part of the batch, and never any of a later
        batch, so that only the lost tasks' share is owed."""
        pending = {c["transactional_id"]: c for c in committables}
        if not pending:
            return
        txn_age.check_at_commit(self.where, committables, timeout_ms=self.transaction_timeout_ms)
        total = len(pending)
        replayed: list[str] = []
        done = itertools.count(1)
        failed = False  # an attempt failed: the broker may have died inside an EndTxn
        checked = False

        def attempt() -> None:
            nonlocal failed
            try:
                commit_pending()
            except BaseException:
                failed = True
                raise

        def commit_pending() -> None:
            nonlocal checked
            with self.conns.wire() as wire:
                # one request per attempt, for the broker check and the commits
                coordinators.update(wire.find_coordinators(list(pending)))
                if not checked:  # a retry goes on where the last attempt stopped
                    self._check_alive(wire, list(pending.values()), coordinators)
                    checked = True
                ordinary = {t: c for t, c in pending.items() if not c.get(REPAYS)}
                replays = self.store.replays(wire, ordinary) if self.store else []
                if replays:
                    log.warning(
                        "%s: %d transaction(s) re-write batches this sink holds committed "
                        "already (a replay); aborting them instead of committing: %s",
                        self.where,
                        len(replays),
                        replays[:5],
                    )
                    self._fence(wire, list(replays))
                    for tid in replays:
                        del pending[tid]
                    replayed.extend(replays)
                by_batch: dict[int, list[str]] = {}
                for tid, c in pending.items():
                    by_batch.setdefault(_batch_of(c), []).append(tid)
                for batch in sorted(by_batch):
                    parts = slices(sorted(by_batch[batch]), most=self.commit_connections)
                    self.conns.each(wire, parts, commit_part, "commit")

        coordinators: dict[str, Any] = {}

        def commit_part(wire: KafkaWire, part: list[str]) -> None:
            def committed(c: Committable) -> None:
                del pending[c["transactional_id"]]  # distinct keys per thread: a retry skips it
                if next(done) == 1 and total > 1:
                    _faults.hit("driver.mid_commit", sink="kafka")

            txn.commit_each(
                wire,
                coordinators,
                [pending[tid] for tid in part],
                where=self.where,
                timeout_ms=self.transaction_timeout_ms,
                verify=failed,
                committed=committed,
            )

        retry_transient(
            attempt,
            what=f"commit of {total} transaction(s) to {self.where}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )
        self._tombstone(replayed)

    def _check_alive(
        self, wire: KafkaWire, committables: list[Committable], coordinators: dict[str, Any]
    ) -> None:
        """Raise :class:`TransactionLostError`, naming every lost transaction,
        when one of ``committables`` ended without a commit: asked of the
        broker (DescribeTransactions: open or committed with the transaction's
        own producer id and epoch), then, for the ones it does not vouch for,
        of the log (:mod:`sinks.kafka.outcome`), never of a clock. On a broker
        that cannot describe transactions (tansu), EndTxn's refusal is
        settled from the log instead, one transaction at a time."""
        verdicts = outcome.verdicts(wire, committables, coordinators)
        if verdicts is None:
            return
        lost = [c for c in committables if verdicts[c["txn"]] == Outcome.LOST]
        if not lost:
            return
        raise TransactionLostError(
            f"{self.where}: {len(lost)} of the {len(committables)} Kafka transaction(s) to "
            "commit ended without a commit (the broker aborted them at transaction_timeout_ms="
            f"{self.transaction_timeout_ms}, or another producer used their transactional "
            "id): "
            + ", ".join(
                f"{c['txn']} ("
                + (
                    f"transactional id {c['transactional_id']}, "
                    if c["transactional_id"] != c["txn"]
                    else ""
                )
                + f"{c.get('rows', '?')} rows)"
                for c in lost[:5]
            )
            + (" ..." if len(lost) > 5 else "")
            + ". None of the transactions was committed. "
            + REWRITE_ADVICE
        )

    def classify(self, committables: Sequence[Committable]) -> dict[str, Outcome]:
        """COMMITTED, PREPARED or LOST for each of ``committables``: the broker,
        then the log (:func:`sinks.kafka.outcome.verdicts`); on a broker that
        cannot describe transactions, the log alone."""

        def read() -> dict[str, Outcome]:
            with self.conns.wire() as wire:
                found = outcome.verdicts(wire, committables)
                if found is None:
                    found = {c["txn"]: outcome.verdict_of(wire, c) for c in committables}
                return found

        return retry_transient(
            read,
            what=f"check of {len(committables)} transaction(s) in {self.where}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )

    # -- abort and sweep --------------------------------------------------------------------

    def _fence(self, wire: KafkaWire, transactional_ids: list[str]) -> None:
        txn.fence(wire, transactional_ids, self.transaction_timeout_ms)

    def _at_known_epoch(self, transactional_id: str, scope: JobScope) -> bool:
        """Whether ``transactional_id`` is a pooled id that a task of this run may
        hold now: it is fenced only at its transaction's own producer id and
        epoch (:func:`sinks.kafka.txn.fence_own`), never blindly."""
        return lane_of(transactional_id, self.id_prefix) is not None and self.pool.leasing(scope)

    def abort(self, committables: Sequence[Committable]) -> None:
        """End every transaction of ``committables``: a pooled id by a fence at
        its own producer id and epoch, any other by a blind fence; then
        tombstone them."""
        ids = sorted({c["transactional_id"] for c in committables})
        if not ids:
            return
        # a pooled id is fenced at its own producer id and epoch (sinks/kafka/pool.py)
        own: dict[str, tuple[int, int]] = {}
        for c in committables:
            n = TxnName.require(c["txn"])
            scope = JobScope(n.job, n.pipeline, n.sink_id, n.incarnation)
            if self._at_known_epoch(c["transactional_id"], scope):
                own[c["transactional_id"]] = (int(c["producer_id"]), int(c["epoch"]))
                self.pool.remember(scope, [c["transactional_id"]], self.id_prefix)
        legacy = [t for t in ids if t not in own]
        parts = slices(legacy, most=self.commit_connections)  # fence() empties them as it goes

        def attempt() -> None:
            with self.conns.wire() as wire:
                txn.fence_own(wire, own, self.transaction_timeout_ms)  # empties it as it goes
                self.conns.each(wire, [p for p in parts if p], self._fence, "abort")

        retry_transient(
            attempt,
            what=f"abort of {len(ids)} transaction(s) in {self.where}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )
        self._tombstone(ids)

    def _announced(
        self, wire: KafkaWire, prefixes: tuple[str, ...]
    ) -> dict[str, tuple[TxnName, Announcement]]:
        """Every transactional id announced for this topic whose transaction's
        name starts with one of ``prefixes`` and not tombstoned, read from the
        registry (incrementally), with its name and how it ended."""
        assert self.store is not None
        live = self.store.view.refresh(wire)
        found: dict[str, tuple[TxnName, Announcement]] = {}
        for tid, a in sorted(live.items()):
            if a.topic != self.topic:
                continue
            name = announced_name(tid, a, self.id_prefix)
            if name is not None and str(name).startswith(prefixes):
                found[tid] = (name, a)
        return found

    def lingering(self, job: str, pipeline: str) -> list[LingeringTxn]:
        """Every transactional id of (``job``, ``pipeline``, this sink) announced
        in the registry for this topic and not yet tombstoned, of every
        incarnation: open, or ended (committed or aborted) with the tombstone
        still to come. Empty without a registry (nothing can be listed)."""
        store = self.store
        if store is None:
            return []

        def read() -> dict[str, tuple[TxnName, Announcement]]:
            with self.conns.wire() as wire:
                return self._announced(wire, scope_prefixes(job, pipeline, self.sink_id))

        found = retry_transient(
            read,
            what=f"listing of announced transactions in {self.where}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )
        return [
            LingeringTxn(
                str(name),
                name,
                a.state,
                (f"transactional id {tid}, " if tid != str(name) else "")
                + f"producer id {a.producer_id}, epoch {a.epoch}, announced on registry "
                f"partition {a.partition}",
            )
            for tid, (name, a) in found.items()
        ]

    def sweep(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        """Fence the orphans among the ids of ``scope.own_prefixes()`` announced
        for this topic; tombstone them once the registry shows them aborted.

        An orphan found committed (its ``forget`` was missed: a crash between the
        ledger's record and ``forget``) is not fenced: its progress is recorded
        under the incarnation in its name (never the one this sink claimed: after
        a start-over they differ), then it is tombstoned."""
        store = self.store
        if store is None:
            return []

        orphans_named: dict[str, TxnName] = {}

        def sweep_once() -> tuple[list[TxnName], dict[str, Announcement]]:
            with self.conns.wire() as wire:
                announced = self._announced(wire, scope.own_prefixes())
                self.pool.remember(scope, announced, self.id_prefix)  # lanes ask the broker
                orphans = {t: n for t, (n, _) in announced.items() if is_orphan(n)}
                orphans_named.update(orphans)
                # (an orphan that ended already needs no fence: its writer aborted it, or
                # the broker did at its timeout, bumping the epoch)
                ending = [t for t in sorted(orphans) if announced[t][1].state == OPEN]
                # a pooled id may be leased to a batch in flight (now, or by the time
                # a fence lands): fence it only at the orphan's own producer id and
                # epoch, which also stops a zombie of the orphan (sinks/kafka/pool.py)
                pooled = [t for t in ending if self._at_known_epoch(t, scope)]
                if pooled:
                    own = {t: announced[t][1].own_epoch() for t in pooled}
                    txn.fence_own(wire, own, self.transaction_timeout_ms)
                fenced = [t for t in ending if t not in pooled]
                if fenced:
                    self._fence(wire, list(fenced))  # fenced twice after a retry: harmless
                live = store.view.refresh(wire)  # the markers of the ended ones
                return [orphans[t] for t in ending], {t: live[t] for t in orphans if t in live}

        ended, found = retry_transient(
            sweep_once,
            what=f"sweep of lingering transactions in {self.where}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )
        committed = [t for t, a in found.items() if a.state == COMMITTED]
        if committed and self._record_committed(
            [orphans_named[t] for t in committed], as_named=True
        ):
            self._tombstone(committed)
        self._tombstone(sorted(t for t, a in found.items() if a.state == ABORTED))
        aborted = sorted(str(n) for n in ended)
        if aborted:
            log.info("aborted %d lingering Kafka transaction(s): %s", len(aborted), aborted)
        return aborted

    # -- audits ----------------------------------------------------------------------------

    def evidence(self, committable: Committable) -> dict[str, Any]:
        return kafka_audit.evidence(committable)

    def audit(self, scope: JobScope, checkpoints: Sequence[CheckpointEvidence]) -> list[Finding]:
        with self.conns.wire() as wire:
            return kafka_audit.audit(wire, checkpoints)


def _batch_of(committable: Committable) -> int:
    return TxnName.require(committable["txn"]).batch_id
