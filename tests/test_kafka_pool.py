"""The bounded pool of transactional ids (``sinks/kafka/pool.py``) on Apache Kafka.

The tests drive the sink as a job's driver and tasks do, without Spark: the
driver leases each batch a lane (the committer's ``lease``), the tasks write with it
(``WriteContext.lease``), the checkpoint commits and forgets, the sweep ends
the orphans, and the committer's ``settled`` releases the lanes. What they show:

* the transaction coordinator's count of the job's ids (ListTransactions)
  stays flat over many batches, where one id per transaction grows with each;
* a late attempt (a zombie of an earlier lease) on an id whose transaction is
  prepared refuses to begin instead of aborting it; in a job whose Spark tries
  each task a set number of times (``local[N,F]``), attempts that all meet
  such zombies fail the batch and the job, and the next run writes the batch;
* an orphan in a lane a batch holds now is fenced at its own producer id and
  epoch, and the batch's own transaction on the same id commits (the attempts
  that live on after the driver ended their transactions:
  ``tests/test_kafka_zombies.py``);
* a lane whose ids the registry shows open is not leased again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lifecycle.testing import jars
from sinks import KafkaSink
from sinks.base import Committable, JobScope, WriteContext
from sinks.kafka.committer import KafkaCommitter
from sinks.kafka.log import read_topic
from sinks.kafka.produce import OpenTransactionError, ProduceError
from sinks.kafka.wire import KafkaWire
from tests import tiers
from tests.kafkacheck import read_settled
from tests.test_kafka_unit import INC, SCHEMA, committed_ids, job_name, make_topic, rows


@pytest.fixture
def bootstrap(twophase_apache_kafka: Any) -> str:
    jars.require("kafka-broker")
    return str(twophase_apache_kafka.bootstrap)


@pytest.fixture
def new_sink(bootstrap: str) -> Iterator[Callable[..., KafkaSink]]:
    made: list[KafkaSink] = []

    def build(topic: str, **kw: Any) -> KafkaSink:
        sink = KafkaSink(bootstrap, topic, key="id", sink_id="k", commit_timeout=30, **kw)
        sink.preflight(SCHEMA)
        made.append(sink)
        return sink

    yield build
    for sink in made:
        sink.close()


def _ctx(scope: JobScope, batch: int, partition: int, lane: int | None, attempt: int = 0) -> Any:
    spark_attempt = 1000 * batch + 10 * partition + attempt
    return WriteContext(scope, 1, batch, partition, spark_attempt, attempt, lane)


def _task(
    sink: KafkaSink,
    scope: JobScope,
    batch: int,
    partition: int,
    lane: int | None,
    n: int = 5,
    attempt: int = 0,
) -> Committable:
    w = sink.open_writer(_ctx(scope, batch, partition, lane, attempt), SCHEMA)
    w.write(rows(1000 * batch + 100 * partition, n))
    c = w.prepare()
    w.close()
    assert c is not None
    return c


def _checkpoint(sink: KafkaSink, scope: JobScope, batch: int, done: list[Committable]) -> None:
    """What the coordinator does after the batch: commit, forget, sweep, settle."""
    sink.committer().commit(done)
    sink.committer().forget(done)
    owned = {c["txn"] for c in done}
    sink.committer().sweep(scope, lambda n: str(n) not in owned and n.batch_id <= batch)
    sink.committer().settled(scope, batch)


def _ids_of(bootstrap: str, job: str) -> list[str]:
    with KafkaWire(bootstrap) as wire:
        return [t for t in wire.list_transactions() if f".{job}." in t]


def test_the_coordinators_ids_stay_flat_over_many_batches(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap, partitions=2)
    sink = new_sink(topic)
    job = job_name()
    scope = JobScope(job, "p", "k", INC)
    counts = []
    for batch in range(60):
        lane = sink.committer().lease(scope, batch)
        done = [_task(sink, scope, batch, p, lane) for p in (0, 1)]
        _checkpoint(sink, scope, batch, done)
        if batch % 20 == 19:
            counts.append(len(_ids_of(bootstrap, job)))
    assert counts[0] == counts[-1] <= 2, counts  # one lane, two partitions, reused
    assert sink.committer().pool_size(scope) == 1
    log = read_settled(bootstrap, topic)
    assert committed_ids(log) == sorted(
        1000 * b + 100 * p + i for b in range(60) for p in (0, 1) for i in range(5)
    )
    assert log.n_open == 0

    # without a lease (one id per transaction, as before the pool) the count grows
    for batch in range(60, 70):
        c = _task(sink, scope, batch, 0, None)
        _checkpoint(sink, scope, batch, [c])
    assert len(_ids_of(bootstrap, job)) == counts[-1] + 10


def test_a_late_attempt_never_aborts_a_prepared_transaction_of_its_id(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    sink = new_sink(topic)
    scope = JobScope(job_name(), "p", "k", INC)
    lane = sink.committer().lease(scope, 0)
    prepared = _task(sink, scope, 0, 0, lane)
    # the same lane, partition and attempt number: a zombie of an earlier lease
    zombie = sink.open_writer(_ctx(scope, 0, 0, lane), SCHEMA)
    with pytest.raises(OpenTransactionError, match=r"^Kafka transactional id .* holds an open "):
        zombie.write(rows(500, 5))
    zombie.close(failed=True)
    _checkpoint(sink, scope, 0, [prepared])
    assert committed_ids(read_settled(bootstrap, topic)) == list(range(5))


def test_attempts_that_all_meet_open_transactions_fail_the_job_and_the_next_run_writes(  # type: ignore[no-untyped-def]
    spark, bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """What ``OpenTransactionError`` says happens, through a job. Zombies (task
    attempts of an earlier lease that began late) hold open transactions on
    every id batch 0 may take: its lane, partitions 0 and 1, attempt numbers 0
    and 1, the two tries the test session's ``local[2,2]`` gives a task (under
    ``local[N]`` it gets one). Each attempt refuses to abort them and fails,
    so the batch fails and the job stops with ``TaskFailedError``, saying what
    to do. The zombies' transactions end (the failed run's settling sweeps
    them, else the next run's recovery does), the next run writes batch 0
    again, and every row is committed once."""
    from lifecycle import Job, TaskFailedError
    from tests.conftest import write_input
    from tests.kafkacheck import assert_exactly_once
    from tests.sparkutil import INPUT_SCHEMA

    topic = make_topic(bootstrap)
    n = write_input(tmp_path / "in", files=1, rows_per_file=20)
    job = job_name()
    zombies: list[Any] = []
    lease = KafkaCommitter.lease
    running: list[KafkaSink] = []

    def lease_held_by_zombies(committer: KafkaCommitter, scope: JobScope, batch: int) -> int | None:
        lane = lease(committer, scope, batch)
        sink = running[-1]
        for partition in (0, 1):
            for attempt in (0, 1):
                ctx = WriteContext(scope, 1, batch, partition, 9000 + attempt, attempt, lane)
                zombie = sink.open_writer(ctx, SCHEMA)
                zombie.write(rows(900 + 10 * partition + attempt, 1))  # open, never prepared
                zombies.append(zombie)
        return lane

    def run() -> Any:
        sink = KafkaSink(bootstrap, topic, key="id", sink_id="k", commit_timeout=30)
        running.append(sink)
        j = Job(spark, job, tmp_path / "state", checkpoint_interval=0)
        df = spark.readStream.schema(INPUT_SCHEMA).json(str(tmp_path / "in"))
        j.add_pipeline("load", df, [sink], bounded=True)
        try:
            return j.run(handle_signals=False)
        finally:
            sink.close()

    monkeypatch.setattr(KafkaCommitter, "lease", lease_held_by_zombies)
    try:
        with pytest.raises(TaskFailedError) as failed:
            run()
    finally:
        monkeypatch.undo()
    assert len(zombies) == 4
    message = str(failed.value)
    assert failed.value.batch == 0 and "holds an open transaction" in message, message
    assert "a task failed: OpenTransactionError: Kafka transactional id tp3." in message, message
    assert "which this attempt refuses to abort: it fails" in message, message
    assert "up to spark.task.maxFailures, 4 by default" in message, message
    assert "under local[N] a task has one try (local[N,F]: F), so the batch fails" in message
    assert "run the job again, and it writes the batch again once that transaction" in message
    assert "Kafka aborts any other after transaction_timeout_ms=900000)" in message, message
    assert "Spark retries the task with another id" not in message, message
    first = read_topic(bootstrap, topic)
    assert first.committed == [] and len(first.aborted) + first.n_open == 4  # the zombies'

    assert run().committed
    assert_exactly_once(bootstrap, topic, n)  # the zombies' transactions were aborted
    for zombie in zombies:
        zombie.close()  # its transaction is gone: the abort fails, and is only logged


def test_an_orphan_in_a_leased_lane_is_fenced_at_its_own_epoch(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    sink = new_sink(topic)
    scope = JobScope(job_name(), "p", "k", INC)
    done = [_task(sink, scope, 0, 0, sink.committer().lease(scope, 0))]
    _checkpoint(sink, scope, 0, done)
    lane = sink.committer().lease(scope, 1)  # batch 1 holds the lane again
    assert lane == 0
    # a zombie of batch 0 (another task attempt with the same attempt number)
    # begins late on the lane's id, before batch 1's task does
    late = WriteContext(scope, 1, 0, 0, 999, 0, lane)
    zombie = sink.open_writer(late, SCHEMA)
    zombie.write(rows(700, 5))
    zombie.prepare()  # flushed, never committed; its process "dies" here
    swept = sink.committer().sweep(scope, lambda n: n.batch_id <= 0)
    assert swept == [str(late.txn_name())]
    # batch 1's task on the same id begins and commits: the orphan was fenced at
    # its own epoch, nothing of it is readable, and batch 1's rows are
    done = [_task(sink, scope, 1, 0, lane)]
    _checkpoint(sink, scope, 1, done)
    log = read_settled(bootstrap, topic)
    assert committed_ids(log) == [*range(5), *range(1000, 1005)]
    assert log.n_aborted == 5 and log.n_open == 0


def test_a_lane_with_an_open_transaction_is_not_leased_again(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    sink = new_sink(topic)
    scope = JobScope(job_name(), "p", "k", INC)
    lane = sink.committer().lease(scope, 0)
    lost = sink.open_writer(_ctx(scope, 0, 0, lane), SCHEMA)  # its executor dies after this
    lost.write(rows(0, 5))
    lost.prepare()
    retry = sink.open_writer(_ctx(scope, 0, 0, lane, attempt=1), SCHEMA)
    retry.write(rows(0, 5))
    c = retry.prepare()
    retry.close()
    assert c is not None and c["transactional_id"].endswith(f".l{lane}.p0.a1")
    sink.committer().commit([c])
    sink.committer().forget([c])
    with KafkaWire(bootstrap) as wire:
        assert sink._store is not None
        sink._store.view.refresh(wire)
    sink.committer().settled(scope, 0)  # no sweep yet: attempt 0's transaction is open
    assert sink.committer().lease(scope, 1) == 1
    sink.committer().sweep(scope, lambda n: n.batch_id <= 0 and str(n) != c["txn"])
    read_settled(bootstrap, topic)  # Apache Kafka writes the ABORT marker just after EndTxn
    sink.committer().sweep(scope, lambda n: n.batch_id <= 0)  # the next checkpoint's sweep
    sink.committer().settled(scope, 1)
    assert sink.committer().lease(scope, 2) == 0  # ended by the sweep, tombstoned: back in the pool
    log = read_topic(bootstrap, topic)
    assert committed_ids(log) == list(range(5))


def test_recovery_fences_a_pooled_orphan_and_stops_its_zombie(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    """At a start, before the first lease, no task of the new run holds a pooled
    id: recovery fences the previous run's orphans (InitProducerId bumps the
    epoch), so a zombie still writing with the old epoch is refused."""
    topic = make_topic(bootstrap)
    sink = new_sink(topic)
    scope = JobScope(job_name(), "p", "k", INC)
    lane = sink.committer().lease(scope, 0)
    zombie = sink.open_writer(_ctx(scope, 0, 0, lane), SCHEMA)
    zombie.write(rows(0, 5))
    zombie.prepare()  # the driver dies; the task lives on
    restarted = new_sink(topic)  # a new driver: nothing leased yet
    swept = restarted.committer().sweep(scope, lambda n: True)
    assert swept == [str(_ctx(scope, 0, 0, lane).txn_name())]
    with pytest.raises(ProduceError):
        zombie.write(rows(5, 5))
        zombie.prepare()
    zombie.close(failed=True)
    log = read_settled(bootstrap, topic)
    assert committed_ids(log) == [] and log.n_open == 0


def test_speculation_is_refused_unless_every_sink_allows_it(pg_dsn: str) -> None:
    from lifecycle.startup import refuse_speculation
    from sinks import DeltaSink, PostgresSink
    from sinks.errors import ConfigError

    kafka = KafkaSink("127.0.0.1:9", "t")  # never reached: the check reads settings only
    refuse_speculation([kafka])  # each attempt its own pooled id: allowed
    with pytest.raises(
        ConfigError, match=r"speculation.*Delta table /tmp/x, PostgreSQL table public\.t "
    ):
        refuse_speculation([kafka, PostgresSink(pg_dsn, "t"), DeltaSink("/tmp/x")])


@tiers.SLOW
def test_a_reused_id_goes_on_when_its_epoch_overflows_and_its_producer_id_rotates(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    """Each use of a pooled id bumps its epoch (a short): after about 32,000
    uses Apache Kafka gives the id a new producer id at epoch 0. The id is
    worn down to the edge with raw InitProducerIds (about 32,700), then batches
    go on through the rotation: every commit lands, the registry follows the
    new producer id, nothing is left open."""
    topic = make_topic(bootstrap)
    sink = new_sink(topic)
    scope = JobScope(job_name(), "p", "k", INC)
    lane = sink.committer().lease(scope, 0)
    tid = sink.transactional_id(_ctx(scope, 0, 0, lane))
    with KafkaWire(bootstrap) as wire:
        coordinator = wire.find_coordinators([tid])[tid]
        epoch = 0
        while epoch < 32_760:
            error, _, epoch = wire.init_producer_id(coordinator, tid, 60_000)
            assert error.__name__ == "NoError", error
    pids = set()
    for batch in range(12):
        if batch:  # (batch 0 holds the lane leased above)
            assert sink.committer().lease(scope, batch) == lane
        c = _task(sink, scope, batch, 0, lane)
        pids.add((c["producer_id"], c["epoch"] > 32_000))
        _checkpoint(sink, scope, batch, [c])
    assert len({pid for pid, _ in pids}) == 2, pids  # rotated once
    log = read_settled(bootstrap, topic)
    assert committed_ids(log) == sorted(1000 * b + i for b in range(12) for i in range(5))
    assert log.n_open == 0
