"""HDFS for tests, demos and benchmarks: a real NameNode and DataNode on loopback.

:class:`MiniHdfs` runs Hadoop's ``MiniDFSCluster`` (the NameNode and DataNode
code of a Hadoop release, in one JVM of its own, outside Spark) from the jars
that :mod:`lifecycle.testing.jars` fetched (set ``hdfs``:
``hadoop-client-minicluster`` of :data:`~lifecycle.testing.jars.HADOOP_MINICLUSTER_VERSION`,
the Hadoop pyspark 4.2.0's client comes from). Java starts it from
``MiniHdfs.java``, a source file beside this module run by Java's single-file
source launcher (``java -cp JARS MiniHdfs.java ...``; the project ships no
compiled class): the NameNode's RPC port is a free port of 127.0.0.1, every
other port the system's choice on 127.0.0.1, the storage in a temporary
directory. ``start()`` returns once the NameNode serves, the DataNode has
registered and the NameNode has left safe mode; :attr:`MiniHdfs.uri` is then
``hdfs://127.0.0.1:PORT``, which Spark's bundled HDFS client opens with no
configuration.

Faults: :meth:`MiniHdfs.restart_namenode` (or :meth:`~MiniHdfs.stop_namenode`,
then :meth:`~MiniHdfs.start_namenode`) takes the NameNode down and brings it
back on the same port and storage while the DataNode keeps running, as an
operator restarts a NameNode; ``kill()`` (SIGKILL) then ``start()`` crashes
the whole JVM and starts it again on the same storage (nothing is formatted
again). The edit log is synced as a NameNode's is (the minicluster's
test-only shortcut that skips it is off).

The JVM reads its commands on its stdin, so when the process that started it
dies, the cluster shuts down with it. Run as a program (``python -m
lifecycle.testing.hdfs``) it starts a cluster, prints its URI and waits for
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path

from lifecycle.testing import jars
from lifecycle.testing.services import ProcessService, free_port, java, serve

LAUNCHER = Path(__file__).with_name("MiniHdfs.java")
"""the Java source file that runs the cluster (its header lists the commands)"""

DEFAULTS: dict[str, str] = {
    "dfs.replication": "1",
    "dfs.namenode.safemode.extension": "0",
    "dfs.heartbeat.interval": "1",
    "dfs.blockreport.initialDelay": "0",
}
"""one DataNode's settings (a replication of 1) and quick (re)starts: the
DataNode heartbeats every second and reports its blocks at once, so a
restarted NameNode leaves safe mode as soon as the report is in"""


class MiniHdfsError(RuntimeError):
    """The cluster did not start, or died; carries the tail of its log."""


def _java() -> str:
    return java("HDFS", MiniHdfsError)


class MiniHdfs(ProcessService):
    """One NameNode and one DataNode (Hadoop's MiniDFSCluster) on 127.0.0.1.

    ``uri`` is ``"hdfs://127.0.0.1:PORT"`` once ``start()`` returned; the port
    and the storage are kept across ``stop()``/``kill()`` and ``start()``, and
    across the NameNode's restarts. ``config`` adds or overrides Hadoop
    settings of the cluster (not of its clients)."""

    def __init__(self, config: dict[str, str] | None = None, *, heap: str = "384m") -> None:
        self.classpath = os.pathsep.join(str(p) for p in jars.jars("hdfs"))
        super().__init__("minihdfs-", "hdfs.log")
        self.config = {**DEFAULTS, "hadoop.tmp.dir": str(self.workdir / "tmp"), **(config or {})}
        self.heap = heap
        self.port: int | None = None
        self._formatted = False
        self._ready = self.workdir / "ready"

    @property
    def uri(self) -> str:
        """``hdfs://127.0.0.1:PORT``, the file system's root."""
        if self.port is None:
            raise MiniHdfsError("HDFS has not been started yet")
        return f"hdfs://127.0.0.1:{self.port}"

    @property
    def storage(self) -> Path:
        """The directory of the NameNode's and the DataNode's storage."""
        return self.workdir / "dfs"

    def _command_line(self) -> list[str]:
        assert self.port is not None
        return [
            _java(),
            f"-Xmx{self.heap}",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",  # starts faster; a test cluster needs no C2
            "-Djava.awt.headless=true",
            "-Djava.net.preferIPv4Stack=true",
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            f"-Dtest.build.data={self.workdir / 'build'}",  # the minicluster's fallback dir
            "-cp",
            self.classpath,
            str(LAUNCHER),
            str(self.storage),
            str(self.port),
            str(self._ready),
            "keep" if self._formatted else "format",
            *(f"{k}={v}" for k, v in self.config.items()),
        ]

    def start(self, timeout: float = 180.0) -> None:
        """Start the cluster (formatting its storage the first time) and wait
        until it serves: NameNode up, DataNode registered, safe mode left."""
        if self.is_running():
            return
        if self.port is None:
            self.port = free_port()
        self._ready.unlink(missing_ok=True)
        self._log = open(self.logfile, "ab")  # noqa: SIM115 - kept open while running
        self._proc = subprocess.Popen(
            self._command_line(),
            stdin=subprocess.PIPE,  # the commands; its end stops the cluster
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            start_new_session=True,
        )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self._formatted = True

    def _check_alive(self) -> None:
        status = self._exit_status()
        if status is not None:
            raise MiniHdfsError(f"HDFS exited with status {status}\n{self.log_tail()}")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise MiniHdfsError(
                    f"HDFS on {self.uri} was not ready within {timeout:.0f}s\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def _send(self, command: str) -> None:
        self._check_alive()
        if self._proc is None or self._proc.stdin is None:
            raise MiniHdfsError("HDFS is not running")
        self._proc.stdin.write(f"{command}\n".encode())
        self._proc.stdin.flush()

    def stop_namenode(self, timeout: float = 60.0) -> None:
        """Shut the NameNode down (the DataNode keeps running); returns once its
        port refuses connections. Clients' calls fail or retry meanwhile."""
        self._send("stop-namenode")
        deadline = time.monotonic() + timeout
        while self._namenode_answers():
            self._check_alive()
            if time.monotonic() > deadline:
                raise MiniHdfsError(f"the NameNode still answers after {timeout:.0f}s")
            time.sleep(0.1)

    def start_namenode(self, timeout: float = 120.0) -> None:
        """Start the stopped NameNode again on the same port and storage; returns
        once the DataNode re-registered and the NameNode left safe mode."""
        self._ready.unlink(missing_ok=True)
        self._send("start-namenode")
        self._wait_ready(timeout)

    def restart_namenode(self, timeout: float = 120.0) -> None:
        """Stop the NameNode and start it again (:meth:`stop_namenode`, then
        :meth:`start_namenode`, in one step of the cluster's JVM)."""
        self._ready.unlink(missing_ok=True)
        self._send("restart-namenode")
        self._wait_ready(timeout)

    def _namenode_answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port or 0), timeout=1.0):
                return True
        except OSError:
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """Shut the cluster down cleanly (``stop`` on its stdin), SIGKILL after
        ``timeout`` s. Its storage and port are kept for ``start()``."""
        proc = self._proc
        if proc is not None and proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.write(b"stop\n")
                proc.stdin.close()
                proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        super().stop(2.0)
        self._close_stdin(proc)

    def kill(self) -> None:
        """SIGKILL the cluster's JVM (NameNode and DataNode crash together);
        ``start()`` recovers the same storage."""
        proc = self._proc
        super().kill()
        self._close_stdin(proc)

    @staticmethod
    def _close_stdin(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.stdin is not None and not proc.stdin.closed:
            with contextlib.suppress(OSError):  # the pipe's reader is gone
                proc.stdin.close()


def main(argv: list[str] | None = None) -> None:
    """Start a cluster, print its URI, wait for Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a Hadoop setting"
    )
    args = parser.parse_args(argv)
    hdfs = MiniHdfs(dict(s.split("=", 1) for s in args.set))
    serve(hdfs, lambda: hdfs.uri, hdfs._check_alive)


if __name__ == "__main__":
    main()
