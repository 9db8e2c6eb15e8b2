"""Read-process-write with Spark's own Kafka source, under driver SIGKILLs.

The job is ``examples/read_process_write.py`` (run by ``tests/jobs/kafka_source_job.py``):
two pipelines read Apache Kafka with ``spark.readStream.format("kafka")``:

* ``history``, bounded (available-now), over a topic that holds all its input
  before the job starts;
* ``live``, unbounded, over a topic a producer fills while the job runs (and
  while it is killed); the job drains once the producer is done;

and both write every order, priced, to a Kafka topic, a PostgreSQL table and a
Delta table. ``crash_test`` SIGKILLs the driver at random instants and at the
commit protocol's dangerous points, then runs the job to its end. Afterwards
each input record's output is in each sink exactly once, read the way users
read: the Kafka topic by a read_committed consumer (librdkafka's, and Spark's
Kafka source with ``kafka.isolation.level=read_committed``) and from the raw
log, PostgreSQL by SQL, Delta by delta-spark. A start after the final
checkpoint reads nothing again.

Consumer-group offsets (:mod:`lifecycle.source_offsets`): while the job runs
and is killed, a watcher reads each pipeline's group (``twophase.<job>.<p>``)
with the Admin API, then the ledger's last completed checkpoint and Spark's
offset log of its batch: the group never holds an offset beyond what that
checkpoint covers. Once the job has caught up, each group's lag is 0. Then the
groups are set wrong (back to 0) while the job is down: the next start reads
nothing again (recovery never reads the group) and puts them right. The slow
variant kills the job after every sink committed a checkpoint, before the
ledger recorded it, sets the groups wrong, and checks the output exactly once.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lifecycle.kafka_source import parse_offsets
from lifecycle.ledger import read_ledger
from lifecycle.spark_log import SparkCommitLog
from lifecycle.testing import crash_test, jars
from tests import deltacheck
from tests.kafkacheck import assert_nothing_open, consume_ids
from tests.procs import run_job
from tests.test_apache_kafka import _spark_read, _topic
from tests.test_source_offsets import _end_offsets, _group_offsets, _set_group

JOB = str(Path(__file__).parent / "jobs" / "kafka_source_job.py")
HISTORY = range(0, 600)
LIVE = range(100_000, 100_600)

pytestmark = pytest.mark.crash


def _produce(bootstrap: str, topic: str, ids: range) -> None:
    """Orders ``ids`` into ``topic`` (plain, acknowledged by all replicas)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    try:
        for i in ids:
            order = {"id": i, "customer": f"c{i % 17}", "amount": i / 4}
            producer.send(topic, key=str(i).encode(), value=json.dumps(order).encode())
        producer.flush(30)
    finally:
        producer.close(5)


class _LiveFeed(threading.Thread):
    """Fills the live topic in small chunks, one a second, until the crash
    test starts its third run (its log names each run as it starts), so that
    the first two runs, killed at a random instant and at a fault point, find
    live input however fast the job drains; then writes the rest and the file
    that tells the job to drain (after 40 chunks at the latest)."""

    CHUNK = 15

    def __init__(self, bootstrap: str, topic: str, drain_file: Path, crash_log: Path) -> None:
        super().__init__(name="live-feed", daemon=True)
        self.bootstrap, self.topic, self.drain_file = bootstrap, topic, drain_file
        self.crash_log = crash_log
        self.error: BaseException | None = None

    def _runs_started(self) -> int:
        if not self.crash_log.exists():
            return 0
        return self.crash_log.read_text(errors="replace").count("\n===== ")

    def run(self) -> None:
        try:
            time.sleep(5)  # the first run starts reading an empty live topic
            start = LIVE.start
            while start < LIVE.stop and self._runs_started() < 3:
                end = min(start + self.CHUNK, LIVE.stop)
                _produce(self.bootstrap, self.topic, range(start, end))
                start = end
                time.sleep(1.0)
            if start < LIVE.stop:
                _produce(self.bootstrap, self.topic, range(start, LIVE.stop))
            self.drain_file.write_text("drain")
        except BaseException as e:  # the test reports it
            self.error = e


def test_kafka_in_kafka_postgres_delta_out_is_exact_after_kills(  # type: ignore[no-untyped-def]
    spark, twophase_apache_kafka, pg_dsn, tmp_path: Path
):
    jars.require("spark-kafka")
    bootstrap = twophase_apache_kafka.bootstrap
    history, live, priced = (_topic(bootstrap, partitions=2) for _ in range(3))
    table = f"priced_{uuid.uuid4().hex[:8]}"
    job = f"rpw{uuid.uuid4().hex[:8]}"
    delta = tmp_path / "delta"
    _produce(bootstrap, history, HISTORY)
    drain_file = tmp_path / "drain"
    args = ["--bootstrap", bootstrap, "--dsn", pg_dsn, "--delta", str(delta)]
    args += ["--state", str(tmp_path / "state"), "--job", job, "--table", table]
    args += ["--topics", f"{history},{live},{priced}", "--per-batch", "150"]
    args += ["--drain-when", str(drain_file)]
    feed = _LiveFeed(bootstrap, live, drain_file, tmp_path / "crash.log")
    feed.start()
    groups = {p: f"twophase.{job}.{p}" for p in ("history", "live")}
    watch = _GroupWatch(bootstrap, tmp_path / "state", groups)
    watch.start()
    report = crash_test(
        JOB,
        kills=3,
        seed=29,
        args=args,
        min_delay=10.0,
        max_delay=20.0,
        timeout=300.0,
        log=tmp_path / "crash.log",
    )
    feed.join(120)
    watch.finish()
    print(report)
    assert feed.error is None, feed.error
    assert report.kills >= 2, f"the job was killed too rarely:\n{report}"
    assert not watch.beyond, f"a group ran ahead of the completed checkpoints: {watch.beyond}"
    assert watch.seen >= 5, f"the groups were seen with offsets {watch.seen} time(s) only"

    want = {i: "history" for i in HISTORY} | {i: "live" for i in LIVE}
    _assert_each_once(bootstrap, priced, job, pg_dsn, table, delta, spark, want)
    _assert_caught_up(bootstrap, tmp_path / "state", groups, {"history": history, "live": live})

    # a start after the shared final checkpoint reads nothing again, whatever the
    # groups say (recovery never reads them), and puts the groups right
    for group in groups.values():
        _set_group(bootstrap, group, dict.fromkeys(_group_offsets(bootstrap, group), 0))
    again = run_job("kafka_source_job.py", args, tmp_path / "again.log", timeout=180)
    assert again.proc.returncode == 0, again.tail()
    assert again.result()["checkpoints"] == 0 and not any(again.result()["rows"].values())
    _assert_each_once(bootstrap, priced, job, pg_dsn, table, delta, spark, want)
    _assert_caught_up(bootstrap, tmp_path / "state", groups, {"history": history, "live": live})


@pytest.mark.slow
def test_a_killed_job_commits_no_group_offsets_beyond_its_checkpoints_and_never_reads_them(  # type: ignore[no-untyped-def]
    spark, twophase_apache_kafka, pg_dsn, tmp_path: Path
):
    """Killed after every sink committed a checkpoint and before the ledger
    recorded it: each group holds at most what the ledger's last completed
    checkpoint covers. With the groups then set wrong (history back to 0, live
    at its end), the restarted job still writes each order once."""
    jars.require("spark-kafka")
    bootstrap = twophase_apache_kafka.bootstrap
    history, live, priced = (_topic(bootstrap, partitions=2) for _ in range(3))
    table = f"priced_{uuid.uuid4().hex[:8]}"
    job = f"rpw{uuid.uuid4().hex[:8]}"
    delta, state = tmp_path / "delta", tmp_path / "state"
    many, few = range(0, 1500), range(100_000, 100_300)
    _produce(bootstrap, history, many)
    _produce(bootstrap, live, few)
    drain_file = tmp_path / "drain"
    drain_file.write_text("drain")  # live reads what its topic holds, then ends
    args = ["--bootstrap", bootstrap, "--dsn", pg_dsn, "--delta", str(delta)]
    args += ["--state", str(state), "--job", job, "--table", table]
    args += ["--topics", f"{history},{live},{priced}", "--per-batch", "150"]
    args += ["--drain-when", str(drain_file)]
    groups = {p: f"twophase.{job}.{p}" for p in ("history", "live")}
    topics = {"history": history, "live": live}

    fault = ";".join(f"driver.after_commit@{b}=kill" for b in range(3, 9))
    first = run_job("kafka_source_job.py", args, tmp_path / "job.log", fault=fault)
    assert first.killed(), f"the job was not killed at driver.after_commit:\n{first.tail()}"
    for p, group in groups.items():
        held, covered = _group_offsets(bootstrap, group), _covered(state, p)
        assert all(o <= covered.get(tp, 0) for tp, o in held.items()), (p, held, covered)

    _set_group(bootstrap, groups["history"], dict.fromkeys(_end_offsets(bootstrap, history), 0))
    _set_group(bootstrap, groups["live"], _end_offsets(bootstrap, live))
    final = run_job("kafka_source_job.py", args, tmp_path / "job.log")
    assert final.proc.returncode == 0, final.tail()
    want = {i: "history" for i in many} | {i: "live" for i in few}
    _assert_each_once(bootstrap, priced, job, pg_dsn, table, delta, spark, want)
    _assert_caught_up(bootstrap, state, groups, topics)


def _assert_each_once(
    bootstrap: str,
    topic: str,
    job: str,
    dsn: str,
    table: str,
    delta: Path,
    spark: Any,
    want: dict[int, str],
) -> None:
    """Each order of ``want`` (id -> pipeline) once in each sink, priced."""

    def once(name: str, ids: list[int]) -> None:
        twice = sorted(i for i, c in Counter(ids).items() if c > 1)
        missing = sorted(set(want) - set(ids))
        extra = sorted(set(ids) - set(want))
        assert not (twice or missing or extra), (
            f"{name}: {len(ids)} rows; twice {twice[:5]}, missing {missing[:5]}, extra {extra[:5]}"
        )

    assert_nothing_open(bootstrap, topic, job)
    once("kafka (librdkafka, read_committed)", consume_ids(bootstrap, topic, "read_committed"))
    once("kafka (Spark, read_committed)", _spark_read(spark, bootstrap, topic, "read_committed"))
    with psycopg.connect(dsn) as c:
        rows = c.execute(f"SELECT id, cents, source FROM {table}").fetchall()
    once("postgres", [r[0] for r in rows])
    assert all(cents == round(i / 4 * 100) and src == want[i] for i, cents, src in rows)
    delta_rows = deltacheck.delta_spark_rows(spark, delta)  # (id, customer, amount, cents, source)
    once("delta (delta-spark)", [r[0] for r in delta_rows])
    assert all(r[4] == want[r[0]] for r in delta_rows)
    deltacheck.assert_nothing_staged(delta)


# -- consumer-group offsets ---------------------------------------------------------


def _covered(state: Path, pipeline: str) -> dict[tuple[str, int], int]:
    """The end offsets of the last batch of ``pipeline`` a completed checkpoint
    committed: the ledger's committed cut, in Spark's offset log."""
    doc = read_ledger(state) or {}
    cut = int(doc.get("committed_cut", {}).get(pipeline, -1))
    if cut < 0:
        return {}
    lines = SparkCommitLog(state, f"pipelines/{pipeline}/spark").planned_offsets(cut)
    assert lines, f"Spark's offset log lacks batch {cut} of {pipeline}"
    return parse_offsets(lines[0])


def _assert_caught_up(
    bootstrap: str, state: Path, groups: dict[str, str], topics: dict[str, str]
) -> None:
    """Each group holds its topic's end offsets (lag 0), the end offsets of
    the last completed checkpoint."""
    for p, group in groups.items():
        held = _group_offsets(bootstrap, group)
        assert held == _end_offsets(bootstrap, topics[p]) == _covered(state, p), (p, held)


class _GroupWatch(threading.Thread):
    """Reads each pipeline's group, then what the completed checkpoints cover
    (in that order: what they cover only grows), every second while the
    job runs and is killed; ``beyond`` lists every offset found ahead."""

    def __init__(self, bootstrap: str, state: Path, groups: dict[str, str]) -> None:
        super().__init__(name="group-watch", daemon=True)
        self.bootstrap, self.state, self.groups = bootstrap, state, groups
        self.beyond: list[tuple[str, dict[tuple[str, int], int], dict[tuple[str, int], int]]] = []
        self.seen = 0  # looks that found offsets in a group
        self._done = threading.Event()

    def run(self) -> None:
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap)
        try:
            while not self._done.wait(1.0):
                for p, group in self.groups.items():
                    try:
                        held = _group_offsets(self.bootstrap, group, admin)
                        covered = _covered(self.state, p) if held else {}
                    except Exception:  # no group, ledger or offset log yet
                        continue
                    self.seen += bool(held)
                    if any(o > covered.get(tp, 0) for tp, o in held.items()):
                        self.beyond.append((p, held, covered))
        finally:
            admin.close()

    def finish(self) -> None:
        self._done.set()
        self.join(30)
