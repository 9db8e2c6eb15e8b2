"""The Kafka broker dies (SIGKILL) and comes back, restarted on the same port.

Jobs run through the outage against Apache Kafka, the broker users run, killed
(SIGKILL of its JVM) and started again on the same log directory, as a crashed
broker restarts: while executors write, and while the driver commits. The
client-side tests without Spark (a commit waiting for the broker, a writer whose
partitions join its transaction after the restart) run on both brokers.

tansu stays for what only it lets a test do: its whole state is objects in S3
(a moto server on loopback, ``tests/s3server.py``) that a test can read and
edit, so a test can check what survives a kill and put the broker in the state
a kill inside EndTxn leaves (which no test can time on Apache Kafka).

What tansu 0.6 keeps in the bucket, each written before it answers the request:
the record batches (one object each), a watermark per partition, and one
metadata document with the topics, every producer id with its epochs and
sequence numbers, and every transactional id with its producer id, epochs and,
per epoch, the transaction's state and the partitions (offset ranges) it wrote.
So a broker killed *between* requests comes back with everything: the log,
the producer id counter, the epochs (fencing) and the open transactions, which
the driver then commits or aborts as if nothing happened (checked below).

A broker killed *inside* a request can leave these out of step, because one
request is several object writes and tansu does not recover on start:

* a produce persists the producer's next sequence number, then the watermark,
  then the batch: killed in between, the client's retry is answered
  DUPLICATE_SEQUENCE_NUMBER and looks written (offset -1) though the batch is
  gone. The writer refuses such a write (``UnconfirmedWriteError``, the task is
  retried; ``test_kafka_unit.py`` pins it down deterministically);
* an EndTxn persists the decision (PrepareCommit), then writes a marker per
  partition: killed in between, a retried EndTxn answers success and writes
  none of the missing markers, so the transaction stays open for good (its
  rows invisible, the partition's last stable offset stuck). The driver checks
  the log after a retried EndTxn and fails the commit instead of reporting it
  done (``test_a_commit_the_broker_half_wrote_is_an_error_not_silence``);
* a batch lost after its watermark was bumped leaves a gap of offsets. A gap
  inside a partition is skipped by every reader; at its end, a raw reader sees
  no records below the high watermark until something is appended.

On the client side, kafka-python 3.0.12 drops an AddPartitionsToTxn it tries
to send while the coordinator is unreachable; the writers' producers work
around it (``test_a_writer_rides_out_a_restart_before_its_partitions_join...``).

The Spark tests therefore kill the broker while writers are busy (any produce
may be cut: the writers' checks and Spark's task retries must absorb it) and,
for the driver's commit, at a point between EndTxn requests.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import pytest

from lifecycle.ledger import read_ledger
from lifecycle.testing import jars
from lifecycle.testing.apache_kafka import ApacheKafka
from lifecycle.testing.kafka_broker import KafkaBroker
from sinks.errors import CommitError, TransactionLostError, UnconfirmedWriteError
from sinks.kafka import KafkaSink
from sinks.kafka.log import read_topic
from sinks.kafka.wire import KafkaWire
from tests import tiers
from tests.conftest import write_input
from tests.kafkacheck import read_settled, txn_outcomes
from tests.multisink import LABELS, Run
from tests.procs import JobProcess, wait_for
from tests.s3server import S3Server
from tests.test_kafka_unit import SCHEMA, committed_ids, ctx, job_name, make_topic, rows, write_task
from tests.tiers import SLOW

pytestmark = pytest.mark.crash

OUTAGE_S = 3.0
META = "clusters/tansu_cluster/meta.json"
"""tansu's metadata document in the bucket (cluster id ``tansu_cluster``, its default)"""


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


class S3Broker(KafkaBroker):
    """A tansu broker on its own bucket of ``s3``, which tests can read and edit."""

    def __init__(self, s3: S3Server) -> None:
        self.s3 = s3
        self.bucket = f"tansu-{uuid.uuid4().hex[:10]}"
        s3.create_bucket(self.bucket)
        super().__init__(storage=f"s3://{self.bucket}/", env=s3.tansu_env())

    def meta(self) -> dict:  # type: ignore[type-arg]
        body = self.s3.client().get_object(Bucket=self.bucket, Key=META)["Body"].read()
        return json.loads(body)  # type: ignore[no-any-return]

    def put_meta(self, doc: dict) -> None:  # type: ignore[type-arg]
        self.s3.client().put_object(Bucket=self.bucket, Key=META, Body=json.dumps(doc).encode())


@pytest.fixture
def broker(s3: S3Server) -> Iterator[S3Broker]:
    b = S3Broker(s3)
    b.start()
    try:
        yield b
    finally:
        b.cleanup()


@pytest.fixture
def apache_broker() -> Iterator[ApacheKafka]:
    """An Apache Kafka broker of the test's own (it is killed and restarted)."""
    jars.require("kafka-broker")
    with ApacheKafka() as b:
        yield b


class Restartable(Protocol):
    bootstrap: str

    def kill(self) -> None: ...

    def start(self) -> None: ...


def _restart_later(broker: Restartable, delay: float = OUTAGE_S) -> threading.Thread:
    """Start the (killed) broker again after ``delay`` seconds, in a thread."""

    def run() -> None:
        time.sleep(delay)
        broker.start()

    t = threading.Thread(target=run, name="broker-restart", daemon=True)
    t.start()
    return t


@pytest.fixture(params=["apache", pytest.param("tansu", marks=tiers.SLOW)])
def any_broker(request: pytest.FixtureRequest) -> Restartable:
    """Each broker in turn (tansu, the stand-in, in the slow tier)."""
    name = "apache_broker" if request.param == "apache" else "broker"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def _sink(broker: Restartable, topic: str, **kw: object) -> KafkaSink:
    sink = KafkaSink(broker.bootstrap, topic, key="id", sink_id="k", **kw)  # type: ignore[arg-type]
    sink.preflight(SCHEMA)
    return sink


@pytest.fixture
def new_sink(broker: S3Broker) -> Iterator[Callable[..., KafkaSink]]:
    made: list[KafkaSink] = []

    def build(topic: str, **kw: object) -> KafkaSink:
        made.append(_sink(broker, topic, **kw))
        return made[-1]

    yield build
    for sink in made:
        sink.close()


# -- without Spark: what survives -------------------------------------------------------


def test_log_producer_ids_and_transactions_survive_a_kill(
    broker: S3Broker, new_sink: Callable[..., KafkaSink]
) -> None:
    topic = make_topic(broker.bootstrap, partitions=3)
    sink = new_sink(topic, commit_timeout=30)
    job = job_name()
    committed = write_task(sink, ctx(job, 0), [rows(0, 100)])
    assert committed is not None
    sink.committer().commit([committed])
    prepared = write_task(sink, ctx(job, 1), [rows(100, 100)])  # open, to commit after the kill
    fenced = write_task(sink, ctx(job, 2), [rows(200, 50)])  # aborted by a fence (epoch + 1)
    assert prepared is not None and fenced is not None
    sink.committer().abort([fenced])
    state = broker.meta()["transactions"][prepared["transactional_id"]]
    assert state["producer"] == prepared["producer_id"]
    assert state["epochs"][str(prepared["epoch"])]["state"] == "Begin"
    before = read_topic(broker.bootstrap, topic)
    assert before.n_open == 100 and before.n_aborted == 50

    broker.kill()
    broker.start()

    after = read_topic(broker.bootstrap, topic)  # the log, markers included
    assert after.committed == before.committed and after.open == before.open
    assert after.aborted == before.aborted and after.markers == before.markers
    # the open transaction: its producer id, epoch and partitions are known, so
    # EndTxn is answered at once (tansu closes the connection for an unknown
    # producer or a stale epoch) and writes a marker on each partition it wrote
    tid = prepared["transactional_id"]
    with KafkaWire(broker.bootstrap) as wire:
        coordinator = wire.find_coordinators([tid])[tid]
        assert wire.end_txn(coordinator, tid, prepared["producer_id"], prepared["epoch"], True)
    log = read_settled(broker.bootstrap, topic)  # Apache Kafka writes markers after EndTxn
    assert committed_ids(log) == list(range(200)) and log.n_open == 0
    assert log.markers == before.markers + len(prepared["partitions"])
    sink.committer().commit([prepared])  # the driver's own commit: idempotent
    # the fence survived: the aborted transaction cannot be committed
    with pytest.raises(TransactionLostError, match="was aborted"):
        sink.committer().commit([fenced])
    # producer ids are not handed out again (the log resolves markers by producer id)
    fresh = write_task(sink, ctx(job, 3), [rows(250, 10)])
    assert fresh is not None
    assert fresh["producer_id"] > max(c["producer_id"] for c in (committed, prepared, fenced))
    sink.committer().commit([fresh])
    log = read_settled(broker.bootstrap, topic)  # Apache Kafka writes markers after EndTxn
    assert committed_ids(log) == [*range(200), *range(250, 260)] and log.n_open == 0


def test_a_commit_waits_for_a_restarting_broker(any_broker: Restartable) -> None:
    """Killed after prepare, before the driver's commit: the commit waits
    (kafka-python's reconnect backoff, then the sink's retries, within
    ``commit_timeout``) until the broker is back, then commits."""
    broker = any_broker
    topic = make_topic(broker.bootstrap, partitions=3)
    sink = _sink(broker, topic, commit_timeout=90)
    job = job_name()
    cs = [write_task(sink, ctx(job, p), [rows(p * 100, 100)]) for p in range(2)]
    committables = [c for c in cs if c is not None]
    broker.kill()
    restart = _restart_later(broker)
    started = time.monotonic()
    try:
        sink.committer().commit(committables)
    finally:
        sink.close()
    took = time.monotonic() - started
    restart.join()
    assert took >= OUTAGE_S - 0.5, took  # it could only commit once the broker was back
    log = read_settled(broker.bootstrap, topic)  # Apache Kafka writes markers after EndTxn
    assert committed_ids(log) == list(range(200)) and log.n_open == 0


def test_a_writer_rides_out_a_restart_before_its_partitions_join_the_transaction(
    any_broker: Restartable,
) -> None:
    """The broker dies after a writer took its producer id and before its
    first records: the producer must add the partitions (the registry's and the
    topic's, in one request) to the transaction (AddPartitionsToTxn) against a
    dead coordinator, and retry it until the coordinator answers again
    (kafka-python 3.0.12's own producer dropped that request and its records
    waited 2 minutes for ``delivery_timeout_ms``); then its announcement and
    records go out over the same, reconnected, connection. One partition, so
    that no later partition sends a new AddPartitionsToTxn."""
    broker = any_broker
    topic = make_topic(broker.bootstrap, partitions=1)
    sink = _sink(broker, topic, commit_timeout=60, flush_timeout=40)
    w = sink.open_writer(ctx(job_name(), 0), SCHEMA)
    w._begin()  # the producer id taken; no partition in the transaction yet (nor announced)
    broker.kill()
    restart = _restart_later(broker)
    started = time.monotonic()
    w.write(rows(0, 300))
    c = w.prepare()
    took = time.monotonic() - started
    w.close()
    restart.join()
    assert c is not None and took < 35, took
    try:
        sink.committer().commit([c])
    finally:
        sink.close()
    log = read_settled(broker.bootstrap, topic)  # Apache Kafka writes markers after EndTxn
    assert committed_ids(log) == list(range(300)) and log.n_open == 0


def test_a_commit_the_broker_half_wrote_is_an_error_not_silence(
    broker: S3Broker, new_sink: Callable[..., KafkaSink]
) -> None:
    """The broker is killed inside EndTxn, after persisting the decision
    (PrepareCommit) and before writing the markers; here its bucket is put in
    that state, which a SIGKILL at the wrong instant leaves. The driver's retry
    is answered success, yet no marker is ever written: the commit must fail
    saying so, not report rows committed that no consumer will see."""
    topic = make_topic(broker.bootstrap, partitions=3)
    sink = new_sink(topic, commit_timeout=8)
    c = write_task(sink, ctx(job_name(), 0), [rows(0, 60)])
    assert c is not None
    broker.kill()
    meta = broker.meta()
    epoch = meta["transactions"][c["transactional_id"]]["epochs"][str(c["epoch"])]
    epoch["state"] = "PrepareCommit"
    broker.put_meta(meta)
    restart = _restart_later(broker, 2.0)
    started = time.monotonic()
    with pytest.raises(CommitError, match=r"answered success.*no COMMIT marker"):
        sink.committer().commit([c])
    restart.join()
    assert time.monotonic() - started >= 8
    log = read_settled(broker.bootstrap, topic)  # Apache Kafka writes markers after EndTxn
    assert log.committed == [] and log.n_open == 60  # stuck open: tansu cannot finish it


# -- with Spark: a job through the outage ----------------------------------------------------


def _announced(bootstrap: str, job: str) -> bool:
    """Whether a writer of ``job`` has opened its transaction (its announcement
    in the registry topic, which preflight creates)."""
    try:
        return bool(txn_outcomes(bootstrap, job))
    except LookupError:  # no registry topic yet
        return False


def _decided(state: Path) -> bool:
    """Whether the job's ledger holds a decided checkpoint not yet committed."""
    doc = read_ledger(state)
    return doc is not None and doc["decided"] is not None


def _outage(broker: Restartable, proc: JobProcess, when: Callable[[], bool], what: str) -> float:
    """Kill the broker as soon as ``when()``, start it again ``OUTAGE_S`` later;
    return the time of the kill."""
    wait_for(when, 120, what, proc)
    killed = time.monotonic()
    broker.kill()
    time.sleep(OUTAGE_S)
    broker.start()
    return killed


def _run(tmp: Path, broker: Restartable, files: int, rows_per_file: int) -> tuple[Run, int]:
    topic = make_topic(broker.bootstrap, partitions=3)
    n = write_input(tmp / "in", files=files, rows_per_file=rows_per_file)
    return Run(tmp, None, broker.bootstrap, topic, sinks="kafka"), n


@tiers.SLOW  # the writer side of a restart: the default run's ..._before_its_partitions_join_...
def test_job_rides_out_a_broker_killed_while_executors_write(
    apache_broker: ApacheKafka, tmp_path: Path
) -> None:
    """Each first task of batch 0 pauses 1 s after its first Arrow batch (10,000
    rows of its 15,000 sent, in an open transaction): the broker is killed then
    and is back 3 s later. Sends cut or queued meanwhile are retried by the
    producer; a task whose retried produce the broker cannot place fails
    (UnconfirmedWriteError) and Spark's second attempt writes it again. The job
    finishes by itself."""
    broker = apache_broker
    run, n = _run(tmp_path, broker, files=4, rows_per_file=15_000)
    started = time.monotonic()
    proc = run.start("executor.write@0#0=stall:1", files_per_batch=2, wait=False)
    killed = _outage(broker, proc, lambda: _announced(broker.bootstrap, run.job), "a writer")
    assert proc.wait(120) == 0, proc.tail()
    print(
        f"TIMING writers: kill after {killed - started:.1f}s, job done "
        f"{time.monotonic() - killed:.1f}s after the kill; task retries: "
        f"{proc.output().count(UnconfirmedWriteError.__name__)} mention(s) of "
        f"{UnconfirmedWriteError.__name__}"
    )
    assert proc.result()["rows"] == {LABELS["kafka"]: n}
    run.check(n)


@SLOW  # about a minute; a commit waiting for a restarting broker is the default run's
def test_job_rides_out_a_broker_killed_while_the_driver_commits(
    apache_broker: ApacheKafka, tmp_path: Path
) -> None:
    """The driver has decided the checkpoint of batch 0 and pauses 2 s before
    committing it: the broker is killed then and is back 3 s later, so the
    commit starts against a dead broker and retries until it is back
    (``commit_timeout`` 120 s). The job finishes by itself."""
    broker = apache_broker
    run, n = _run(tmp_path, broker, files=4, rows_per_file=500)
    started = time.monotonic()
    proc = run.start("driver.before_commit@0=stall:2", files_per_batch=2, wait=False)
    killed = _outage(broker, proc, lambda: _decided(run.state), "the first decided checkpoint")
    assert proc.wait(120) == 0, proc.tail()
    print(
        f"TIMING commit: kill after {killed - started:.1f}s, job done "
        f"{time.monotonic() - killed:.1f}s after the kill"
    )
    assert re.search(r"commit of \d+ transaction\(s\) to .* failed \(attempt 1", proc.output())
    doc = read_ledger(run.state)
    assert doc is not None and len(doc["history"]) >= 2  # batch 0's checkpoint, then more
    run.check(n)


@tiers.SLOW
def test_an_outage_longer_than_commit_timeout_fails_the_job_and_a_rerun_finishes(
    apache_broker: ApacheKafka, tmp_path: Path
) -> None:
    """As above, with ``commit_timeout`` 5 s and the broker down until the job
    has given up: the job fails naming the commit that did not go through, the
    decision stays in the ledger, and a run after the broker is back commits
    it and finishes the input."""
    broker = apache_broker
    run, n = _run(tmp_path, broker, files=4, rows_per_file=500)
    extra = ["--commit-timeout", "5"]
    proc = run.start("driver.before_commit@0=stall:2", files_per_batch=2, extra=extra, wait=False)
    wait_for(lambda: _decided(run.state), 120, "the first decided checkpoint", proc)
    broker.kill()
    killed = time.monotonic()
    assert proc.wait(120) != 0, proc.tail()
    failed = time.monotonic() - killed
    assert "did not succeed within 5s" in proc.output(), proc.tail()
    doc = read_ledger(run.state)
    assert doc is not None and doc["decided"] is not None  # the decision is kept
    broker.start()
    rerun = run.start(files_per_batch=2, extra=extra)
    assert rerun.proc.returncode == 0, rerun.tail()
    print(f"TIMING fail: the job failed {failed:.1f}s after the kill")
    run.check(n)
