"""Attempts that live on after the driver ended their transaction (issue 43).

A speculative copy, or a task Spark gave up on, keeps writing with its
producer id and epoch after the driver ended its transaction: the sweep found
it an orphan, or a drain aborted the batch it belongs to. Whatever it does
next must open no transaction that outlives the next sweep. The driver fences
a pooled id at the transaction's own epoch (``sinks.kafka.txn.fence_own``),
which bumps it: the attempt's next AddPartitionsToTxn and produce are refused.
An EndTxn(abort) with that epoch, which the driver sent before, leaves the
epoch as it was: the attempt's next AddPartitionsToTxn began a transaction no
registry entry names and no sweep finds. A lane is also released only once the
broker shows none of its ids open (the committer's ``settled``).

The sink-level tests drive the sink as ``tests/test_kafka_pool.py`` does,
without Spark, on three brokers: the session's Kafka 4.x broker (transactions
version 2), one formatted with transactions version 1 (a cluster upgraded from
Kafka 3.x), and one with transactions version 1 whose partitions do not check
a transactional produce with the coordinator
(``transaction.partition.verification.enable=false``: every broker before Kafka
3.6, and the sink pools ids from Kafka 3.0 on). The last test aborts a batch's
pooled transactions in a drain of a real job.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from kafka.partitioner.default import murmur2

from lifecycle.testing import jars
from lifecycle.testing.plugin import wait_for_topic
from sinks import KafkaSink, _faults
from sinks.base import Committable, JobScope
from sinks.kafka import txn
from sinks.kafka.pool import lane_of
from sinks.kafka.produce import ProduceError, TxnProducer
from sinks.kafka.wire import OPEN_STATES, KafkaWire, TxnState
from tests.kafkacheck import assert_exactly_once, assert_nothing_open, read_settled
from tests.test_apache_kafka import _transaction_version
from tests.test_kafka_pool import _checkpoint, _ctx, _task
from tests.test_kafka_unit import INC, SCHEMA, committed_ids, job_name, make_topic


def _tv1_broker(config: dict[str, str]) -> Iterator[Any]:
    jars.require("kafka-broker")
    from lifecycle.testing.apache_kafka import ApacheKafka

    with ApacheKafka(config, features={"transaction.version": 1}) as broker:
        assert _transaction_version(broker) == 1
        yield broker


@pytest.fixture(scope="module")
def tv1_kafka() -> Iterator[Any]:
    """A broker formatted with ``transaction.version=1`` (a cluster upgraded from
    Kafka 3.x keeps it until an operator raises it)."""
    yield from _tv1_broker({})


@pytest.fixture(scope="module")
def unverified_kafka() -> Iterator[Any]:
    """Transactions version 1, and partitions that take a transactional produce
    without asking the coordinator whether the partition is in the producer's
    transaction, as before Kafka 3.6 (KIP-890's verification)."""
    yield from _tv1_broker({"transaction.partition.verification.enable": "false"})


@pytest.fixture(params=["kafka4", "tv1", "tv1-unverified"])
def bootstrap(request: pytest.FixtureRequest) -> str:
    """The session's Kafka 4.x broker (transactions version 2), then one with
    transactions version 1, then one that does not verify partitions either."""
    jars.require("kafka-broker")
    if request.param == "tv1":
        return str(request.getfixturevalue("tv1_kafka").bootstrap)
    if request.param == "tv1-unverified":
        return str(request.getfixturevalue("unverified_kafka").bootstrap)
    broker = request.getfixturevalue("twophase_apache_kafka")
    assert _transaction_version(broker) == 2
    return str(broker.bootstrap)


@pytest.fixture
def new_sink(bootstrap: str) -> Iterator[Callable[[str], KafkaSink]]:
    made: list[KafkaSink] = []

    def build(topic: str) -> KafkaSink:
        sink = KafkaSink(bootstrap, topic, key="id", sink_id="k", commit_timeout=30)
        sink.preflight(SCHEMA)
        made.append(sink)
        return sink

    yield build
    for sink in made:
        sink.close()


def _partition_of(row_id: int) -> int:
    """The partition of a 2-partition topic Kafka's default partitioner gives
    the key of row ``row_id``."""
    return int((murmur2(str(row_id).encode()) & 0x7FFFFFFF) % 2)


def _rows_on(partition: int, n: int, start: int) -> pa.RecordBatch:
    """``n`` rows from id ``start`` on whose keys Kafka's default partitioner
    puts in ``partition`` of a 2-partition topic."""
    on = [i for i in range(start, start + 100 * n) if _partition_of(i) == partition]
    ids = on[:n]
    return pa.record_batch(
        [pa.array(ids), pa.array([f"name-{i}" for i in ids]), pa.array([i * 0.5 for i in ids])],
        schema=SCHEMA,
    )


def _open(bootstrap: str, transactional_ids: list[str]) -> dict[str, TxnState]:
    """Those of the ids whose coordinator shows a transaction not ended."""
    with KafkaWire(bootstrap) as wire:
        found = wire.describe_transactions(wire.find_coordinators(transactional_ids))
    assert found is not None
    return {t: s for t, s in found.items() if s is not None and s.state in OPEN_STATES}


@pytest.mark.parametrize("where", ["new-partition", "old-partition"])
def test_an_attempt_that_lives_on_after_the_sweep_ended_its_transaction_opens_nothing(
    bootstrap: str, new_sink: Callable[[str], KafkaSink], where: str
) -> None:
    """A speculative attempt 1 of batch 0 writes partition 0; the checkpoint
    commits attempt 0 and its sweep ends attempt 1's transaction; attempt 1
    lives on and writes again: to partition 1 (new to it: AddPartitionsToTxn
    first) or to partition 0 (a produce only). Its write is refused. (Ended by
    EndTxn(abort) with its epoch, it opened a transaction on partition 1 that
    no registry entry names, holding read_committed consumers of partition 1
    back until its timeout, and batch 1's attempt 1 on the id was refused; on
    a broker whose partitions do not check with the coordinator its produce to
    partition 0 opened one that not even the coordinator knows of.) Nothing
    stays open, read_committed reads the committed rows, and the lane goes to
    batch 1 once none of its ids holds a transaction."""
    topic = make_topic(bootstrap, partitions=2)
    sink = new_sink(topic)
    scope = JobScope(job_name(), "p", "k", INC)
    lane = sink.committer().lease(scope, 0)
    zombie = sink.open_writer(_ctx(scope, 0, 0, lane, attempt=1), SCHEMA)
    zombie.write(_rows_on(0, 5, start=500))
    zombie.prepare()  # flushed and open; Spark keeps attempt 0's result
    _checkpoint(sink, scope, 0, [_task(sink, scope, 0, 0, lane)])
    with pytest.raises(ProduceError):
        zombie.write(_rows_on(1 if where == "new-partition" else 0, 5, start=600))
        zombie.prepare()
    zombie.close(failed=True)
    _checkpoint(sink, scope, 0, [])  # the next checkpoint's sweep and settle
    ids = [sink.transactional_id(_ctx(scope, 0, 0, lane, a)) for a in (0, 1)]
    assert _open(bootstrap, ids) == {}
    assert sink.committer().lease(scope, 1) == lane
    _checkpoint(sink, scope, 1, [_task(sink, scope, 1, 0, lane, attempt=1)])  # attempt 1's id
    log = read_settled(bootstrap, topic)
    assert committed_ids(log) == [*range(5), *range(1000, 1005)]
    assert log.n_open == 0


def test_a_lane_stays_leased_while_the_broker_shows_one_of_its_ids_open(
    bootstrap: str, new_sink: Callable[[str], KafkaSink]
) -> None:
    """A lane is released only once the broker, not only the registry, shows
    none of its ids open. Here attempt 1 of batch 0 holds a transaction no
    announcement names: its transaction was ended by EndTxn(abort) with its
    epoch (``txn.abort_own``: what the driver did before it fenced at the
    epoch, and still does on a broker that cannot describe transactions),
    which leaves the epoch as it was, and it wrote on. Its announcement ended,
    so the registry shows every id of the lane ended; the broker does not,
    and the lane stays leased until that transaction has ended (here by a
    fence; else at its timeout)."""
    topic = make_topic(bootstrap, partitions=2)
    sink = new_sink(topic)
    scope = JobScope(job_name(), "p", "k", INC)
    lane = sink.committer().lease(scope, 0)
    zombie = sink.open_writer(_ctx(scope, 0, 0, lane, attempt=1), SCHEMA)
    zombie.write(_rows_on(0, 5, start=500))
    z = zombie.prepare()
    assert z is not None
    tid = z["transactional_id"]
    with KafkaWire(bootstrap) as wire:
        txn.abort_own(wire, {tid: (z["producer_id"], z["epoch"])})
    zombie.write(_rows_on(1, 5, start=600))  # a new transaction, never announced
    zombie.prepare()
    _checkpoint(sink, scope, 0, [_task(sink, scope, 0, 0, lane)])
    _checkpoint(sink, scope, 0, [])  # and the next checkpoint's
    assert set(_open(bootstrap, [tid])) == {tid}
    assert sink.committer().lease(scope, 1) == lane + 1  # lane 0 stays leased
    with KafkaWire(bootstrap) as wire:
        txn.fence(wire, [tid], 60_000)
    sink.committer().settled(scope, 0)
    assert sink.committer().lease(scope, 2) == lane  # ended: back in the pool
    zombie.close()
    log = read_settled(bootstrap, topic)
    assert committed_ids(log) == list(range(5)) and log.n_open == 0


def test_a_writer_fenced_before_it_added_a_partition_leaves_no_record_in_any_log(
    bootstrap: str, new_sink: Callable[[str], KafkaSink]
) -> None:
    """The driver fences a pooled id at its epoch (``txn.fence_own``) just after
    a writer took its producer id and before its one AddPartitionsToTxn (the
    registry's partition and its data partitions), the request its announcement
    and its data wait for: the writer fails, and neither the registry nor the
    topic holds a record of its producer, whatever the transaction's fate (on
    the broker whose partitions do not ask the coordinator, a produce sent
    without waiting for that answer would have been appended). The id's next
    writer takes it over and commits alone."""
    topic = make_topic(bootstrap, partitions=2)
    sink = new_sink(topic)
    scope = JobScope(job_name(), "p", "k", INC)
    lane = sink.committer().lease(scope, 0)
    ctx = _ctx(scope, 0, 0, lane)
    tid = sink.transactional_id(ctx)
    fenced: list[TxnState] = []

    def fence() -> None:
        with KafkaWire(bootstrap) as wire:
            state = wire.describe_transaction(wire.find_coordinators([tid])[tid], tid)
            assert state is not None and state.state not in OPEN_STATES
            txn.fence_own(wire, {tid: (state.producer_id, state.epoch)}, 60_000)
            fenced.append(state)

    zombie = sink.open_writer(ctx, SCHEMA)
    _faults.register("executor.producer_id", fence)
    try:
        with pytest.raises(ProduceError, match=r"ProducerFenced|InvalidProducerEpoch"):
            zombie.write(_rows_on(0, 5, start=500))
    finally:
        _faults.clear()
    zombie.close(failed=True)
    assert fenced
    producer = (fenced[0].producer_id, fenced[0].epoch)
    _checkpoint(sink, scope, 0, [_task(sink, scope, 0, 0, lane)])  # the id again
    log = read_settled(bootstrap, topic)
    assert committed_ids(log) == list(range(5)) and log.n_open == log.n_aborted == 0
    registry = read_settled(bootstrap, sink.registry_topic or "")
    mine = [
        r
        for r in registry.committed + registry.aborted + registry.open
        if (r.producer_id, r.producer_epoch) == producer
    ]
    assert mine == []


# -- a drain aborts a batch's pooled transactions ----------------------------------------


def test_a_drain_fences_the_pooled_transactions_of_the_batch_it_interrupts(
    spark: Any, twophase_apache_kafka: Any, tmp_path: Path
) -> None:
    """``Job.stop(drain=True)`` while batch 0 of an unbounded pipeline is
    recorded in the ledger and not yet complete in Spark: the drain stops the
    query (the fault point raises, as the interruption does), the coordinator's
    ``reset_pipeline`` aborts the batch's work (the committer's ``abort`` of pooled
    ids, in the run), Spark replays the batch in the same run, and the final
    checkpoint commits it once. An attempt of the aborted work still alive,
    writing with its producer id and epoch, can begin no transaction: the
    abort fenced the ids at their epochs."""
    jars.require("kafka-broker")
    bootstrap = twophase_apache_kafka.bootstrap
    from lifecycle import Job
    from lifecycle.ledger import read_ledger
    from tests.conftest import write_input
    from tests.sparkutil import INPUT_SCHEMA

    topic = make_topic(bootstrap, partitions=2)
    other = make_topic(bootstrap, partitions=1)  # a partition new to every transaction
    wait_for_topic(bootstrap, other, 1)
    n = write_input(tmp_path / "in", files=2, rows_per_file=100)
    name = f"zdrain{uuid.uuid4().hex[:8]}"
    state = tmp_path / "state"
    job = Job(spark, name, state, checkpoint_interval=60, stop_grace=0.5)
    df = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1)
    job.add_pipeline("load", df.json(str(tmp_path / "in")), [KafkaSink(bootstrap, topic, key="id")])
    interrupted: list[Committable] = []

    def interrupt() -> None:
        doc = read_ledger(state)
        assert doc is not None
        (work,) = doc["pending"]["load"]["0"].values()
        interrupted.extend(work)
        job.stop(drain=True)
        deadline = time.monotonic() + 60
        while not _draining(job) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # past stop_grace: the drain is stopping the query
        raise RuntimeError("batch 0 interrupted by the drain")

    _faults.register("driver.after_record", interrupt)
    try:
        result = job.run(handle_signals=False)
    finally:
        _faults.clear()
    assert interrupted and result.drained and result.committed
    assert all(lane_of(c["transactional_id"], "") is not None for c in interrupted)
    assert_exactly_once(bootstrap, topic, n)
    assert_nothing_open(bootstrap, topic, name)
    with KafkaWire(bootstrap) as wire:
        for c in interrupted:
            zombie = TxnProducer(wire, c["transactional_id"], transaction_timeout_ms=60_000)
            zombie.producer_id, zombie.epoch = int(c["producer_id"]), int(c["epoch"])
            with pytest.raises(ProduceError, match="ProducerFenced"):
                zombie.add_partitions(other, [0])


def _draining(job: Any) -> bool:
    """Whether the job's state (its metrics say) is draining."""
    return any(
        m.name == "twophase_job_state" and m.labels.get("state") == "draining" and m.value == 1
        for m in job.metrics()
    )
