"""A job whose ``state_dir`` is a Hadoop-compatible URI (invariant 9: state a
restarted driver can reach), run as real driver processes.

The URIs here are the ones PySpark's bundled Hadoop client proves without a
store of its own: ``viewfs://`` mounted (in a ``core-site.xml`` under
``HADOOP_CONF_DIR``, as a cluster configures it) onto a second directory that
stands in for shared storage, and ``file://`` naming such a directory. A real
NameNode (``hdfs://``) is in ``tests/test_hdfs_store.py``, S3 through S3A in
``tests/test_delta_s3.py``. The ledger is a file ledger in a local directory
(``ledger=``), a PostgreSQL ledger (``ledger="postgresql://..."``, the test
server's), or the state_dir's own (no ``ledger=``: the store ledger).

* A bounded and an unbounded pipeline write Delta tables; ``twophase status``
  and ``twophase stop`` work on the URI; the restart finds the finished
  pipeline and resumes the other from its Spark checkpoint on viewfs; every
  row is in its table exactly once.
* The driver is SIGKILLed mid-run and restarted from another working directory
  with another temp dir and Spark local dir (the first "host" deleted): the
  state on a ``file://`` URI, its ledger included, is all it needs; exactly
  once, nothing staged.
  Again with the state on ``viewfs://`` and the ledger in PostgreSQL: the URI's
  ``ledger.location`` leads ``twophase status`` to the ledger.

Both check that no code treated the URI as a local path (no ``viewfs:`` or
``file:`` directory appears in the jobs' working directories).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lifecycle.ledger import read_ledger
from tests import deltacheck
from tests.conftest import write_input
from tests.ledgers import pg_uri
from tests.multisink import Run
from tests.pgcheck import job_prepared
from tests.procs import ROOT, JobProcess, twophase, wait_for
from tests.tiers import SLOW


def viewfs_env(tmp: Path, target: Path) -> tuple[str, dict[str, str]]:
    """A ``core-site.xml`` mounting ``viewfs://<table>/state`` onto ``target``;
    returns the URI and the environment that gives it to a JVM."""
    table = f"tp{uuid.uuid4().hex[:8]}"
    conf = tmp / "hadoop-conf"
    conf.mkdir()
    (conf / "core-site.xml").write_text(
        '<?xml version="1.0"?>\n<configuration>\n  <property>\n'
        f"    <name>fs.viewfs.mounttable.{table}.link./state</name>\n"
        f"    <value>{target.resolve().as_uri()}</value>\n"
        "  </property>\n</configuration>\n"
    )
    return f"viewfs://{table}/state", {"HADOOP_CONF_DIR": str(conf)}


def rows(doc: dict[str, Any] | None, pipeline: str) -> int:
    """Rows the ledger says ``pipeline`` committed."""
    totals = (doc or {}).get("totals") or {}
    return sum(v for k, v in totals.items() if k.startswith(pipeline + "/"))


def by_pipeline(per_sink: dict[str, int]) -> dict[str, int]:
    """Rows per ``pipeline/sink`` label, summed per pipeline."""
    out: dict[str, int] = {}
    for label, n in per_sink.items():
        p = label.split("/", 1)[0]
        out[p] = out.get(p, 0) + n
    return out


def no_uri_paths(*dirs: Path) -> None:
    """No directory named after a URI scheme in ``dirs`` (where ``os`` would have
    put ``viewfs://t/state``, as the relative path ``viewfs:/t/state``)."""
    for d in dirs:
        bad = [str(p) for p in d.iterdir() if p.name.startswith(("viewfs:", "file:"))]
        assert bad == [], f"a URI was used as a local path: {bad}"


def remove_host(host: Path) -> None:
    """Delete a killed driver's host directory. Processes the SIGKILLed driver
    leaves behind for a moment (its JVM, whose shutdown hook deletes Spark's
    local dirs) may still delete files there, so a file can vanish under
    ``rmtree``."""
    for _ in range(50):
        shutil.rmtree(host, ignore_errors=True)
        if not host.exists():
            return
        time.sleep(0.1)
    raise AssertionError(f"{host} could not be deleted")


@SLOW  # test_hdfs_store.py::test_a_job_with_its_state_on_hdfs: the same HadoopStore path
def test_a_job_with_its_state_on_viewfs(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    base, env = viewfs_env(tmp_path, shared)
    state = f"{base}/job"
    ledger = tmp_path / "ledger-host"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    n_load = write_input(tmp_path / "load", 3, 40)
    n_live = write_input(tmp_path / "live", 2, 30)
    tables = {p: tmp_path / "delta" / p for p in ("load", "live")}
    args = ["--state", state, "--ledger", str(ledger), "--job", "vfs", "--interval", "1"]
    for p, kind in (("load", "bounded"), ("live", "unbounded")):
        args += [
            "--pipeline",
            f"name={p},input={tmp_path / p},sink=delta,path={tables[p]},kind={kind}",
        ]
    cli = ["--ledger", str(ledger)]

    job = JobProcess("lifecycle_job.py", args, tmp_path / "job.log", env=env, cwd=cwd)
    try:
        wait_for(
            lambda: (
                "load" in ((read_ledger(ledger) or {}).get("finished") or [])
                and rows(read_ledger(ledger), "live") == n_live
            ),
            240,
            "the bounded pipeline to finish and the live one to commit its input",
            job,
        )
        status = twophase("status", state, *cli, env=env)
        assert status.returncode == 0, status.stderr
        assert "finished pipelines: load" in status.stdout
        stop = twophase("stop", state, *cli, env=env)  # a savepoint, through viewfs
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "savepoint checkpoint" in stop.stdout
        assert job.wait(120) == 0, job.tail()
    finally:
        if job.proc.poll() is None:
            job.kill()
    assert job.result()["stopped"] is True
    assert job.result()["pipelines"] == {"load": "FINISHED", "live": "STOPPED"}
    # the state is where the mount puts it; the ledger is not in it
    job_dir = shared / "job"
    assert sorted(os.listdir(job_dir)) == ["control", "pipelines"]
    # the stop request was consumed; the heartbeat, renewed through Hadoop, says stopped
    control = job_dir / "control"
    assert [f for f in os.listdir(control) if not f.endswith(".crc")] == ["heartbeat.json"]
    assert json.loads((control / "heartbeat.json").read_text())["state"] == "stopped"
    for p in ("load", "live"):
        assert (job_dir / "pipelines" / p / "spark" / "commits").is_dir()
    assert (ledger / "ledger").is_dir()

    # a restart on the same URI: the finished pipeline is not run again, the other
    # resumes from its Spark checkpoint on viewfs and reads only the new input
    n_live += write_input(tmp_path / "live", 1, 25, start=10_000)
    again = JobProcess("lifecycle_job.py", args, tmp_path / "job.log", env=env, cwd=cwd)
    try:
        wait_for(
            lambda: rows(read_ledger(ledger), "live") == n_live,
            240,
            "the live pipeline to commit the new input",
            again,
        )
        drain = twophase("stop", "--drain", state, *cli, env=env)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        assert "final checkpoint" in drain.stdout
        assert again.wait(120) == 0, again.tail()
    finally:
        if again.proc.poll() is None:
            again.kill()
    assert "pipeline load finished in an earlier run: not run again" in again.output()
    assert again.result()["drained"] is True
    assert by_pipeline(again.result()["rows"]) == {"load": 0, "live": 25}

    deltacheck.assert_exactly_once(tables["load"], n_load)
    live = deltacheck.read_rows(tables["live"]).column("id").to_pylist()
    assert live == [*range(60), *range(10_000, 10_025)]
    for t in tables.values():
        deltacheck.assert_nothing_staged(t)
    doc = read_ledger(ledger)
    assert doc is not None and doc["pending"] == {} and doc["decided"] is None
    assert sorted(doc["finished"]) == ["live", "load"]
    assert by_pipeline(doc["totals"]) == {"load": n_load, "live": n_live}
    no_uri_paths(cwd, ROOT)

    # a URI holds no ledger: the command says what to pass
    bare = twophase("status", state, env=env)
    assert bare.returncode == 2 and "--ledger" in bare.stderr


@pytest.mark.crash
@pytest.mark.parametrize(
    ("fault", "batch2_run"),
    [
        pytest.param("driver.after_record@2=kill", 2, id="before Spark's commit log", marks=SLOW),
        pytest.param("driver.before_commit@2=kill", 1, id="after Spark's commit log"),
    ],
)
def test_a_killed_driver_restarts_elsewhere_from_a_file_uri(
    tmp_path: Path, fault: str, batch2_run: int
) -> None:
    """``batch2_run``: the run whose files of batch 2 the table holds: 2 when
    Spark replays the batch (its commit log had no entry, read through Hadoop),
    1 when Spark had completed it and the restart only commits it. No
    ``ledger=``: the ledger is the state_dir's own (a store ledger, one object
    per change, written through Hadoop), so the URI is all a new host needs."""
    shared = tmp_path / "shared"
    run = Run(tmp_path, None, None, None, state=(shared / "state").as_uri())
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)

    def host(name: str) -> Path:
        """A driver host of its own: working directory, temp dir, Spark local dir."""
        h = tmp_path / name
        for d in ("cwd", "tmp", "spark-local"):
            (h / d).mkdir(parents=True)
        run.cwd = h / "cwd"
        run.env = {"TMPDIR": str(h / "tmp"), "SPARK_LOCAL_DIRS": str(h / "spark-local")}
        return h

    first_host = host("host1")
    first = run.start(fault)
    assert first.proc.returncode == -signal.SIGKILL, (
        f"the fault {fault} did not kill the driver (exit {first.proc.returncode}):\n"
        + first.tail(3000)
    )
    assert deltacheck.markers(run.delta), "the killed run left no staged Delta work behind"
    assert os.listdir(first_host / "spark-local"), "Spark did not use the host's local dir"
    no_uri_paths(first_host / "cwd")
    remove_host(first_host)  # that host is gone

    second_host = host("host2")
    second = run.start(None)
    assert second.proc.returncode == 0, second.tail(5000)
    assert second.result()["committed"] is True
    ours = run.check(n)  # exactly once, nothing staged, ledger settled
    assert deltacheck.runs_of_batch(ours, 2) == {batch2_run}
    commits = shared / "state" / "pipelines" / "load" / "spark" / "commits"
    assert sorted(int(f) for f in os.listdir(commits) if f.isdigit()) == [0, 1, 2]
    ledger = sorted(os.listdir(shared / "state" / "ledger"))
    assert any(n.startswith("snapshot.") for n in ledger), ledger
    assert any(n.startswith("journal.") for n in ledger), ledger
    no_uri_paths(second_host / "cwd", ROOT)


@pytest.mark.crash
@SLOW
def test_a_killed_driver_restarts_elsewhere_with_its_state_on_viewfs_and_the_ledger_in_postgresql(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The state on ``viewfs://`` and the ledger in PostgreSQL: what a driver
    restarting on another host needs. The driver is SIGKILLed after the ledger
    recorded batch 2 (prepared in PostgreSQL, staged in Delta, Spark's commit
    log without it) and restarted from another working directory, temp dir and
    Spark local dir: it finds its ledger (the killed driver's advisory lock gone
    with its sessions), Spark replays batch 2, every row is in each sink exactly
    once and nothing is left prepared or staged. ``twophase status STATE_URI``
    finds the ledger through the URI's ``ledger.location`` (read through Hadoop),
    before and after the restart."""
    shared = tmp_path / "shared"
    shared.mkdir()
    base, vfs = viewfs_env(tmp_path, shared)
    state = f"{base}/job"
    ledger = pg_uri(pg_dsn)
    run = Run(tmp_path, pg_dsn, None, None, sinks="delta,pg", state=state, ledger=ledger)
    n = write_input(tmp_path / "in", files=3, rows_per_file=100)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(
            "CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8, part bigint)"
        )

    def host(name: str) -> Path:
        """A driver host of its own: working directory, temp dir, Spark local dir."""
        h = tmp_path / name
        for d in ("cwd", "tmp", "spark-local"):
            (h / d).mkdir(parents=True)
        run.cwd = h / "cwd"
        run.env = {**vfs, "TMPDIR": str(h / "tmp"), "SPARK_LOCAL_DIRS": str(h / "spark-local")}
        return h

    first_host = host("host1")
    first = run.start("driver.after_record@2=kill")
    assert first.proc.returncode == -signal.SIGKILL, first.tail(3000)
    assert deltacheck.markers(run.delta), "the killed run left no staged Delta work behind"
    assert job_prepared(pg_dsn, run.job), "the killed run left nothing prepared in PostgreSQL"
    assert os.listdir(first_host / "spark-local"), "Spark did not use the host's local dir"
    no_uri_paths(first_host / "cwd")
    remove_host(first_host)  # that host is gone
    recorded = (shared / "job" / "ledger.location").read_text()
    assert recorded.startswith("postgresql://") and f"job={run.job}" in recorded
    assert "ledger" not in os.listdir(shared / "job")  # no file ledger on the URI
    status = twophase("status", state, env=vfs)  # no --ledger: the URI's ledger.location
    # exit 3: the killed driver's heartbeat (read through Hadoop) names a pid that is
    # gone, and pending work waits for the next start
    assert status.returncode == 3, status.stdout + status.stderr
    assert "state: DIED" in status.stdout, status.stdout
    assert f"job {run.job}" in status.stdout
    assert re.search(r"load: batches \d+\.\.2 ", status.stdout), status.stdout  # batch 2

    second_host = host("host2")
    second = run.start(None)
    assert second.proc.returncode == 0, second.tail(5000)
    assert second.result()["committed"] is True
    ours = run.check(n)  # exactly once in both sinks, nothing staged or prepared
    assert deltacheck.runs_of_batch(ours, 2) == {2}  # Spark replayed batch 2
    commits = shared / "job" / "pipelines" / "load" / "spark" / "commits"
    assert sorted(int(f) for f in os.listdir(commits) if f.isdigit()) == [0, 1, 2]
    after = twophase("status", "--raw", state, env=vfs)
    assert after.returncode == 0, after.stderr
    doc = json.loads(after.stdout)
    assert doc["job"] == run.job and doc["pending"] == {} and doc["decided"] is None
    assert doc["finished"] == ["load"] and doc["run"] == 2
    no_uri_paths(second_host / "cwd", ROOT)


def test_twophase_writes_control_files_through_hadoop(tmp_path: Path) -> None:
    """Without a SparkSession, ``twophase`` reaches a URI state_dir through a JVM
    of its own, configured like a job's (``HADOOP_CONF_DIR``): the request lands
    where the mount table says. A plain path needs no JVM (and a stop with no
    job running is answered before any is started)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    base, env = viewfs_env(tmp_path, shared)
    ledger = tmp_path / "ledger-host"
    cli = ["--ledger", str(ledger)]
    done = twophase("start-over", f"{base}/job", *cli, "--from", "0123456789ab", env=env)
    assert done.returncode == 0, done.stderr
    request = json.loads((shared / "job" / "control" / "start_over.json").read_text())
    assert request["from"] == "0123456789ab"
    idle = twophase("stop", f"{base}/job", *cli, env=env)
    assert idle.returncode == 2 and "no job is running" in idle.stderr
    no_uri_paths(ROOT)
