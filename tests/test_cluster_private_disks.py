"""The three-sink job on a Spark standalone cluster whose executors share no
disk (``-m cluster``): the tables, the staged files, the input and the state
on S3 and HDFS, and an executor, then the driver, killed (issue 44).

**What the test proves.** With no file path shared between the driver and the
executors, nor between the two workers, a job that writes PostgreSQL, Kafka
and a Delta table on S3 loses an executor right after a task prepared its
work, then loses its driver in the middle of a checkpoint's commit (the Delta
version written, its markers not yet deleted), and is started again from
another working directory: every row is in each sink exactly once (PostgreSQL;
Kafka read by a ``read_committed`` consumer and from the log's markers; Delta
read by deltalake and by delta-spark through ``s3a://`` on the same cluster),
nothing is prepared in PostgreSQL, no Kafka transaction is open and nothing is
left staged in the table. So nothing of the protocol (staging, commit,
recovery, the sweep of a dead attempt's files) relies on a disk that
executors and driver share.

Where everything is:

* **Executors** run in a private mount namespace per worker
  (``tests/sparkcluster.py``, ``private_dirs``): each worker's
  ``SPARK_LOCAL_DIRS``, work directory and ``TMPDIR`` are its own, the other
  worker's are covered by an empty read-only tmpfs, and so is pytest's whole
  base temporary directory (every test's ``tmp_path``: the driver's local
  directories, its working directories, the local copy of the input), this
  checkout's packages, and the storage directories of the S3 server and of
  HDFS (executors reach the stores over the network only). The test checks
  the isolation through each worker's ``/proc/PID/root`` and the executors'
  own logs and probe.
* **The input** (JSON files) and **the state** (``state_dir``, with Spark's
  checkpoint location) are on HDFS (Hadoop's minicluster), put there and
  listed by Hadoop's shell in a JVM of the test's own; **the ledger** is the
  state_dir's own (the store ledger, on HDFS); **the Delta table** is
  ``s3://bucket/orders`` on S3Proxy, written by deltalake in the tasks
  (``storage_options``).
* **The executors' environment** is the packed one of
  ``tests/executor_env.py`` plus the project's ``s3`` extra (boto3): the
  sink creates its staged files' markers on S3 with a conditional PUT through
  boto3 in the tasks, so executors writing an ``s3://`` table need it (the
  base dependencies alone fail the first write with ``No module named
  'botocore'``).
* **The one shared directory**: the ``+once`` fault's token file (fault
  injection is test mechanics: the first process to create the token fires
  the fault) lives in a directory outside pytest's temporary directory that
  driver and workers both see; nothing else is there.

The restarted run's session has delta-spark's and S3A's jars on the driver's
and the executors' class path (``SPARK_CONF_DIR`` with a
``spark-defaults.conf``: the jars from the local cache, as software installed
on each node), to read the table back through ``s3a://`` after the job; the
first run has none (the sinks need no jar).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lifecycle.testing import jars, verify
from lifecycle.testing.services import java
from tests import deltacheck, executor_env
from tests.conftest import write_input
from tests.executor_env import ROOT
from tests.kafkacheck import consume_ids
from tests.multisink import Run, copy_delta_log
from tests.procs import JobProcess
from tests.sparkcluster import SparkCluster
from tests.sparkutil import EXECUTOR_ENV_ENV, MASTER_ENV

pytestmark = pytest.mark.cluster

FAULTS = "executor.prepared@1+once=kill-executor;driver.mid_commit.delta@1=kill"
"""an executor JVM dies right after a task of batch 1 prepared its work (once:
its retry passes), then the driver dies in checkpoint 1's Delta commit"""


@dataclass
class PrivateCluster:
    """The cluster, and the one directory its workers share with the driver."""

    cluster: SparkCluster
    tokens: Path
    """fault tokens (``TWOPHASE_FAULT_TOKENS``), one directory per test"""
    executor_env: Path
    """the executors' packed Python environment (``spark.archives``)"""


@pytest.fixture(scope="module")
def private_cluster(
    tmp_path_factory: pytest.TempPathFactory, twophase_s3: Any, twophase_hdfs: Any
) -> Iterator[PrivateCluster]:
    """Two workers with private local directories, blind to every ``tmp_path``
    of the session, this checkout's packages and the stores' own disks."""
    outside = Path(tempfile.mkdtemp(prefix="twophase-private-disks-"))
    hide = [
        tmp_path_factory.getbasetemp(),
        ROOT / "sinks",
        ROOT / "lifecycle",
        twophase_s3.workdir,
        twophase_hdfs.workdir,
    ]
    if sys.prefix != sys.base_prefix:
        hide.append(Path(sys.prefix) / "bin")  # executors run the archive's Python
    archive = executor_env.executor_archive(extras=("s3",))
    try:
        with SparkCluster(outside / "cluster", 2, hide=hide, private_dirs=True) as cluster:
            yield PrivateCluster(cluster, outside / "fault-tokens", archive)
    finally:
        shutil.rmtree(outside, ignore_errors=True)


# -- the test's own view of HDFS --------------------------------------------------------


def hdfs_shell(conf_dir: Path, *args: str) -> str:
    """Run Hadoop's shell (``hadoop fs ARGS``) in a JVM of its own, with the
    HDFS jars of the minicluster; returns its output. ``conf_dir`` gets the
    empty ``core-site.xml`` the shell insists on."""
    conf_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / "core-site.xml").write_text("<configuration/>\n")
    classpath = os.pathsep.join([str(conf_dir), *(str(p) for p in jars.jars("hdfs"))])
    done = subprocess.run(
        [java("Hadoop's shell"), "-cp", classpath, "org.apache.hadoop.fs.FsShell", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"hadoop fs {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


def hdfs_files(conf_dir: Path, root: str) -> list[str]:
    """Every path under ``root`` on HDFS, relative to it."""
    out = hdfs_shell(conf_dir, "-ls", "-C", "-R", root)
    prefix = root.rstrip("/") + "/"
    return sorted(line.removeprefix(prefix) for line in out.splitlines() if line.startswith(prefix))


# -- the run ------------------------------------------------------------------------------


def _orders(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8, part bigint)"
        )


def driver_env(pc: PrivateCluster, host: Path, tokens: Path) -> dict[str, str]:
    """A driver's environment on "host" ``host`` (a directory of ``tmp_path``):
    the cluster, the executors' archive, the fault tokens, and Spark's local
    directories of the driver there (not in the shared ``/tmp``)."""
    (host / "local").mkdir(parents=True, exist_ok=True)
    return {
        MASTER_ENV: pc.cluster.url,
        EXECUTOR_ENV_ENV: str(pc.executor_env),
        "TWOPHASE_FAULT_TOKENS": str(tokens),
        "SPARK_LOCAL_DIRS": str(host / "local"),
    }


def read_back_classpath() -> list[Path] | None:
    """delta-spark's and S3A's jars for a delta-spark read through ``s3a://``;
    None when they are not fetched (required with ``$TWOPHASE_REQUIRE_JARS``)."""
    wanted = ("delta", "s3a")
    if not os.environ.get(jars.REQUIRE_ENV) and not all(jars.available(s) for s in wanted):
        return None
    return [p for s in wanted for p in jars.require(s)]


def read_back_conf(into: Path, classpath: list[Path], s3: Any) -> Path:
    """A ``SPARK_CONF_DIR`` whose ``spark-defaults.conf`` gives the driver and
    the executors ``classpath`` (jars of the local cache every node sees),
    Delta's SQL extension and S3A's settings for the S3 server."""
    path = os.pathsep.join(str(p) for p in classpath)
    conf = {
        "spark.driver.extraClassPath": path,
        "spark.executor.extraClassPath": path,
        "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",  # delta-spark's JIT
        **jars.DELTA_SQL_CONF,
        **s3.spark_conf(),
    }
    into.mkdir(parents=True, exist_ok=True)
    (into / "spark-defaults.conf").write_text("".join(f"{k} {v}\n" for k, v in conf.items()))
    return into


# -- isolation ----------------------------------------------------------------------------


def assert_workers_see_no_shared_path(cluster: SparkCluster, *driver_paths: Path) -> None:
    """No worker sees ``driver_paths`` (files of the driver's disk), and each
    worker sees its own local directories and not the other's."""
    for w in cluster.workers:
        for path in driver_paths:
            assert not cluster.sees(w, path), f"{w.name} sees the driver's {path}"
        assert cluster.sees(w, cluster.local_dirs(w)), f"{w.name} lost its own local dirs"
        for other in cluster.workers:
            if other is not w:
                assert not cluster.sees(w, cluster.local_dirs(other)), (
                    f"{w.name} sees {other.name}'s local directories"
                )


def executor_probes(proc: JobProcess) -> list[dict[str, Any]]:
    """The ``EXECUTORS`` line of the job's ``--probe`` (tests/jobs/_driver.py)."""
    line = proc.output().rsplit("EXECUTORS ", 1)[1].splitlines()[0]
    rows: list[dict[str, Any]] = json.loads(line)
    assert rows, "no executor answered the probe"
    return rows


def assert_executors_kept_to_their_worker(cluster: SparkCluster, proc: JobProcess) -> None:
    """Each probed executor ran in its worker's own work directory, which the
    other worker cannot see, and did not see the driver's file; every worker's
    executors put their blocks in the worker's private ``SPARK_LOCAL_DIRS``
    (their own log says where)."""
    for probe in executor_probes(proc):
        assert probe["sees_driver_path"] is False, probe
        cwd = Path(probe["cwd"])
        owners = [w for w in cluster.workers if cwd.is_relative_to(cluster.home(w))]
        assert len(owners) == 1, f"executor directory {cwd} is no worker's own"
        for w in cluster.workers:
            assert cluster.sees(w, cwd) == (w is owners[0]), (w.name, cwd)
    for w in cluster.workers:
        logs = sorted((cluster.home(w) / "work").glob("app-*/*/stderr"))
        said = "".join(log.read_text(errors="replace") for log in logs)
        dirs = re.findall(r"Created local directory at (\S+)", said)
        assert dirs, f"{w.name}'s executors logged no local directory"
        assert all(Path(d).is_relative_to(cluster.local_dirs(w)) for d in dirs), dirs


def no_uri_as_local_path(*dirs: Path) -> None:
    """No ``hdfs:``, ``s3:`` or ``s3a:`` directory in ``dirs``: no URI was
    used as a relative local path in the drivers' working directories."""
    for d in dirs:
        bad = [p.name for p in d.iterdir() if p.name.split(":")[0] in ("hdfs", "s3", "s3a")]
        assert bad == [], f"a URI was used as a local path in {d}: {bad}"


# -- the test -----------------------------------------------------------------------------


def test_three_sinks_stay_exact_when_an_executor_then_the_driver_die_on_private_disks(
    private_cluster: PrivateCluster,
    twophase_s3: Any,
    twophase_s3_bucket: str,
    twophase_hdfs: Any,
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_topic: Any,
    tmp_path: Path,
) -> None:
    """Input, state and ledger on HDFS, the table on S3; an
    executor JVM killed after a task of batch 1 prepared, then the driver
    SIGKILLed in checkpoint 1's Delta commit; restarted from another directory:
    every sink exact, nothing prepared, open or staged."""
    cluster = private_cluster.cluster
    cluster.ensure_workers()  # an earlier test may have killed one
    tokens = private_cluster.tokens / tmp_path.name
    tokens.mkdir(parents=True)
    _orders(pg_dsn)
    topic = kafka_topic(3)
    hadoop_conf = tmp_path / "hadoop-conf"
    n = write_input(tmp_path / "in", files=3, rows_per_file=200)
    root = f"{twophase_hdfs.uri}/private-disks/{tmp_path.name}"
    hdfs_shell(hadoop_conf, "-mkdir", "-p", root)
    hdfs_shell(hadoop_conf, "-put", str(tmp_path / "in"), f"{root}/in")
    options = twophase_s3.storage_options()
    table = f"s3://{twophase_s3_bucket}/orders"
    run = Run(
        tmp_path,
        pg_dsn,
        kafka_bootstrap,
        topic,
        sinks="pg,kafka,delta",
        state=f"{root}/state",  # its ledger too: the state_dir's own
        delta=table,
        delta_options=options,
        input=f"{root}/in",
    )
    secret = tmp_path / "driver-only.txt"
    secret.write_text("executors must not see this file")
    assert_workers_see_no_shared_path(cluster, secret, tmp_path / "in", hadoop_conf)

    # run 1, "host A": an executor dies after a task prepared, then the driver mid-commit
    run.cwd = tmp_path / "host-a"
    run.env = driver_env(private_cluster, run.cwd, tokens)
    first = run.start(FAULTS, extra=["--probe", str(secret)])
    assert first.killed(), first.tail(5000)
    assert len(list(tokens.iterdir())) == 1, "the executor fault did not fire"
    assert "Lost executor" in first.output(), "Spark did not lose an executor"
    assert_executors_kept_to_their_worker(cluster, first)
    # it died in checkpoint 1's commit: the Delta version of batch 1 is in the log,
    # its staged files' markers are not deleted yet
    log = copy_delta_log(table, tmp_path / "delta-log-at-the-kill", options)
    assert deltacheck.versions(log)[-1].batch == 1, "the driver did not die in batch 1's commit"
    left = verify.staged_delta(table, storage_options=options)
    assert left, "the killed run left nothing staged in the table: the check below proves nothing"

    # run 2, "host B": another working directory and local directories, no fault
    run.cwd = tmp_path / "host-b"
    run.env = driver_env(private_cluster, run.cwd, tokens)
    classpath = read_back_classpath()
    read_back = f"s3a://{twophase_s3_bucket}/orders"
    extra: list[str] = []
    if classpath is not None:
        run.env["SPARK_CONF_DIR"] = str(
            read_back_conf(tmp_path / "spark-conf", classpath, twophase_s3)
        )
        extra = ["--read-back", read_back]
    second = run.start(extra=extra, timeout=420)
    assert second.proc.returncode == 0, second.tail(5000)
    assert second.result()["committed"] is True

    # every sink exact, nothing prepared, open or staged; the ledger settled
    run.check(n)
    assert sorted(consume_ids(kafka_bootstrap, topic, "read_committed")) == list(range(n))
    if classpath is not None:
        read = json.loads(second.output().rsplit("READ ", 1)[1].splitlines()[0])
        assert read["ids"] == list(range(n)), "delta-spark read other rows through s3a://"
    state = hdfs_files(hadoop_conf, f"{root}/state")
    assert "ledger.location" not in state, state
    assert any(f.startswith("ledger/journal.") for f in state), state
    commits = [f.rsplit("/", 1)[1] for f in state if f.startswith("pipelines/load/spark/commits/")]
    assert sorted(int(c) for c in commits if c.isdigit()) == [0, 1, 2], state
    no_uri_as_local_path(tmp_path / "host-a", tmp_path / "host-b", ROOT)
