"""The job on a Spark standalone cluster (``-m cluster``): a master and two
one-core workers started from the pip package (``tests/sparkcluster.py``),
executors in their own JVMs with Python workers of their own.

What these tests hold the project to, beyond the local-mode suite:

* **The deployment path of docs/deploying.md.** Executors run the Python of a packed
  virtual environment shipped with ``spark.archives`` (``tests/executor_env.py``:
  the project installed from a built wheel, not from this checkout), and a task
  proves it: ``sinks.__file__`` on the executor lies inside the unpacked archive.
* **Executors never touch the driver's disk.** The workers run in a private
  mount namespace where the directory holding every test's ``state_dir`` (and
  this checkout's ``sinks/`` and ``lifecycle/``) is covered by an empty
  read-only tmpfs: any executor that tried to read the ledger, a Spark commit
  log or a control file would fail. Inputs and Delta tables live in a directory
  both sides see: the stand-in for shared storage.
* **Executors and workers die.** A fault kills the executor JVM (or the whole
  worker: its process group, executors included) right after a task prepared
  its work; Spark reschedules the task elsewhere, and every row is in
  PostgreSQL, Kafka and Delta exactly once, nothing prepared, open or staged.
  Each fault fires once (a token file): after an executor is lost, Spark starts
  attempt numbers again, so a fault keyed on ``#0`` would fire on the retry too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from lifecycle.ledger import read_ledger
from tests import deltacheck
from tests.conftest import write_input
from tests.executor_env import ROOT, executor_archive
from tests.kafkacheck import assert_exactly_once as kafka_exactly_once
from tests.kafkacheck import assert_nothing_open
from tests.multisink import Run
from tests.pgcheck import assert_exactly_once, job_prepared
from tests.procs import JobProcess, run_job, wait_for
from tests.sparkcluster import SparkCluster
from tests.sparkutil import EXECUTOR_ENV_ENV, MASTER_ENV, SPECULATION_ENV

pytestmark = pytest.mark.cluster


@dataclass
class ClusterRun:
    """Where one test's files go and the environment its jobs run with."""

    driver: Path  # the driver's private disk: state dirs (hidden from workers)
    shared: Path  # inputs, Delta tables, fault tokens (seen by both sides)
    env: dict[str, str]


@pytest.fixture(scope="session")
def driver_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("driver-only")


@pytest.fixture(scope="session")
def spark_cluster(
    tmp_path_factory: pytest.TempPathFactory, driver_only: Path
) -> Iterator[SparkCluster]:
    # the driver's disk: state dirs, this checkout's packages, and the driver's
    # own interpreter (executors must run the archive's, never this one)
    hide = [driver_only, ROOT / "sinks", ROOT / "lifecycle"]
    if sys.prefix != sys.base_prefix:
        hide.append(Path(sys.prefix) / "bin")
    with SparkCluster(tmp_path_factory.mktemp("cluster"), workers=2, hide=hide) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def executor_env() -> Path:
    return executor_archive()


@pytest.fixture
def on_cluster(
    spark_cluster: SparkCluster, executor_env: Path, driver_only: Path, tmp_path: Path
) -> ClusterRun:
    spark_cluster.ensure_workers()  # an earlier test may have killed one
    driver = driver_only / tmp_path.name
    driver.mkdir()
    tokens = tmp_path / "fault-tokens"
    tokens.mkdir()
    env = {
        MASTER_ENV: spark_cluster.url,
        EXECUTOR_ENV_ENV: str(executor_env),
        "TWOPHASE_FAULT_TOKENS": str(tokens),
    }
    return ClusterRun(driver, tmp_path, env)


def _orders(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8, part bigint)"
        )


def _run(
    on: ClusterRun,
    dsn: str,
    bootstrap: str,
    topic: str,
    sinks: str,
    delta_write_with: str | None = None,
) -> Run:
    """A multi-sink job run writing ``sinks`` (a comma-separated subset of
    pg, kafka, delta), its state on the driver's disk, everything else shared."""
    return Run(
        on.shared,
        dsn if "pg" in sinks else None,
        bootstrap if "kafka" in sinks else None,
        topic if "kafka" in sinks else None,
        sinks=sinks,
        state=on.driver / "state",
        env=on.env,
        delta_write_with=delta_write_with,
    )


# -- the deployment path and each sink end to end ------------------------------------------


@pytest.mark.parametrize("sink", ["pg", "kafka", "delta"])
def test_each_sink_end_to_end_on_the_cluster(  # type: ignore[no-untyped-def]
    on_cluster, pg_dsn, kafka_bootstrap, kafka_topic, sink
):
    _orders(pg_dsn)
    run = _run(on_cluster, pg_dsn, kafka_bootstrap, kafka_topic(3), sink)
    n = write_input(on_cluster.shared / "in", files=3, rows_per_file=200)
    proc = run.start(extra=["--probe", str(_driver_only_file(on_cluster))])
    assert proc.proc.returncode == 0, proc.tail(5000)
    assert proc.result()["committed"] is True
    run.check(n)
    _assert_deployed(proc)


def _driver_only_file(on: ClusterRun) -> Path:
    secret = on.driver / "driver-only.txt"
    secret.write_text("executors must not see this file")
    return secret


def _assert_deployed(proc: JobProcess) -> None:
    """The job's executors ran the archive's Python and the wheel's packages,
    and could not see the driver's disk (the ``--probe`` of the job)."""
    probes = _probes(proc)
    for p in probes:
        # the executor's Python is the archive's, with the project from the wheel
        assert p["python"].startswith(p["cwd"] + "/environment/"), p
        assert p["sinks"].startswith(p["cwd"] + "/environment/lib/"), p
        assert "/site-packages/sinks/" in p["sinks"], p
        assert not p["sinks"].startswith(str(ROOT) + "/sinks"), p
        assert p["sees_driver_path"] is False, p  # the driver's disk is out of reach


def _probes(proc: JobProcess) -> list[dict[str, object]]:
    line = proc.output().rsplit("EXECUTORS ", 1)[1].splitlines()[0]
    rows: list[dict[str, object]] = json.loads(line)
    assert rows, "no executor answered the probe"
    return rows


# -- crashes ------------------------------------------------------------------------------


@pytest.mark.parametrize("sink", ["pg", "kafka", "delta"])
def test_driver_killed_by_an_executor_while_it_writes(  # type: ignore[no-untyped-def]
    on_cluster, pg_dsn, kafka_bootstrap, kafka_topic, sink
):
    """An executor SIGKILLs the driver in the middle of batch 2 (the executors
    live on: they are zombies of a dead driver); the restart recovers. Delta
    writes with its own writer in the tasks here (``write_with="arrow"``):
    Spark's Parquet writer, its default for these tables, runs no Python in
    the tasks, so no executor-side fault could fire."""
    _orders(pg_dsn)
    route = "arrow" if sink == "delta" else None
    run = _run(on_cluster, pg_dsn, kafka_bootstrap, kafka_topic(3), sink, route)
    n = write_input(on_cluster.shared / "in", files=4, rows_per_file=150)
    first = run.start("executor.write@2+once=kill-driver")
    assert first.killed(), first.tail(3000)
    second = run.start()
    assert second.proc.returncode == 0, second.tail(5000)
    run.check(n)


@pytest.mark.parametrize(
    ("fault", "order"),
    [
        pytest.param(
            "executor.prepared@1+once=kill-executor",
            "pg,kafka,delta",
            id="executor JVM killed",
            marks=pytest.mark.smoke,
        ),
        pytest.param("executor.prepared@1+once=kill-worker", "kafka,delta,pg", id="worker killed"),
    ],
)
def test_executor_loss_after_prepare(  # type: ignore[no-untyped-def]
    on_cluster, pg_dsn, kafka_bootstrap, kafka_topic, fault, order
):
    """The executor holding a task that has just prepared its work (a prepared
    PostgreSQL transaction, an open Kafka transaction or staged Delta files)
    dies, or its whole worker does. Spark reschedules the task on the other
    worker; the dead attempt's work is rolled back or swept, never committed."""
    _orders(pg_dsn)
    run = _run(on_cluster, pg_dsn, kafka_bootstrap, kafka_topic(3), order)
    n = write_input(on_cluster.shared / "in", files=3, rows_per_file=200)
    proc = run.start(fault)
    assert proc.proc.returncode == 0, proc.tail(5000)
    fired = list((on_cluster.shared / "fault-tokens").iterdir())
    assert len(fired) == 1, "the fault did not fire"
    assert "Lost executor" in proc.output(), "Spark did not lose an executor"
    assert proc.result()["committed"] is True
    run.check(n)


def test_speculative_attempts_of_kafka_tasks_never_share_a_transaction(  # type: ignore[no-untyped-def]
    on_cluster, pg_dsn, kafka_bootstrap, kafka_topic
):
    """``spark.speculation`` on (a Kafka-only job allows it): one task of batch 1
    stalls right after its transaction is prepared, Spark starts a speculative
    copy on the other worker, which takes an id of its own (attempt number 1 in
    the batch's lane), prepares and wins. The stalled attempt's transaction is
    ended by the sweep, never committed; every row once."""
    from tests.kafkacheck import txn_outcomes

    run = _run(on_cluster, pg_dsn, kafka_bootstrap, kafka_topic(3), "kafka")
    run.env = {**on_cluster.env, SPECULATION_ENV: "1"}
    n = write_input(on_cluster.shared / "in", files=3, rows_per_file=200)
    proc = run.start("executor.prepared@1+once=stall:25", extra=["--partitions", "4"])
    assert proc.proc.returncode == 0, proc.tail(5000)
    run.check(n)
    from sinks.naming import TxnName

    outcomes = txn_outcomes(kafka_bootstrap, run.job, settle=15)
    assert all(v in ("committed", "aborted") for v in outcomes.values()), outcomes
    attempts: dict[str, list[str]] = {}
    for name, verdict in outcomes.items():
        parsed = TxnName.parse(name)
        assert parsed is not None
        if parsed.batch_id == 1:
            attempts.setdefault(parsed.partition_prefix(), []).append(verdict)
    # no task failed: a partition with two attempts had a speculative copy
    raced = [sorted(v) for v in attempts.values() if len(v) > 1]
    assert raced == [["aborted", "committed"]], attempts


# -- lifecycle ----------------------------------------------------------------------------


@pytest.mark.smoke
def test_three_pipelines_share_one_final_checkpoint_on_the_cluster(  # type: ignore[no-untyped-def]
    on_cluster, pg_dsn, kafka_bootstrap, kafka_topic
):
    topic = kafka_topic(3)
    shared, state = on_cluster.shared, on_cluster.driver / "state"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE small (id bigint PRIMARY KEY, name text, amount float8)")
    n = {
        "small": write_input(shared / "small", 1, 40),
        "medium": write_input(shared / "medium", 3, 400),
        "large": write_input(shared / "large", 6, 1500),
    }
    delta = shared / "delta-large"
    specs = [
        f"name=small,input={shared / 'small'},table=small,kind=bounded",
        f"name=medium,input={shared / 'medium'},sink=kafka,topic={topic},kind=bounded",
        f"name=large,input={shared / 'large'},sink=delta,path={delta},kind=bounded",
    ]
    args = ["--dsn", pg_dsn, "--bootstrap", kafka_bootstrap, "--state", str(state)]
    args += ["--job", "three", "--interval", "60", "--probe", str(_driver_only_file(on_cluster))]
    for spec in specs:
        args += ["--pipeline", spec]
    proc = run_job("lifecycle_job.py", args, shared / "job.log", env=on_cluster.env)
    assert proc.proc.returncode == 0, proc.tail(5000)
    assert proc.result()["committed"] is True
    _assert_deployed(proc)  # docs/deploying.md's deployment path, for all three sinks
    assert_exactly_once(pg_dsn, "small", n["small"])
    kafka_exactly_once(kafka_bootstrap, topic, n["medium"])
    assert_nothing_open(kafka_bootstrap, topic, "three")
    ids = sorted(DeltaTable(str(delta)).to_pyarrow_table(columns=["id"])["id"].to_pylist())
    assert ids == list(range(n["large"]))
    deltacheck.assert_nothing_staged(delta)
    doc = read_ledger(state)
    assert doc is not None
    assert [cp["kind"] for cp in doc["history"]] == ["final"], doc["history"]
    assert doc["history"][0]["finished"] == ["large", "medium", "small"]
    assert job_prepared(pg_dsn, "three") == []


def test_drain_on_the_cluster(on_cluster, pg_dsn):  # type: ignore[no-untyped-def]
    """``twophase stop --drain`` to an unbounded job on the cluster (the way to
    drain a job under spark-submit, where a SIGTERM to the process group would
    also reach the spark-submit JVM and stop Spark under the drain): it drains,
    one final checkpoint commits everything, exit 0."""
    shared, state = on_cluster.shared, on_cluster.driver / "state"
    n = write_input(shared / "live", 4, 100)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE live_t (id bigint PRIMARY KEY, name text, amount float8)")
    spec = f"name=live,input={shared / 'live'},table=live_t,kind=unbounded"
    args = ["--dsn", pg_dsn, "--state", str(state), "--pipeline", spec]
    job = JobProcess("lifecycle_job.py", args, shared / "job.log", env=on_cluster.env)

    def committed() -> bool:
        with psycopg.connect(pg_dsn) as c:
            return bool(c.execute("SELECT count(*) FROM live_t").fetchone()[0])  # type: ignore[index]

    wait_for(committed, 240, "a first commit", job)
    stop = subprocess.run(
        [sys.executable, "-m", "lifecycle.cli", "stop", "--drain", str(state)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert job.wait(180) == 0, job.tail()
    result = job.result()
    assert result["drained"] and result["committed"]
    assert_exactly_once(pg_dsn, "live_t", n)
    assert job_prepared(pg_dsn, "life") == []


# not in the smoke tier, for CI time (76 s): the end-of-input flush is the default
# run's (test_lifecycle.py), the cluster's deployment path the two smoke tests above
def test_windowed_pipeline_flushes_every_window_on_the_cluster(on_cluster, pg_dsn):  # type: ignore[no-untyped-def]
    """An event-time aggregation ends its input on the cluster: the end-of-input
    marker reaches the query without a file on the driver's disk, and every
    window is committed. A stateful query's Spark checkpoint holds its state
    store, which executors write: here ``state_dir`` is on the shared side, as
    docs/deploying.md says it must be for stateful pipelines."""
    from tests.test_lifecycle import create_tables, expected_windows, window_rows, write_events

    shared = on_cluster.shared
    write_events(shared / "ev", 0, 200, files=4)
    create_tables(pg_dsn, windows=True)
    spec = f"name=agg,input={shared / 'ev'},table=windows,kind=windowed,files=2"
    args = ["--dsn", pg_dsn, "--state", str(shared / "state"), "--pipeline", spec]
    proc = run_job("lifecycle_job.py", args, shared / "job.log", env=on_cluster.env)
    assert proc.proc.returncode == 0, proc.tail(5000)
    assert proc.result()["committed"] is True
    assert window_rows(pg_dsn) == expected_windows(range(200))
    assert job_prepared(pg_dsn, "life") == []
