"""Recovery rule 5 during a run: a Kafka transaction lost while the job runs
(Apache Kafka aborts it at ``transaction.timeout.ms`` after a long pause, a slow
commit of another sink, a GC stall) is written again from the source by the
run itself, exactly once, and the job goes on without an operator.

A transaction is lost here the way the broker's timeout loses it: InitProducerId
on its transactional id bumps the epoch and aborts it. Two moments:

* before the checkpoint's commit (``driver.before_commit``): the commit checks
  every transaction with the broker first and commits none of the sink's share;
  the batch is owed whole and written again;
* in the middle of the commit (``driver.mid_commit``, after the first EndTxn),
  the window the check cannot close: part of the batch is committed, so only
  the lost task's share (its Spark partition) is owed and written again.

Each run is checked from outside: read_committed readers see every row once,
nothing stays open, the ledger owes nothing and counts every row once.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from lifecycle import Job
from lifecycle.ledger import read_ledger
from sinks import KafkaSink, _faults
from sinks.base import Committable
from sinks.kafka.wire import KafkaWire
from tests.conftest import write_input
from tests.kafkacheck import assert_exactly_once, consume_ids
from tests.sparkutil import INPUT_SCHEMA

ROWS_PER_FILE = 100
FILES = 4


def _job(spark: Any, bootstrap: str, topic: str, tmp: Path, name: str) -> Job:
    """One batch of every input file, in a few Spark partitions (a Kafka
    transaction each)."""
    df = spark.readStream.schema(INPUT_SCHEMA).json(str(tmp / "in"))
    job = Job(spark, name, tmp / "state", checkpoint_interval=0)
    sink = KafkaSink(bootstrap, topic, key="id", sink_id="kafka", commit_connections=1)
    job.add_pipeline("load", df, [sink], bounded=True)
    return job


def _pending_work(state: Path) -> list[Committable]:
    """The Kafka sink's committables of the one pending batch, in commit order."""
    doc = read_ledger(state)
    assert doc is not None
    (batch,) = doc["pending"]["load"].values()
    return sorted(batch["kafka"], key=lambda c: c["transactional_id"])


def _lose(bootstrap: str, c: Committable) -> None:
    """What the broker's timeout does to a transaction: InitProducerId on its id
    bumps the epoch and aborts it."""
    with KafkaWire(bootstrap) as wire:
        tid = c["transactional_id"]
        coordinator = wire.find_coordinators([tid])[tid]
        for _ in range(50):  # CONCURRENT_TRANSACTIONS while the abort completes
            error, _, epoch = wire.init_producer_id(coordinator, tid, 60_000)
            if error.__name__ == "NoError":
                assert epoch > int(c["epoch"])
                return
            time.sleep(0.1)
        raise AssertionError(f"could not abort {tid}: {error}")


def _check(bootstrap: str, topic: str, tmp: Path, n: int) -> dict[str, Any]:
    assert_exactly_once(bootstrap, topic, n)
    assert sorted(consume_ids(bootstrap, topic, "read_committed")) == list(range(n))
    doc = read_ledger(tmp / "state")
    assert doc is not None and doc["owed"] == {} and doc["pending"] == {}
    assert doc["totals"] == {"load/kafka": n}
    return doc


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_transaction_lost_before_the_commit_is_written_again_by_the_run(
    spark: Any, kafka_bootstrap: str, kafka_topic: Any, tmp_path: Path, which: str
) -> None:
    """Lost before the commit: none of the batch commits, it is owed whole, and
    the same run writes it again; ``run()`` returns without an error."""
    bootstrap, topic = kafka_bootstrap, kafka_topic(partitions=3)
    n = write_input(tmp_path / "in", files=FILES, rows_per_file=ROWS_PER_FILE)
    lost: list[str] = []

    def lose() -> None:
        work = _pending_work(tmp_path / "state")
        assert len(work) >= 2, [c["txn"] for c in work]
        victim = work[0] if which == "first" else work[-1]
        _lose(bootstrap, victim)
        lost.append(victim["txn"])

    name = f"lostrun{uuid.uuid4().hex[:8]}"
    _faults.register("driver.before_commit", lose)
    try:
        result = _job(spark, bootstrap, topic, tmp_path, name).run()
    finally:
        _faults.clear()
    assert lost, "the fault did not fire"
    assert not result.stopped
    _check(bootstrap, topic, tmp_path, n)


def test_a_transaction_lost_in_the_middle_of_the_commit_owes_only_its_share(
    spark: Any, kafka_bootstrap: str, kafka_topic: Any, tmp_path: Path
) -> None:
    """Lost after another transaction of the same batch committed: the rest of
    the batch commits, the ledger owes only the lost task's Spark partition,
    and the run writes that partition again: every row once."""
    bootstrap, topic = kafka_bootstrap, kafka_topic(partitions=3)
    n = write_input(tmp_path / "in", files=FILES, rows_per_file=ROWS_PER_FILE)
    owed: list[dict[str, Any]] = []

    def lose_the_last() -> None:
        work = _pending_work(tmp_path / "state")
        _lose(bootstrap, work[-1])  # one connection: committed in this order, first done

    def seen_owed() -> None:
        doc = read_ledger(tmp_path / "state")
        assert doc is not None
        owed.append(doc["owed"])

    name = f"lostmid{uuid.uuid4().hex[:8]}"
    _faults.register("driver.mid_commit.kafka", lose_the_last)
    _faults.register("driver.before_repay", seen_owed)
    try:
        _job(spark, bootstrap, topic, tmp_path, name).run()
    finally:
        _faults.clear()
    assert owed, "nothing was written again"
    (debt,) = owed[0]["load"].values()
    assert 0 < debt["kafka"]["rows"] < n, debt
    assert len(debt["kafka"]["parts"]) == 1, debt  # the lost task's partition only
    _check(bootstrap, topic, tmp_path, n)
