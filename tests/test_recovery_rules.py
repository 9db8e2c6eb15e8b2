"""The coordinator's recovery rules, against a ledger and Spark commit logs on disk.

The sink here is a recording implementation of our own protocol (it keeps a
set of "prepared" names in memory), so every decision can be observed
directly; the PostgreSQL sink runs the same rules in the crash tests. Every
test runs against both ledger backends (``ledger_factory``: ``[file]``, then
``[postgres]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from lifecycle.coordinator import Coordinator
from lifecycle.errors import CheckpointCommitError, RecoveryRefusedError
from lifecycle.job_sinks import PipelineSinks
from lifecycle.ledger import Ledger
from lifecycle.spark_log import SparkCommitLog
from sinks.base import (
    Committable,
    JobScope,
    OrphanTest,
    Outcome,
)
from sinks.errors import ConfigError, TransactionLostError
from sinks.naming import TxnName
from tests.ledgers import LedgerBackend
from tests.memory_sink import MemorySink


class RecordingSink(MemorySink):
    """A sink in memory that records what it prepared, committed and aborted."""

    kind = "recording"

    def __init__(self) -> None:
        super().__init__("s")
        self.prepared: set[str] = set()
        self.committed: list[str] = []
        self.aborted: list[str] = []

    def classify(self, committables: Sequence[Committable]) -> dict[str, Outcome]:
        return {
            c["txn"]: Outcome.COMMITTED
            if c["txn"] in self.committed
            else Outcome.PREPARED
            if c["txn"] in self.prepared
            else Outcome.LOST
            for c in committables
        }

    def commit(self, committables: Sequence[Committable]) -> None:
        for c in committables:
            if c["txn"] in self.prepared:
                self.prepared.discard(c["txn"])
                self.committed.append(c["txn"])
            else:
                assert c["txn"] in self.committed, f"{c['txn']} lost"

    def abort(self, committables: Sequence[Committable]) -> None:
        for c in committables:
            if c["txn"] in self.prepared:
                self.prepared.discard(c["txn"])
                self.aborted.append(c["txn"])

    def sweep(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        gone = []
        for name in sorted(self.prepared):
            n = TxnName.parse(name)
            if n and name.startswith(scope.own_prefixes()) and is_orphan(n):
                gone.append(name)
        self.abort([{"txn": g} for g in gone])
        return gone


_INCARNATION: list[str] = []  # the ledger's of the running test (see the fixture)


def txn(batch: int, part: int = 0, run: int = 1, attempt: int = 0, inc: str | None = None) -> str:
    return str(TxnName("j", "p", "s", run, batch, part, attempt, inc or _INCARNATION[-1]))


def spark_completed(loc: Path, upto: int) -> None:
    (loc / "commits").mkdir(parents=True, exist_ok=True)
    (loc / "metadata").write_text("{}")
    for b in range(upto + 1):
        (loc / "commits" / str(b)).write_text("v1\n{}")


@dataclass
class World:
    """One pipeline ``p`` with one recording sink, a ledger and a Spark checkpoint."""

    sink: RecordingSink
    ledger: Ledger
    loc: Path

    def coordinator(self) -> Coordinator:
        return Coordinator(
            "j", self.ledger, [PipelineSinks("p", {"s": self.sink}, SparkCommitLog(self.loc))]
        )

    def register(self, batch: int, parts: int = 2) -> list[str]:
        names = [txn(batch, i) for i in range(parts)]
        self.sink.prepared.update(names)
        self.ledger.record_batch("p", batch, {"s": [{"txn": n, "rows": 1} for n in names]})
        return names

    def spark_completed(self, upto: int) -> None:
        spark_completed(self.loc, upto)


@pytest.fixture
def world(tmp_path: Path, ledger_factory: LedgerBackend) -> World:
    ledger = ledger_factory.open()
    _INCARNATION.append(ledger.incarnation)  # names in these tests are built with it
    ledger.begin_run()
    return World(RecordingSink(), ledger, tmp_path / "spark")


def test_spark_completed_batches_commit_and_the_rest_abort(world: World) -> None:
    sink = world.sink
    ledger = world.ledger
    b0, b1, b2 = world.register(0), world.register(1), world.register(2)
    world.spark_completed(1)  # Spark wrote commits/0 and commits/1, not commits/2
    world.coordinator().recover()
    assert sorted(sink.committed) == sorted(b0 + b1)
    assert sorted(sink.aborted) == sorted(b2)
    assert ledger.pending() == {} and ledger.decided() is None
    assert [cp.kind for cp in ledger.history()] == ["recovery"]
    assert ledger.history()[0].cut == {"p": 1}


def test_a_decided_checkpoint_is_finished_first(world: World) -> None:
    sink = world.sink
    ledger = world.ledger
    b0 = world.register(0)
    world.spark_completed(0)
    cp = ledger.decide("periodic", {"p": 0}, [])
    sink.committer().commit([{"txn": b0[0]}])  # crash in the middle of committing
    world.coordinator().recover()
    assert sorted(sink.committed) == sorted(b0)
    assert [c.id for c in ledger.history()] == [cp.id]
    assert ledger.history()[0].kind == "periodic"


def test_unowned_prepared_work_is_swept(world: World) -> None:
    sink = world.sink
    owned = world.register(0)
    # a failed attempt of batch 0, a crash before registration of batch 1,
    # a zombie of an earlier run
    orphans = [txn(0, 0, attempt=9), txn(1, 0), txn(0, 0, run=0)]
    sink.prepared.update(orphans)
    world.spark_completed(0)
    world.coordinator().recover()
    assert sorted(sink.committed) == sorted(owned)
    assert sorted(sink.aborted) == sorted(orphans)
    assert sink.prepared == set()


def test_the_sweep_never_touches_another_incarnation(world: World) -> None:
    """Two copies of a job (two state_dirs) writing one server: neither sweeps the
    other's prepared work; first-format work (before an upgrade) is this ledger's."""
    sink = world.sink
    other = [txn(0, 0, inc="ba9876543210"), txn(5, 1, run=0, inc="ba9876543210")]
    legacy = str(TxnName("j", "p", "s", 0, 0, 0, 0))
    sink.prepared.update([*other, legacy])
    world.spark_completed(0)
    world.coordinator().recover()
    assert sorted(sink.aborted) == [legacy]
    assert sink.prepared == set(other)


def test_checkpoint_sweeps_only_at_or_below_its_cut(world: World) -> None:
    sink = world.sink
    world.register(0)
    in_flight = txn(1, 0)  # batch 1 is being written: not an orphan yet
    failed = txn(0, 1, attempt=7)
    sink.prepared.update([in_flight, failed])
    world.spark_completed(0)
    cp = world.coordinator().checkpoint()
    assert cp is not None and cp.cut == {"p": 0}
    assert failed in sink.aborted and in_flight in sink.prepared


def test_a_final_checkpoint_with_nothing_to_commit_still_sweeps_earlier_runs(
    world: World,
) -> None:
    """A zombie task of an earlier run that prepares after this run's last batch
    was committed is swept by the final checkpoint (whose cut is empty), not
    left until the next start."""
    ledger, sink = world.ledger, world.sink
    ledger.begin_run()  # this is run 2 of the state
    coord = world.coordinator()
    coord.recover()
    sink.prepared.add(own := txn(0, 0, run=ledger.run))
    ledger.record_batch("p", 0, {"s": [{"txn": own, "rows": 1}]})
    world.spark_completed(0)
    assert coord.checkpoint("periodic").cut == {"p": 0}
    zombie = txn(3, 0, run=ledger.run - 1)
    sink.prepared.add(zombie)
    final = coord.checkpoint("final", finished=["p"])
    assert final is not None and final.cut == {}
    assert zombie in sink.aborted and sink.prepared == set()


def test_nothing_to_commit_records_no_periodic_checkpoint(world: World) -> None:
    ledger = world.ledger
    world.register(0)
    assert world.coordinator().checkpoint() is None  # Spark has not completed batch 0
    assert ledger.history() == []


def test_work_of_an_unknown_pipeline_stops_recovery(world: World) -> None:
    ledger = world.ledger
    ledger.record_batch("gone", 0, {"s": [{"txn": "x", "rows": 1}]})
    with pytest.raises(ConfigError, match="gone"):
        world.coordinator().recover()


def test_reregistered_batch_aborts_the_earlier_attempt(world: World) -> None:
    sink = world.sink
    ledger = world.ledger
    first = world.register(0)
    coord = world.coordinator()
    again = [txn(0, 0, attempt=5)]
    sink.prepared.update(again)
    coord.register("p", 0, {"s": [{"txn": again[0], "rows": 1}]})
    assert sorted(sink.aborted) == sorted(first)
    assert ledger.owned_txns() == set(again)


def spark_planned(loc: Path, batch: int, offsets: str) -> None:
    (loc / "offsets").mkdir(parents=True, exist_ok=True)
    (loc / "offsets" / str(batch)).write_text(f'v1\n{{"batchTimestampMs":{batch}}}\n{offsets}')


def test_a_batch_committed_before_is_recognised_by_its_offsets(world: World) -> None:
    """Spark lost commits/1 (or an older Spark checkpoint was restored) and plans
    batch 1 again: same offsets, it is done and not written; other offsets refuse."""
    spark_planned(world.loc, 0, '{"logOffset":0}')
    spark_planned(world.loc, 1, '{"logOffset":1}')
    coord = world.coordinator()
    assert coord.admit("p", 0) and coord.admit("p", 1)
    for b in (0, 1):
        names = [txn(b, 0)]
        world.sink.prepared.update(names)
        coord.register("p", b, {"s": [{"txn": n, "rows": 1} for n in names]})
    world.spark_completed(1)
    coord.checkpoint()
    assert world.ledger.committed_cut("p") == 1
    (world.loc / "commits" / "1").unlink()  # the commit-log entry is lost
    (world.loc / "offsets" / "1").write_text('v1\n{"batchTimestampMs":99}\n{"logOffset":1}')
    assert coord.admit("p", 1) is False  # same offsets, another plan time: done
    with pytest.raises(RecoveryRefusedError, match="at or below the last committed"):
        coord.register("p", 1, {"s": []})
    spark_planned(world.loc, 1, '{"logOffset":7}')
    with pytest.raises(RecoveryRefusedError, match="other source offsets"):
        coord.admit("p", 1)
    assert coord.admit("p", 2)
    assert sorted(world.sink.committed) == [txn(0, 0), txn(1, 0)]


# -- rule 5: lost work is owed and written again ---------------------------------------


class LosingSink(RecordingSink):
    """A recording sink that can lose prepared work, as a broker's timeout or
    someone's ROLLBACK PREPARED does."""

    def lose(self, names: list[str]) -> None:
        self.prepared.difference_update(names)

    def commit(self, committables: Sequence[Committable]) -> None:
        """As the protocol asks: a loss found before committing commits none."""
        lost = [c["txn"] for c in committables if self.classify([c])[c["txn"]] is Outcome.LOST]
        if lost:
            raise TransactionLostError(f"{lost} lost")
        super().commit(committables)


@pytest.fixture
def losing(tmp_path: Path, ledger_factory: LedgerBackend) -> World:
    ledger = ledger_factory.open()
    _INCARNATION.append(ledger.incarnation)
    ledger.begin_run()
    return World(LosingSink(), ledger, tmp_path / "spark")


def _replaying(world: World) -> Coordinator:
    return Coordinator(
        "j",
        world.ledger,
        [PipelineSinks("p", {"s": world.sink}, SparkCommitLog(world.loc))],
        replay_lost=True,
    )


def test_a_loss_owes_the_sink_every_batch_from_it_on_and_later_checkpoints_too(
    losing: World,
) -> None:
    """Batch 1 of the decided checkpoint lost one of its two transactions. The
    sink commits batch 0, owes batch 1 (its surviving transaction aborted), and
    owes batches 2 and 3 as well, which Spark completed after the decision: a
    sink that committed them would hold batch 1 too and refuse to write it."""
    sink, ledger = losing.sink, losing.ledger
    assert isinstance(sink, LosingSink)
    b0, b1 = losing.register(0), losing.register(1)
    losing.spark_completed(1)
    ledger.decide("periodic", {"p": 1}, [])
    b2, b3 = losing.register(2), losing.register(3)
    losing.spark_completed(3)
    sink.lose(b1[:1])
    _replaying(losing).recover()
    assert sorted(sink.committed) == sorted(b0)
    assert sorted(sink.aborted) == sorted(b1[1:] + b2 + b3)
    assert ledger.owed() == {"p": {1: {"s": 2}, 2: {"s": 2}, 3: {"s": 2}}}
    assert ledger.pending() == {} and ledger.decided() is None
    assert ledger.committed_cut("p") == 3  # the decision stands for every other sink


def test_without_replay_a_loss_fails_the_commit(losing: World) -> None:
    """What ``twophase recover`` does (it cannot run the source): the loss fails."""
    sink = losing.sink
    assert isinstance(sink, LosingSink)
    b0 = losing.register(0)
    losing.spark_completed(0)
    losing.ledger.decide("periodic", {"p": 0}, [])
    sink.lose(b0[:1])
    with pytest.raises(CheckpointCommitError):
        losing.coordinator().recover()
    assert losing.ledger.owed() == {} and losing.ledger.decided() is not None


def test_a_loss_after_part_of_its_batch_committed_owes_only_the_lost_share(
    losing: World,
) -> None:
    """Batch 0 committed in part (a crash in the middle of its commit), and its
    other transaction is lost: the committed part stays, and only the lost
    task's Spark partition is owed, to be written again."""
    sink = losing.sink
    assert isinstance(sink, LosingSink)
    b0 = losing.register(0)
    losing.spark_completed(0)
    losing.ledger.decide("periodic", {"p": 0}, [])
    sink.committer().commit([{"txn": b0[0]}])
    sink.lose(b0[1:])
    _replaying(losing).recover()
    assert losing.ledger.owed() == {"p": {0: {"s": 1}}}
    assert losing.ledger.owed_parts("p", 0) == {"s": [1]}
    assert sink.committed == [b0[0]]


def test_a_loss_after_a_later_batch_committed_stops_the_job(losing: World) -> None:
    """Batch 0 is lost while batch 1 of the same sink committed already (a
    ledger of an earlier version, which committed in another order): writing
    batch 0 again would put it after batch 1, so the loss stops the job."""
    sink = losing.sink
    assert isinstance(sink, LosingSink)
    b0, b1 = losing.register(0), losing.register(1)
    losing.spark_completed(1)
    losing.ledger.decide("periodic", {"p": 1}, [])
    sink.committer().commit([{"txn": n} for n in b1])
    sink.lose(b0)
    with pytest.raises(CheckpointCommitError):
        _replaying(losing).recover()
    assert losing.ledger.owed() == {}


def _owe_batch_0(world: World) -> list[str]:
    sink = world.sink
    assert isinstance(sink, LosingSink)
    b0 = world.register(0)
    world.spark_completed(0)
    world.ledger.decide("periodic", {"p": 0}, [])
    sink.lose(b0)
    _replaying(world).recover()
    assert world.ledger.owed() == {"p": {0: {"s": 2}}}
    return b0


def _rewrite(world: World, names: list[str]) -> dict[str, list[Committable]]:
    world.sink.prepared.update(names)  # type: ignore[attr-defined]
    return {"s": [{"txn": n, "rows": 1} for n in names]}


def test_a_payment_commits_and_clears_the_debt(losing: World) -> None:
    _owe_batch_0(losing)
    again = [txn(0, i, run=2) for i in range(2)]
    _replaying(losing).repay("p", 0, _rewrite(losing, again))
    assert sorted(losing.sink.committed) == sorted(again)  # type: ignore[attr-defined]
    assert losing.ledger.owed() == {} and losing.ledger.totals() == {"p/s": 2}


@pytest.mark.parametrize("committed", [0, 1, 2])
def test_a_payment_cut_short_is_finished_at_the_next_start(losing: World, committed: int) -> None:
    """The driver stops after recording the payment's work, with ``committed``
    of its two transactions committed: the next start commits the rest and
    never writes the batch a third time; the work is kept from sweeps."""
    _owe_batch_0(losing)
    again = [txn(0, i, run=2) for i in range(2)]
    work = _rewrite(losing, again)
    losing.ledger.record_repaying("p", 0, work)
    losing.sink.committer().commit(work["s"][:committed])
    coord = _replaying(losing)
    coord.recover()  # sweeps: the recorded work is owned
    assert not set(again) & set(losing.sink.aborted)  # type: ignore[attr-defined]
    assert coord.finish_repay("p", 0) is True
    assert sorted(losing.sink.committed) == sorted(again)  # type: ignore[attr-defined]
    assert losing.ledger.owed() == {} and not losing.ledger.is_owned(again[0])


def test_a_payment_lost_in_part_after_part_committed_is_an_error(losing: World) -> None:
    _owe_batch_0(losing)
    again = [txn(0, i, run=2) for i in range(2)]
    work = _rewrite(losing, again)
    losing.ledger.record_repaying("p", 0, work)
    losing.sink.committer().commit(work["s"][:1])
    losing.sink.lose(again[1:])  # type: ignore[attr-defined]
    with pytest.raises(TransactionLostError, match="committed in part and lost in part"):
        _replaying(losing).finish_repay("p", 0)


def test_a_payment_lost_whole_is_written_again(losing: World) -> None:
    _owe_batch_0(losing)
    again = [txn(0, i, run=2) for i in range(2)]
    losing.ledger.record_repaying("p", 0, _rewrite(losing, again))
    losing.sink.lose(again)  # type: ignore[attr-defined]
    assert _replaying(losing).finish_repay("p", 0) is False
    assert losing.ledger.owed() == {"p": {0: {"s": 2}}}
