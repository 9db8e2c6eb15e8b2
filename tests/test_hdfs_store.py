"""The state store and a job's state on ``hdfs://``: a real NameNode and
DataNode (Hadoop's minicluster, :mod:`lifecycle.testing.hdfs`, the session's
``twophase_hdfs``), reached through the HDFS client that PySpark bundles.

* The store's promises (``lifecycle/state/store_interface.py``,
  ``hadoop_store.py``) against the NameNode: write, read, list, exists, copy,
  delete, missing names; a replace, and why it takes its steps (HDFS's
  ``rename`` does not overwrite); the crash states of a write, made through
  HDFS as a killed writer leaves them (a ``NAME.part`` still open by another
  client, a complete ``NAME.tmp`` after ``NAME`` was deleted); a written file
  that survives a restart of the NameNode and a crash of the whole HDFS JVM.
* A job with its ``state_dir`` on HDFS and its ledger in PostgreSQL: a bounded
  pipeline into PostgreSQL, every row once, the state where the URI says
  (Spark's checkpoint, ``ledger.location``), ``twophase status`` from the URI
  alone; and (slow tier) a driver SIGKILLed before a checkpoint's commit and
  restarted, ``twophase status`` of the dead job in a JVM of its own.

The files are checked through a Hadoop ``FileSystem`` of the test's own (not
the store's code); no test looks at the NameNode's storage on disk.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from py4j.protocol import Py4JJavaError

from lifecycle import Job, PipelineState, cli
from lifecycle.ledger import read_ledger
from lifecycle.state.hadoop_store import HadoopStore
from lifecycle.state.store import open_store
from sinks import PostgresSink
from tests.conftest import write_input
from tests.ledgers import pg_uri
from tests.multisink import Run
from tests.pgcheck import assert_exactly_once, job_prepared
from tests.procs import ROOT, JobProcess, crash_delta_store_job, run_job, twophase, wait_for
from tests.sparkutil import INPUT_SCHEMA
from tests.tiers import SLOW

T = TypeVar("T")


def fresh_root(hdfs: Any) -> str:
    """A directory of its own on the session's HDFS for one test."""
    return f"{hdfs.uri}/t/{uuid.uuid4().hex[:10]}"


class Hdfs:
    """The test's own view of HDFS: the driver JVM's Hadoop ``FileSystem`` API,
    called directly."""

    def __init__(self, spark: Any, root: str) -> None:
        self.root = root
        self.jvm = spark.sparkContext._jvm
        self.conf = spark.sparkContext._jsc.hadoopConfiguration()
        self.fs = self.path("").getFileSystem(self.conf)

    def path(self, rel: str) -> Any:
        return self.jvm.org.apache.hadoop.fs.Path(f"{self.root}/{rel}" if rel else self.root)

    def files(self) -> list[str]:
        """Every file under the root, relative, sorted ([] when there is no root)."""
        if not self.fs.exists(self.path("")):
            return []
        found = self.fs.listFiles(self.path(""), True)
        prefix = self.fs.makeQualified(self.path("")).toUri().getPath().rstrip("/") + "/"
        names = []
        while found.hasNext():
            names.append(str(found.next().getPath().toUri().getPath()).removeprefix(prefix))
        return sorted(names)

    def write(self, rel: str, data: bytes) -> None:
        out = self.fs.create(self.path(rel), True)
        try:
            out.write(bytearray(data))
        finally:
            out.close()

    def read(self, rel: str) -> bytes:
        stream = self.fs.open(self.path(rel))
        try:
            return bytes(self.jvm.org.apache.hadoop.io.IOUtils.readFullyToByteArray(stream))
        finally:
            stream.close()


@pytest.fixture
def store(twophase_hdfs: Any, spark: Any) -> HadoopStore:
    """A store on a fresh directory of HDFS (HDFS first: without its jars the
    test skips before a Spark session starts)."""
    s = open_store(fresh_root(twophase_hdfs), spark)
    assert isinstance(s, HadoopStore)
    return s


@pytest.fixture
def view(store: HadoopStore, spark: Any) -> Hdfs:
    """The test's own view of the store's directory."""
    return Hdfs(spark, store.uri())


def test_write_read_list_exists_copy(store: HadoopStore, view: Hdfs) -> None:
    data = b'{"a": 1}\n\x00\xff binary too'
    store.write_atomic("pipelines/p/ending_input.json", data)
    store.write_atomic("pipelines/p/spark/commits/0", b"v1")
    store.write_atomic("pipelines/q/x", b"")
    assert store.read("pipelines/p/ending_input.json") == data
    assert store.read("pipelines/q/x") == b""
    assert store.exists("pipelines/p/ending_input.json") and store.exists("pipelines/p")
    assert store.list("pipelines") == ["p", "q"]
    assert store.list("pipelines/p") == ["ending_input.json", "spark"]
    assert store.list("") == ["pipelines"]
    # on HDFS where the URI says, nothing else: no temporary file left behind
    assert view.files() == [
        "pipelines/p/ending_input.json",
        "pipelines/p/spark/commits/0",
        "pipelines/q/x",
    ]
    assert view.read("pipelines/p/ending_input.json") == data
    store.copy("pipelines/p", "savepoints/s1/p")  # a tree, parents created
    assert store.read("savepoints/s1/p/spark/commits/0") == b"v1"
    assert store.list("savepoints/s1/p") == ["ending_input.json", "spark"]


def test_replace_then_delete(store: HadoopStore, view: Hdfs) -> None:
    for i in range(3):
        store.write_atomic("control/stop.json", json.dumps({"n": i}).encode())
        assert json.loads(store.read("control/stop.json") or b"") == {"n": i}
    assert view.files() == ["control/stop.json"]
    store.write_atomic("pipelines/p/spark/offsets/0", b"v1")
    store.delete("control/stop.json")
    assert store.read("control/stop.json") is None and not store.exists("control/stop.json")
    assert store.list("control") == []
    store.delete("pipelines/p/spark")  # a tree
    assert not store.exists("pipelines/p/spark") and store.list("pipelines/p") == []
    assert view.files() == []


def test_missing_names(store: HadoopStore) -> None:
    assert store.read("control/stop.json") is None
    assert not store.exists("control/stop.json") and not store.exists("control")
    assert store.list("control") == [] and store.list("a/b") == []
    store.delete("control/stop.json")  # nothing there: no error
    store.delete("a/b")
    assert store.uri("pipelines/p/spark") == f"{store.root}/pipelines/p/spark"
    assert store.root.startswith("hdfs://127.0.0.1:")


def test_hdfs_rename_does_not_overwrite(view: Hdfs) -> None:
    """Why a replace deletes ``NAME`` before renaming ``NAME.tmp`` onto it (the
    store's docstring says so of HDFS): the NameNode refuses to rename onto an
    existing file, and says so by returning false."""
    view.write("a", b"a")
    view.write("b", b"b")
    assert view.fs.rename(view.path("a"), view.path("b")) is False
    assert view.read("b") == b"b" and view.read("a") == b"a"


def test_a_first_write_killed_mid_write_leaves_no_file(store: HadoopStore, view: Hdfs) -> None:
    """A writer that died while writing ``NAME.part``: on HDFS the file is still
    open (under construction, its lease held by the dead writer's client).
    The store does not see it; the next write replaces it (created with
    overwrite, whoever holds the lease) and is read back whole."""
    jvm = view.jvm
    other = jvm.org.apache.hadoop.fs.FileSystem.newInstance(
        jvm.java.net.URI(store.root), view.conf
    )  # another HDFS client, with a lease of its own
    out = other.create(view.path("control/stop.json.part"), True)
    try:
        out.write(bytearray(b'{"dra'))
        out.hflush()  # the bytes reached the DataNode; the file stays open
        assert view.files() == ["control/stop.json.part"]
        assert store.read("control/stop.json") is None
        assert not store.exists("control/stop.json")
        assert store.list("control") == []
        store.write_atomic("control/stop.json", b'{"drain": true}')
        assert store.read("control/stop.json") == b'{"drain": true}'
        assert view.files() == ["control/stop.json"]
    finally:
        for closing in (out, other):
            with contextlib.suppress(Py4JJavaError):  # its file is gone: close fails
                closing.close()
    assert store.read("control/stop.json") == b'{"drain": true}'


def test_a_replace_killed_between_delete_and_rename(store: HadoopStore, view: Hdfs) -> None:
    """The replace's crash window: ``NAME`` deleted, the complete ``NAME.tmp`` not
    yet renamed. The store reads ``NAME.tmp`` then; the next write tidies; a
    stale ``NAME.tmp`` beside ``NAME`` (killed before the delete) loses to it."""
    store.write_atomic("pipelines/p/ending_input.json", b"old")
    assert view.fs.rename(
        view.path("pipelines/p/ending_input.json"), view.path("pipelines/p/ending_input.json.tmp")
    )
    assert store.read("pipelines/p/ending_input.json") == b"old"
    assert store.exists("pipelines/p/ending_input.json")
    assert store.list("pipelines/p") == []  # NAME.tmp is no entry of its own
    store.write_atomic("pipelines/p/ending_input.json", b"newer")
    assert store.read("pipelines/p/ending_input.json") == b"newer"
    assert view.files() == ["pipelines/p/ending_input.json"]
    view.write("pipelines/p/ending_input.json.tmp", b"stale")
    assert store.read("pipelines/p/ending_input.json") == b"newer"
    store.delete("pipelines/p/ending_input.json")
    assert store.read("pipelines/p/ending_input.json") is None
    assert view.files() == []


def test_written_files_survive_a_namenode_restart_and_a_crash_of_hdfs(
    twophase_hdfs: Any, spark: Any, store: HadoopStore
) -> None:
    """Once ``write_atomic`` returned the content is durable: it is there after
    the NameNode restarted (the DataNode kept running) and after the whole
    HDFS JVM was SIGKILLed and started again on its storage; the same store
    (the same client) goes on reading and writing. The first call after a
    restart fails in Hadoop's client (``EOFException`` on the connection the
    restart closed): the store tries it again (``lifecycle/state/hadoop_store.py``,
    "Retries"), so no call here fails."""
    store.write_atomic("control/heartbeat.json", b'{"n": 1}')
    twophase_hdfs.restart_namenode()
    assert store.read("control/heartbeat.json") == b'{"n": 1}'
    store.write_atomic("control/heartbeat.json", b'{"n": 2}')
    twophase_hdfs.kill()
    twophase_hdfs.start()
    assert store.read("control/heartbeat.json") == b'{"n": 2}'
    store.write_atomic("control/heartbeat.json", b'{"n": 3}')
    assert store.read("control/heartbeat.json") == b'{"n": 3}'
    assert store.list("control") == ["heartbeat.json"]


def _orders_table(dsn: str, *extra: str) -> None:
    """The table ``orders`` of the input's columns (and ``extra`` ones)."""
    columns = ", ".join(["id bigint PRIMARY KEY", "name text", "amount float8", *extra])
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE orders ({columns})")


def no_hdfs_paths(*dirs: Path) -> None:
    """No directory named after the scheme in ``dirs`` (where ``os`` would have
    put ``hdfs://127.0.0.1:PORT/...``, as the relative path ``hdfs:/127...``)."""
    for d in dirs:
        bad = [str(p) for p in d.iterdir() if p.name.startswith("hdfs:")]
        assert bad == [], f"a URI was used as a local path: {bad}"


@pytest.mark.parametrize("ledger", ["in the state", "postgresql"])
def test_a_job_with_its_state_on_hdfs(
    twophase_hdfs: Any,
    spark: Any,
    pg_dsn: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    ledger: str,
) -> None:
    """A bounded pipeline of 300 rows into PostgreSQL, the job's state on HDFS and
    its ledger there too (the store ledger, no ``ledger=``) or in PostgreSQL:
    every row once, nothing prepared; Spark's checkpoint on HDFS, and the
    ledger's objects or ``ledger.location``; ``twophase status`` and ``twophase
    audit`` find the job from the URI alone."""
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    _orders_table(pg_dsn)
    name = f"hdfs{uuid.uuid4().hex[:8]}"
    state = f"{twophase_hdfs.uri}/jobs/{name}"
    where = {"ledger": pg_uri(pg_dsn)} if ledger == "postgresql" else {}
    job = Job(spark, name, state, checkpoint_interval=0, **where)
    stream = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1)
    job.add_pipeline(
        "load", stream.json(str(tmp_path / "in")), [PostgresSink(pg_dsn, "orders")], bounded=True
    )
    result = job.run()
    assert result.committed and result.pipelines == {"load": PipelineState.FINISHED}
    assert sum(result.rows_committed.values()) == n
    assert_exactly_once(pg_dsn, "orders", n)
    assert job_prepared(pg_dsn, name) == []

    view = Hdfs(spark, state)
    files = view.files()
    if ledger == "postgresql":
        assert "ledger.location" in files and not any(f.startswith("ledger/") for f in files)
        recorded = view.read("ledger.location").decode()
        assert recorded.startswith("postgresql://") and f"job={name}" in recorded
    else:
        assert "ledger.location" not in files
        assert any(re.fullmatch(r"ledger/journal\.\d+/\d{12}", f) for f in files), files
    commits = [f for f in files if f.startswith("pipelines/load/spark/commits/")]
    assert sorted(int(f.rsplit("/", 1)[1]) for f in commits) == [0, 1, 2]
    assert json.loads(view.read("control/heartbeat.json"))["state"] == "finished"
    no_hdfs_paths(tmp_path, ROOT)

    capsys.readouterr()
    assert cli.main(["status", state]) == 0  # no --ledger: found through the URI
    out = capsys.readouterr().out
    assert f"job {name}" in out, out
    assert cli.main(["status", "--raw", state]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["job"] == name and doc["pending"] == {} and doc["decided"] is None
    assert doc["finished"] == ["load"] and sum(doc["totals"].values()) == n
    assert cli.main(["audit", state]) == 0, capsys.readouterr()
    assert " ok" in capsys.readouterr().out


@pytest.mark.crash
@SLOW  # two driver starts and a twophase JVM (about 2 minutes); the default run kills
# a driver whose state is a URI in tests/test_hadoop_state.py (file://)
def test_a_killed_driver_restarts_from_its_state_on_hdfs(
    twophase_hdfs: Any, spark: Any, pg_dsn: str, tmp_path: Path
) -> None:
    """The driver is SIGKILLed before the commit of the checkpoint of batch 1
    (prepared in PostgreSQL, Spark's checkpoint on HDFS). ``twophase status
    STATE_URI``, in a JVM of its own, finds the ledger through the URI and
    says the job died; the restart commits what was decided, Spark goes on
    from its checkpoint on HDFS, every row is in the table once."""
    state = f"{twophase_hdfs.uri}/jobs/{uuid.uuid4().hex[:8]}"
    run = Run(tmp_path, pg_dsn, None, None, sinks="pg", state=state, ledger=pg_uri(pg_dsn))
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    _orders_table(pg_dsn, "part bigint")  # the job's column for Delta's partitions

    first = run.start("driver.before_commit@1=kill")
    assert first.proc.returncode == -signal.SIGKILL, first.tail(3000)
    assert job_prepared(pg_dsn, run.job), "the killed run left nothing prepared in PostgreSQL"
    status = twophase("status", state)
    assert status.returncode == 3, status.stdout + status.stderr
    assert "state: DIED" in status.stdout and f"job {run.job}" in status.stdout

    second = run.start(None)
    assert second.proc.returncode == 0, second.tail(5000)
    assert second.result()["committed"] is True
    run.check(n)  # every row once, nothing prepared, the ledger settled
    commits = open_store(state, spark).list("pipelines/load/spark/commits")
    assert sorted(int(c) for c in commits if c.isdigit()) == [0, 1, 2]
    doc = read_ledger(None, run.ledger_location())
    assert doc is not None and doc["run"] == 2
    no_hdfs_paths(tmp_path, ROOT)


@pytest.mark.crash
@SLOW  # six driver starts (about 4 minutes); the default run kills a driver whose
# state, ledger included, is a file:// URI (tests/test_hadoop_state.py)
def test_everything_on_hdfs_survives_kills_from_fresh_hosts(
    twophase_hdfs: Any, tmp_path: Path
) -> None:
    """The Delta table, Spark's checkpoints and the ledger (the state_dir's own)
    on HDFS; every start on a fresh host (working directory, temp dir, Spark
    local dir: ``crash_test(fresh_host=True)``). First a kill with a checkpoint
    decided: ``twophase status`` says DIED and ``twophase recover`` commits it
    without the job. Then kills at random instants and at the named points,
    each start on a host of its own, then a run to the end: every row once,
    nothing staged, ``twophase audit`` ok."""
    from lifecycle.testing import verify

    root = fresh_root(twophase_hdfs)
    table, state = f"{root}/orders", f"{root}/state"
    n = write_input(tmp_path / "in", files=6, rows_per_file=50)
    args = ["--input", str(tmp_path / "in"), "--state", state, "--table", table]
    args += ["--no-read-back"]
    first = run_job(
        "delta_store_job.py", args, tmp_path / "first.log", fault="driver.before_commit@1=kill"
    )
    assert first.proc.returncode == -signal.SIGKILL, first.tail(3000)
    status = twophase("status", state)
    assert status.returncode == 3 and "state: DIED" in status.stdout, status.stdout + status.stderr
    recover = twophase("recover", state)
    assert recover.returncode == 0, recover.stdout + recover.stderr
    assert "committed" in recover.stdout, recover.stdout

    crash_delta_store_job(args, tmp_path / "crash.log")
    verify.assert_exactly_once_delta(table, range(n))
    audit = twophase("audit", state)
    assert audit.returncode == 0 and " ok" in audit.stdout, audit.stdout + audit.stderr
    no_hdfs_paths(tmp_path, ROOT)


@SLOW  # about a minute; the default run has a state write waiting out a NameNode restart
def test_a_job_rides_out_a_namenode_restart_at_its_commit(
    twophase_hdfs: Any, tmp_path: Path
) -> None:
    """The Delta table, Spark's checkpoints and the ledger on HDFS. The driver
    waits at the commit of batch 1 while the NameNode is stopped, and commits
    while it is down; it is started again 10 s later. The job rides it out by
    itself (no restart): every row once, nothing staged. It needs the HDFS
    client to retry calls while the NameNode is away
    (``dfs.client.retry.policy.enabled``): without it Spark's own offset log
    write fails at the first call after the restart (``EOFException``) and
    the query ends; the sink's commit, the ledger's records and the tasks'
    reads and markers retry by themselves (``sinks/delta/storage.py``)."""
    from lifecycle.testing import verify

    root = fresh_root(twophase_hdfs)
    table, state = f"{root}/orders", f"{root}/state"
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    args = ["--input", str(tmp_path / "in"), "--state", state, "--table", table]
    retry = "spark.hadoop.dfs.client.retry.policy.enabled=true"
    job = JobProcess(
        "delta_store_job.py",
        [*args, "--no-read-back", "--conf", retry],
        tmp_path / "job.log",
        fault="driver.before_commit@1+once=stall:3",
        env={"TWOPHASE_FAULT_TOKENS": str(tokens)},
    )
    try:
        wait_for(lambda: any(tokens.iterdir()), 300, "the driver reached its commit", job)
        twophase_hdfs.stop_namenode()
        time.sleep(10)
    finally:
        twophase_hdfs.start_namenode()
    job.wait(400)
    assert job.proc.returncode == 0, job.tail(6000)
    assert job.result()["rows"] == {"load/orders": n}
    verify.assert_exactly_once_delta(table, range(n))


def test_a_write_waits_out_the_namenode_stopped_and_started_again(
    twophase_hdfs: Any, store: HadoopStore, caplog: pytest.LogCaptureFixture
) -> None:
    """With the NameNode down, a write and a read keep trying (each retry
    logged) and succeed once it is back, 10 s later; nothing is written twice
    and no ``.part`` or ``.tmp`` is left."""
    store.write_atomic("ledger/entry.json", b"before")
    twophase_hdfs.stop_namenode()
    done: dict[str, Any] = {}

    def write_then_read() -> None:
        try:
            store.write_atomic("ledger/entry.json", b"during")
            done["read"] = store.read("ledger/entry.json")
        except BaseException as e:
            done["error"] = e

    with caplog.at_level(logging.WARNING, logger="sinks.retry"):
        worker = threading.Thread(target=write_then_read)
        worker.start()
        time.sleep(10)
        assert worker.is_alive(), f"the write ended with the NameNode down: {done}"
        twophase_hdfs.start_namenode()
        worker.join(120)
    assert done == {"read": b"during"}, done
    assert any("state store: writing ledger/entry.json" in r.message for r in caplog.records)
    assert store.list("ledger") == ["entry.json"]
