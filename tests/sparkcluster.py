"""A Spark standalone cluster on loopback for the cluster tests.

``SparkCluster`` starts a master and N one-core workers from the pip package's
``bin/spark-class`` (no SPARK_HOME of its own needed), each in its own process
group, with its own work directory and log under ``root``, and stops them by
PID. Executors are real JVMs started by the workers, with Python workers of
their own: the tests kill them.

``hide`` lists directories of the driver's disk that the workers (and so every
executor and Python worker) must not see: each worker runs in a private mount
namespace (``unshare -m``) where those directories are covered by an empty,
read-only tmpfs. A task that opens a path there finds nothing and cannot write:
this is how the tests prove that executors never touch the driver's disk,
although everything runs on one host.

``private_dirs`` gives each worker local directories of its own that no other
worker sees: ``SPARK_LOCAL_DIRS`` (where its executors keep shuffle and block
files, and unpack ``spark.archives``), its work directory (``SPARK_WORKER_DIR``:
executors' working directories and logs) and ``TMPDIR``, all under
``root/worker-i``, and every other worker's ``root/worker-j`` hidden in its
namespace like ``hide``. :meth:`SparkCluster.sees` tells whether a worker sees
a path (through ``/proc/PID/root``, which resolves in the worker's namespace).

Run as a program (``python -m tests.sparkcluster``) it starts a cluster,
prints the master URL and waits for Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyspark

from lifecycle.testing.services import NativeService, free_port, serve

SPARK_HOME = Path(pyspark.__file__).resolve().parent
MASTER = "org.apache.spark.deploy.master.Master"
WORKER = "org.apache.spark.deploy.worker.Worker"


class SparkClusterError(RuntimeError):
    """The cluster did not start; carries the tail of the failing process's log."""


@dataclass
class _Proc:
    name: str
    log: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (a Worker's executors included)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return "(no log)"


class SparkCluster(NativeService):
    """A standalone master and ``workers`` one-core workers on loopback: the
    master on 127.0.0.1, worker *i* on 127.0.0.(i+1), so that Spark sees hosts
    of their own (it never runs a speculative copy of a task on the host of
    another attempt)."""

    def __init__(
        self,
        root: Path,
        workers: int = 2,
        *,
        worker_memory: str = "2g",
        hide: Sequence[Path] = (),
        private_dirs: bool = False,
    ) -> None:
        self.root = Path(root)
        self.hide = [Path(h).resolve() for h in hide]
        self.private_dirs = private_dirs
        self.worker_memory = worker_memory
        self.master = _Proc("master", self.root / "master.log", free_port())
        self.webui_port = free_port()
        self.workers = [
            _Proc(
                f"worker-{i}", self.root / f"worker-{i}.log", free_port(), host=f"127.0.0.{i + 1}"
            )
            for i in range(workers)
        ]

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.master.port}"

    # -- processes --------------------------------------------------------------------

    def home(self, w: _Proc) -> Path:
        """A worker's own directory: its work directory, and with ``private_dirs``
        its local directories and temporary files."""
        return self.root / w.name

    def local_dirs(self, w: _Proc) -> Path:
        """A worker's ``SPARK_LOCAL_DIRS`` (with ``private_dirs``; else Spark's
        default, the shared ``/tmp``)."""
        return self.home(w) / "local"

    def sees(self, w: _Proc, path: Path) -> bool:
        """Whether worker ``w`` (and so its executors) sees ``path``: the path
        looked up in the worker's mount namespace, through ``/proc/PID/root``."""
        if w.proc is None or not w.alive():
            raise SparkClusterError(f"{w.name} is not running")
        return os.path.exists(f"/proc/{w.proc.pid}/root{Path(path).resolve()}")

    def _private_env(self, w: _Proc) -> dict[str, str]:
        """A worker's own local directories (``private_dirs``), created."""
        if not self.private_dirs:
            return {}
        tmp = self.home(w) / "tmp"
        for d in (self.local_dirs(w), tmp):
            d.mkdir(parents=True, exist_ok=True)
        return {
            "SPARK_LOCAL_DIRS": str(self.local_dirs(w)),
            "SPARK_WORKER_DIR": str(self.home(w) / "work"),
            "TMPDIR": str(tmp),
        }

    def _hidden_from(self, w: _Proc) -> list[Path]:
        """What worker ``w`` must not see: ``hide``, and with ``private_dirs``
        every other worker's directory."""
        others = [self.home(o) for o in self.workers if o is not w] if self.private_dirs else []
        return [*self.hide, *others]

    def _env(self, host: str = "127.0.0.1") -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            # workers must not inherit the test's Python set-up or faults: executors
            # get theirs from the application (spark.archives, spark.executorEnv.*)
            if not k.startswith(("PYSPARK_", "TWOPHASE_", "PYTHON"))
        }
        env["SPARK_HOME"] = str(SPARK_HOME)
        env["SPARK_LOCAL_IP"] = host
        env["SPARK_LOG_DIR"] = str(self.root / "logs")
        # A dead worker is dropped after 20 s (default 60); both sides need the
        # setting: a worker heartbeats every timeout/4 of its own configuration.
        # No REST submission server.
        timeout = "-Dspark.worker.timeout=20"
        env["SPARK_MASTER_OPTS"] = f"{timeout} -Dspark.master.rest.enabled=false"
        env["SPARK_WORKER_OPTS"] = timeout
        return env

    def _spawn(self, p: _Proc, argv: list[str], env: dict[str, str] | None = None) -> None:
        p.log.parent.mkdir(parents=True, exist_ok=True)
        with open(p.log, "ab") as out:
            p.proc = subprocess.Popen(
                argv,
                env={**self._env(p.host), **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                start_new_session=True,  # own process group: killpg reaches executors
            )

    def _worker_argv(self, p: _Proc) -> list[str]:
        work = self.home(p) / "work"
        work.mkdir(parents=True, exist_ok=True)
        argv = [
            str(SPARK_HOME / "bin" / "spark-class"),
            WORKER,
            "--host",
            p.host,
            "--port",
            str(p.port),
            "--webui-port",
            str(free_port()),
            "--cores",
            "1",
            "--memory",
            self.worker_memory,
            "--work-dir",
            str(work),
            self.url,
        ]
        hidden = self._hidden_from(p)
        if not hidden:
            return argv
        mounts = "".join(
            f'mount -t tmpfs -o ro,size=4k twophase-hidden "{d}" || exit 97; ' for d in hidden
        )
        script = f'{mounts}exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for d in [*self.hide, *(self.home(w) for w in self.workers)]:
            d.mkdir(parents=True, exist_ok=True)
        self._spawn(
            self.master,
            [
                str(SPARK_HOME / "bin" / "spark-class"),
                MASTER,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.master.port),
                "--webui-port",
                str(self.webui_port),
            ],
        )
        self._wait(lambda s: s is not None, "the master", self.master)
        for w in self.workers:
            self.start_worker(w)

    def start_worker(self, w: _Proc) -> None:
        self._spawn(w, self._worker_argv(w), self._private_env(w))
        self._wait(lambda s: s is not None and w.port in _alive_ports(s), w.name, w)

    def ensure_workers(self) -> None:
        """Restart every worker a test killed, and wait until each is registered."""
        for w in self.workers:
            if not w.alive():
                w.kill()  # executors of a killed worker may linger
                self.start_worker(w)

    def is_running(self) -> bool:
        return self.master.alive() and all(w.alive() for w in self.workers)

    def cleanup(self) -> None:
        procs = [*self.workers, self.master]
        for p in procs:
            p.kill(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            if p.proc is None:
                continue
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.proc.wait(10)
            p.kill()  # anything left in its group (executor JVMs)

    # -- state ------------------------------------------------------------------------

    def state(self) -> dict[str, object] | None:
        """The master's JSON status, or None while it does not answer."""
        try:
            url = f"http://127.0.0.1:{self.webui_port}/json/"
            with urllib.request.urlopen(url, timeout=2) as r:
                return json.loads(r.read())  # type: ignore[no-any-return]
        except OSError:
            return None

    def _wait(
        self,
        ready: Callable[[dict[str, object] | None], bool],
        what: str,
        p: _Proc,
        timeout: float = 60,
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not p.alive():
                code = p.proc.returncode if p.proc else None
                raise SparkClusterError(f"{what} exited ({code}):\n{p.tail()}")
            if ready(self.state()):
                return
            time.sleep(0.3)
        raise SparkClusterError(f"{what} not ready after {timeout}s:\n{p.tail()}")


def _alive_ports(state: dict[str, object]) -> set[int]:
    workers = state.get("workers") or []
    return {int(w["port"]) for w in workers if w.get("state") == "ALIVE"}  # type: ignore[union-attr]


if __name__ == "__main__":
    import tempfile

    cluster = SparkCluster(Path(tempfile.mkdtemp(prefix="twophase-cluster-")))
    serve(cluster, lambda: cluster.url, lambda: print("a cluster process died"))
