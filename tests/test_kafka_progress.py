"""What the Kafka sink remembers of its progress, and its claim, against a real broker.

tansu, the test session's broker (the test kit's, :mod:`lifecycle.testing.kafka_broker`);
nothing is mocked. Every test uses fresh topics and job names; all share the default
registry topic, as jobs on one cluster do. What is committed is checked from
the raw log with the control markers (``sinks/kafka/log.py``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kafka import KafkaProducer

from sinks.base import Committable, JobScope
from sinks.kafka import KafkaSink
from sinks.kafka.log import read_topic
from sinks.kafka.progress import PARTITION, ProgressBook, claim_key, progress_key
from sinks.kafka.registry import DEFAULT_TOPIC, RegistryView, announcement
from sinks.kafka.wire import KafkaWire
from sinks.progress import IncarnationConflictError, SinkProgress
from sinks.versions import NewerVersionError
from tests.test_kafka_unit import (
    SCHEMA,
    committed_ids,
    ctx,
    job_name,
    make_topic,
    rows,
    write_task,
)

A, B, C = "aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc"


@pytest.fixture
def bootstrap(kafka_bootstrap: str) -> str:
    """The test session's broker (tests/conftest.py)."""
    return kafka_bootstrap


@pytest.fixture
def new_sink(bootstrap: str) -> Iterator[Callable[..., KafkaSink]]:
    """A sink on the test broker, preflighted (one driver each); closed after the test."""
    made: list[KafkaSink] = []

    def build(topic: str, **kw: Any) -> KafkaSink:
        sink = KafkaSink(bootstrap, topic, sink_id=kw.pop("sink_id", "k"), **kw)
        sink.preflight(SCHEMA)
        made.append(sink)
        return sink

    yield build
    for sink in made:
        sink.close()


def scope(job: str, incarnation: str) -> JobScope:
    return JobScope(job, "p", "k", incarnation)


def _progress_is(sink: KafkaSink, sc: JobScope, want: SinkProgress) -> None:
    """``sink.committer().progress(sc)`` becomes ``want`` within 10 s: Apache Kafka writes
    the COMMIT markers of the announcements after it answers EndTxn."""
    deadline = time.monotonic() + 10
    while (found := sink.committer().progress(sc)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    assert found == want


def commit_batch(
    sink: KafkaSink, job: str, inc: str, batch: int, *, forget: bool = True
) -> list[Committable]:
    """Write batch ``batch`` (two tasks of 5 rows, ids from batch * 10) and commit it."""
    cs = [
        write_task(sink, ctx(job, p, batch=batch, incarnation=inc), [rows(batch * 10 + 5 * p, 5)])
        for p in range(2)
    ]
    committables = [c for c in cs if c is not None]
    sink.committer().commit(committables)
    if forget:
        sink.committer().forget(committables)
    return committables


def claims_of(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    """Every claim record of ``topic`` in the registry, in log order."""
    log = read_topic(bootstrap, DEFAULT_TOPIC)
    prefix = f"claim/{topic}/".encode()
    return [
        json.loads(r.value)
        for r in log.committed
        if r.key is not None and r.key.startswith(prefix) and r.value is not None
    ]


# -- progress ---------------------------------------------------------------------------


def test_progress_after_commits_survives_tombstoning_and_ignores_aborts(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap, partitions=2)
    sink = new_sink(topic)
    job = job_name()
    _progress_is(sink, scope(job, A), SinkProgress(owner=None))
    assert sink.committer().claim(scope(job, A)) == SinkProgress(owner=A, batch=-1)

    first = commit_batch(sink, job, A, 0, forget=False)
    _progress_is(sink, scope(job, A), SinkProgress(owner=A, batch=0))  # announcements
    second = commit_batch(sink, job, A, 1, forget=False)
    _progress_is(sink, scope(job, A), SinkProgress(owner=A, batch=1))
    sink.committer().forget(first)  # progress record at 0; batch 1 only in its announcements

    # prepared and never committed, and aborted behind the sink's back (not tombstoned:
    # only the ABORT marker in the registry tells): neither counts
    open_one = write_task(sink, ctx(job, 0, batch=2, incarnation=A), [rows(100, 5)])
    aborted = write_task(sink, ctx(job, 0, batch=3, incarnation=A), [rows(200, 5)])
    assert open_one is not None and aborted is not None
    intruder = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=aborted["txn"])
    intruder.init_transactions()  # aborts the prepared transaction
    intruder.close()
    _progress_is(sink, scope(job, A), SinkProgress(owner=A, batch=1))

    # a fresh driver reads the same; then the announcements go, the progress record stays
    assert new_sink(topic).committer().progress(scope(job, A)) == SinkProgress(owner=A, batch=1)
    sink.committer().forget(second)
    commit_batch(sink, job, A, 4)  # committed and forgotten
    sink.committer().abort([open_one, aborted])
    with KafkaWire(bootstrap) as wire:
        live = RegistryView(DEFAULT_TOPIC).refresh(wire)
    assert not [t for t in live if t.startswith(f"tp2.{job}.")]  # all tombstoned
    assert new_sink(topic).committer().progress(scope(job, A)) == SinkProgress(owner=A, batch=4)
    _progress_is(sink, scope(job, A), SinkProgress(owner=A, batch=4))
    assert committed_ids(read_topic(bootstrap, topic)) == [*range(20), *range(40, 50)]


def test_a_sweep_settles_a_committed_announcement_whose_forget_was_missed(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    sink = new_sink(topic)
    job = job_name()
    sink.committer().claim(scope(job, A))
    commit_batch(sink, job, A, 0)
    commit_batch(sink, job, A, 1, forget=False)  # the driver died before forget
    restarted = new_sink(topic)
    restarted.committer().claim(scope(job, A))
    assert restarted.committer().sweep(scope(job, A), lambda n: True) == []  # nothing fenced
    with KafkaWire(bootstrap) as wire:
        live = RegistryView(DEFAULT_TOPIC).refresh(wire)
    assert not [t for t in live if t.startswith(f"tp2.{job}.")]  # tombstoned...
    assert new_sink(topic).committer().progress(scope(job, A)) == SinkProgress(
        owner=A, batch=1
    )  # ...kept
    assert committed_ids(read_topic(bootstrap, topic)) == list(range(20))


# -- claims -----------------------------------------------------------------------------


def test_another_incarnation_refuses_before_writing(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    job = job_name()
    first = new_sink(topic)
    first.committer().claim(scope(job, A))
    commit_batch(first, job, A, 0)
    assert first.committer().claim(scope(job, A)) == SinkProgress(
        owner=A, batch=0
    )  # again: same owner
    assert len(claims_of(bootstrap, topic)) == 1  # and nothing appended

    second = new_sink(topic)  # another copy of the job, with its own state
    with pytest.raises(IncarnationConflictError) as err:
        second.committer().claim(scope(job, B))
    assert (err.value.owner, err.value.ours) == (A, B)
    assert f"committed output up to batch 0 of {job}/p/k from incarnation {A}" in str(err.value)
    assert "Nothing was written" in str(err.value)
    assert [c["incarnation"] for c in claims_of(bootstrap, topic)] == [A]  # refused unwritten
    _progress_is(second, scope(job, B), SinkProgress(owner=A, batch=0))
    assert committed_ids(read_topic(bootstrap, topic)) == list(range(10))


def claim_race(
    sinks: dict[str, KafkaSink], job: str
) -> tuple[list[str], list[IncarnationConflictError]]:
    """Each sink claims ``job`` for its incarnation, in its own thread, released
    together by a barrier; returns (winners, refusals)."""
    barrier = threading.Barrier(len(sinks))
    won: list[str] = []
    lost: list[IncarnationConflictError] = []

    def claim(inc: str) -> None:
        barrier.wait()
        try:
            sinks[inc].committer().claim(scope(job, inc))
            won.append(inc)
        except IncarnationConflictError as e:
            lost.append(e)

    threads = [threading.Thread(target=claim, args=(inc,)) for inc in sinks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return won, lost


def test_simultaneous_claims_exactly_one_wins(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    """Two copies of a job start at the same instant (two drivers, one target)."""
    topic = make_topic(bootstrap)
    for _ in range(4):
        job = job_name()
        sinks = {inc: new_sink(topic) for inc in (A, B)}
        for s in sinks.values():
            s.committer().progress(
                scope(job, A)
            )  # connected and read: both start from the same view
        won, lost = claim_race(sinks, job)
        assert len(won) == 1 and len(lost) == 1, (won, lost)
        assert lost[0].owner == won[0]
        readers = [*sinks.values(), new_sink(topic)]
        assert {r.committer().progress(scope(job, C)).owner for r in readers} == {won[0]}


def test_claims_appended_together_first_in_the_log_wins(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    """Both claims are in the log before either claimer reads it (each passed its
    check on an empty log): every reader decides for the first."""
    topic = make_topic(bootstrap)
    job = job_name()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for inc in (B, A):  # B first
        value = {"kind": "claim", "topic": topic, "scope": f"{job}/p/k", "incarnation": inc}
        value.update(start_over_from=None, nonce=f"n-{inc}")
        key = claim_key(topic, scope(job, inc), f"n-{inc}")
        producer.send(DEFAULT_TOPIC, key=key, value=json.dumps(value).encode(), partition=PARTITION)
    producer.flush()
    producer.close()
    with pytest.raises(IncarnationConflictError) as err:
        new_sink(topic).committer().claim(scope(job, A))
    assert err.value.owner == B
    assert new_sink(topic).committer().claim(scope(job, B)).owner == B


def test_claim_replay_rule_is_the_same_for_every_reader() -> None:
    """The replay itself (no broker): first claim wins, a retried record (same
    nonce) changes nothing, a start-over takes over only from its named owner."""

    def feed(book: ProgressBook, inc: str, nonce: str, start_over_from: str | None) -> None:
        value = {"kind": "claim", "topic": "t", "scope": "j/p/k", "incarnation": inc}
        value.update(start_over_from=start_over_from, nonce=nonce)
        book.apply(PARTITION, f"claim/t/j/p/k/{inc}/{nonce}", json.dumps(value).encode())

    book = ProgressBook("t")
    s = scope("j", A)
    feed(book, A, "1", None)
    feed(book, B, "2", None)  # refused: A holds it
    assert book.owner(s) == (A, None)
    feed(book, B, "3", A)  # start over from A
    assert book.owner(s) == (B, A)
    feed(book, A, "1", None)  # a retried copy of A's first claim: ignored
    feed(book, A, "4", None)  # A's old state again: refused
    feed(book, C, "5", A)  # starting over from a former owner: refused
    assert book.owner(s) == (B, A)
    book.apply(1, "claim/t/j/p/k/C/6", b"{}")  # not partition 0, not ours: ignored
    other = ProgressBook("u")  # another topic never sees these
    other.apply(PARTITION, "claim/t/j/p/k/A/1", b'{"kind":"claim","topic":"t"}')
    assert other.owner(s) == (None, None)


def test_start_over_takes_over_and_the_old_incarnation_then_refuses(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    job = job_name()
    old = new_sink(topic)
    old.committer().claim(scope(job, A))
    commit_batch(old, job, A, 0)
    commit_batch(old, job, A, 1)
    left = write_task(old, ctx(job, 0, batch=2, incarnation=A), [rows(20, 5)])  # prepared
    assert left is not None

    new = new_sink(topic)
    with pytest.raises(IncarnationConflictError):
        new.committer().claim(scope(job, B), start_over_from=C)  # not the owner: refused
    claimed = new.committer().claim(scope(job, B), start_over_from=A)
    assert claimed == SinkProgress(owner=B, batch=-1, previous=A)
    # what the coordinator then does: abort what the old incarnation left prepared
    assert new.committer().sweep(scope(job, A), lambda n: n.incarnation == A) == [left["txn"]]
    commit_batch(new, job, B, 0)  # the new incarnation's batch ids start again
    _progress_is(new, scope(job, B), SinkProgress(owner=B, batch=0, previous=A))

    for restored in (old, new_sink(topic)):  # the old state comes back
        with pytest.raises(IncarnationConflictError) as err:
            restored.committer().claim(scope(job, A))
        assert err.value.owner == B
    with pytest.raises(IncarnationConflictError):
        new_sink(topic).committer().claim(scope(job, C))  # a third one without start-over
    assert [(c["incarnation"], c["start_over_from"]) for c in claims_of(bootstrap, topic)] == [
        (A, None),
        (B, A),
    ]
    log = read_topic(bootstrap, topic)
    assert committed_ids(log) == sorted([*range(20), *range(10)]) and log.n_open == 0


def test_commit_refuses_after_another_incarnation_took_over(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    job = job_name()
    running = new_sink(topic)
    running.committer().claim(scope(job, A))
    c = write_task(running, ctx(job, 0, batch=0, incarnation=A), [rows(0, 5)])
    assert c is not None
    new_sink(topic).committer().claim(scope(job, B), start_over_from=A)  # while A runs
    with pytest.raises(IncarnationConflictError, match="while this job was running") as err:
        running.committer().commit([c])
    assert err.value.owner == B
    log = read_topic(bootstrap, topic)
    assert log.committed == [] and log.n_open == 5


def test_a_replay_at_or_below_the_progress_is_aborted_not_committed(
    bootstrap: str, new_sink: Callable[..., KafkaSink], caplog: pytest.LogCaptureFixture
) -> None:
    topic = make_topic(bootstrap)
    job = job_name()
    sink = new_sink(topic)
    sink.committer().claim(scope(job, A))
    batch0 = commit_batch(sink, job, A, 0)
    batch1 = commit_batch(sink, job, A, 1)
    assert sink.committer().progress(scope(job, A)).batch == 1

    # Spark replays batches 0 and 1 (another run, new task attempts), and batch 2 is new
    replays = [
        write_task(sink, ctx(job, 0, batch=b, run=2, attempt=900 + b, incarnation=A), [rows(0, 5)])
        for b in (0, 1)
    ]
    new = write_task(sink, ctx(job, 0, batch=2, run=2, incarnation=A), [rows(20, 5)])
    assert None not in replays and new is not None
    with caplog.at_level(logging.WARNING, logger="sinks.kafka"):
        sink.committer().commit([*replays, new])  # type: ignore[list-item]
    assert "a replay" in caplog.text
    log = read_topic(bootstrap, topic)
    assert committed_ids(log) == list(range(25))
    assert log.n_aborted == 10 and log.n_open == 0
    # the commit of batches that went through, retried: idempotent, as before
    sink.committer().commit([*batch0, *batch1])
    assert committed_ids(read_topic(bootstrap, topic)) == list(range(25))


def test_two_jobs_of_one_name_writing_different_topics_both_run(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    t1, t2 = make_topic(bootstrap), make_topic(bootstrap)
    job = job_name()  # same job, pipeline and sink id; different topics and states
    one, two = new_sink(t1), new_sink(t2)
    assert one.committer().claim(scope(job, A)).owner == A
    assert two.committer().claim(scope(job, B)).owner == B
    commit_batch(one, job, A, 0)
    commit_batch(two, job, B, 0)
    commit_batch(two, job, B, 1)
    _progress_is(one, scope(job, A), SinkProgress(owner=A, batch=0))
    _progress_is(two, scope(job, B), SinkProgress(owner=B, batch=1))
    assert committed_ids(read_topic(bootstrap, t1)) == list(range(10))
    assert committed_ids(read_topic(bootstrap, t2)) == list(range(20))


def test_the_sweep_leaves_another_incarnations_transactions_alone(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(bootstrap)
    job = job_name()
    sink = new_sink(topic)
    theirs = write_task(sink, ctx(job, 0, incarnation=A), [rows(0, 5)])
    ours = write_task(sink, ctx(job, 0, incarnation=B), [rows(5, 5)])
    assert theirs is not None and ours is not None
    assert sink.committer().sweep(scope(job, B), lambda n: True) == [ours["txn"]]
    log = read_topic(bootstrap, topic)
    assert log.n_open == 5 and log.n_aborted == 5
    assert sink.committer().sweep(scope(job, A), lambda n: True) == [theirs["txn"]]
    assert read_topic(bootstrap, topic).n_open == 0


def test_a_start_over_after_a_missed_forget_leaves_the_new_progress_alone(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    """The old incarnation committed batch 3 and died before forget; the sweep of
    its scope after a start-over settles that under the old incarnation, never
    under the new one (whose batch ids start again at 0)."""
    topic = make_topic(bootstrap)
    job = job_name()
    old = new_sink(topic)
    old.committer().claim(scope(job, A))
    commit_batch(old, job, A, 3, forget=False)
    new = new_sink(topic)
    assert new.committer().claim(scope(job, B), start_over_from=A).previous == A
    assert new.committer().sweep(scope(job, A), lambda n: n.incarnation == A) == []
    _progress_is(new, scope(job, B), SinkProgress(owner=B, batch=-1, previous=A))
    commit_batch(new, job, B, 0)  # not taken for a replay of the old batch 3
    _progress_is(new, scope(job, B), SinkProgress(owner=B, batch=0, previous=A))
    log = read_topic(bootstrap, topic)
    assert committed_ids(log) == sorted([*range(30, 40), *range(10)]) and log.n_aborted == 0


# -- versions of the records (a downgrade) ----------------------------------------------


def _registry() -> str:
    """A registry topic of the test's own (preflight creates it): a record of a
    newer version stops every sink of its target that reads the registry."""
    return f"_twophase_reg_{job_name()}"


def _append(bootstrap: str, registry: str, key: bytes, value: dict[str, Any]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        producer.send(registry, key=key, value=json.dumps(value).encode(), partition=PARTITION)
        producer.flush()
    finally:
        producer.close()


def _announce(bootstrap: str, registry: str, tid: str, value: dict[str, Any]) -> None:
    """An announcement as a writer makes it: the first record of a transaction
    (committed here)."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=tid)
    try:
        producer.init_transactions()
        producer.begin_transaction()
        producer.send(registry, key=tid.encode(), value=json.dumps(value).encode())
        producer.commit_transaction()
    finally:
        producer.close()


@pytest.mark.parametrize("kind", ["progress", "claim"])
def test_a_progress_or_claim_record_of_a_newer_version_is_refused(
    bootstrap: str, new_sink: Callable[..., KafkaSink], kind: str
) -> None:
    """A downgrade: the registry holds a progress (or claim) record of version 2,
    which only a newer twophase writes. Reading it as version 1 could make a
    wrong owner or a wrong committed batch; the sink refuses it instead, naming
    the record, where it was read and its version. Records of version 1, and
    those without a version (the first versions'), read as before."""
    topic, registry, job = make_topic(bootstrap), _registry(), job_name()
    sink = new_sink(topic, registry_topic=registry)
    assert sink.committer().claim(scope(job, A)) == SinkProgress(owner=A, batch=-1)  # version 1
    commit_batch(sink, job, A, 0)  # a progress record of version 1 at batch 0
    _progress_is(new_sink(topic, registry_topic=registry), scope(job, A), SinkProgress(A, 0))
    older = {"kind": "progress", "topic": topic, "scope": f"{job}/p/k", "incarnation": A}
    _append(bootstrap, registry, progress_key(topic, scope(job, A)), {**older, "batch": 1})
    _progress_is(new_sink(topic, registry_topic=registry), scope(job, A), SinkProgress(A, 1))

    newer: dict[str, Any] = {"kind": kind, "v": 2, "topic": topic, "scope": f"{job}/p/k"}
    if kind == "progress":
        key = progress_key(topic, scope(job, A))
        newer.update(incarnation=A, batch=5)
    else:
        key = claim_key(topic, scope(job, B), "n-b")
        newer.update(incarnation=B, start_over_from=None, nonce="n-b")
    _append(bootstrap, registry, key, newer)
    for reader in (sink, new_sink(topic, registry_topic=registry)):  # running, and a new start
        with pytest.raises(NewerVersionError) as err:
            reader.committer().progress(scope(job, A))
        message = str(err.value)
        assert f"the record {key.decode()} (registry topic {registry}, partition 0" in message
        assert "is of version 2, written by a newer version of twophase" in message
        assert "reads versions up to 1" in message
        assert (err.value.version, err.value.known) == (2, 1)
    with pytest.raises(NewerVersionError):
        new_sink(topic, registry_topic=registry).committer().claim(scope(job, A))
    # another target's sink reads the same registry: the record is not its
    other = make_topic(bootstrap)
    assert new_sink(other, registry_topic=registry).committer().claim(scope(job, C)).owner == C


def test_an_announcement_of_a_newer_version_is_refused_for_its_topic(
    bootstrap: str, new_sink: Callable[..., KafkaSink]
) -> None:
    """A downgrade: the registry holds an announcement of version 3 for the
    sink's topic (only a newer twophase writes one); the sink refuses it, naming
    the transactional id, where it was read and its version, rather than sweep
    or count it by the rules of version 2. One for another topic is not the
    sink's and is left alone; version 2 and 1 announcements read as before."""
    topic, registry, job = make_topic(bootstrap), _registry(), job_name()
    sink = new_sink(topic, registry_topic=registry)
    sink.committer().claim(scope(job, A))
    commit_batch(sink, job, A, 0, forget=False)  # version-2 announcements, committed
    _progress_is(new_sink(topic, registry_topic=registry), scope(job, A), SinkProgress(A, 0))
    v1 = str(ctx(job, 0, batch=1, incarnation=A).txn_name())  # the id names it
    _announce(bootstrap, registry, v1, {"topic": topic, "v": 1})
    _progress_is(new_sink(topic, registry_topic=registry), scope(job, A), SinkProgress(A, 1))
    assert json.loads(announcement(topic, "x"))["v"] == 2

    later = str(ctx(job, 0, batch=2, incarnation=A).txn_name())
    _announce(bootstrap, registry, f"elsewhere.{later}", {"topic": "another", "v": 3})
    _progress_is(new_sink(topic, registry_topic=registry), scope(job, A), SinkProgress(A, 1))
    _announce(bootstrap, registry, later, {"topic": topic, "txn": later, "v": 3})
    for reader in (sink, new_sink(topic, registry_topic=registry)):
        with pytest.raises(NewerVersionError) as err:
            reader.committer().progress(scope(job, A))
        message = str(err.value)
        assert f"the announcement of transactional id {later} (registry topic {registry}" in message
        assert "is of version 3" in message and "reads versions up to 2" in message
    with pytest.raises(NewerVersionError):
        sink.committer().sweep(scope(job, A), lambda n: True)
