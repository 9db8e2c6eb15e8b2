"""What the natively started services (:mod:`lifecycle.testing.postgres_server`,
:mod:`lifecycle.testing.kafka_broker`) share: a free loopback port, use as a
context manager, and running one as a program until Ctrl-C or SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, TypeVar


def java(needed_by: str, error: type[Exception] = RuntimeError) -> str:
    """The ``java`` to run a JVM service with: ``$JAVA_HOME/bin/java``, else the
    one on PATH; ``error`` (naming ``needed_by``) when there is none."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise error(f"{needed_by} needs Java (17 or later): java is not on PATH")
    return found


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


S = TypeVar("S", bound="NativeService")


class NativeService:
    """A service process started by the tests: ``with Service() as s:`` starts
    it and ``cleanup()``s it (stops it and deletes its files) on exit. It logs
    to ``logfile``."""

    logfile: Path

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the service's log (or "")."""
        try:
            text = self.logfile.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"--- tail of {self.logfile} ---\n" + "\n".join(text) + "\n"

    def start(self) -> None:
        raise NotImplementedError

    def is_running(self) -> bool:
        raise NotImplementedError

    def cleanup(self) -> None:
        raise NotImplementedError

    def __enter__(self: S) -> S:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


class ProcessService(NativeService):
    """A service that is one child process of ours, logging to ``logfile`` in its
    own ``workdir``: started by :meth:`_spawn`, stopped (SIGTERM, then SIGKILL)
    or killed (SIGKILL, a crash) by its PID; :meth:`cleanup` also deletes the
    work directory."""

    def __init__(self, prefix: str, logname: str) -> None:
        self.workdir: Path = Path(tempfile.mkdtemp(prefix=prefix))
        self.logfile: Path = self.workdir / logname
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The process id while it runs."""
        return self._proc.pid if self._proc is not None and self.is_running() else None

    def _spawn(self, command: list[str], env: dict[str, str] | None = None) -> None:
        """Start ``command`` in a session of its own (Ctrl-C in a terminal goes to
        us, not straight to it), its output appended to ``logfile``."""
        self._log = open(self.logfile, "ab")  # noqa: SIM115 - kept open while running
        self._proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def _exit_status(self) -> int | None:
        """The status of a process that exited by itself (None while it runs)."""
        return self._proc.poll() if self._proc is not None else None

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the process (SIGTERM; SIGKILL after ``timeout`` s)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._close_log()

    def kill(self) -> None:
        """SIGKILL the process at once (a crash: nothing is flushed or closed
        cleanly)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def cleanup(self) -> None:
        """Stop the process and delete its work directory (log included)."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def serve(
    service: NativeService, address: Callable[[], str], why_stopped: Callable[[], None]
) -> None:
    """Start ``service``, print ``address()``, and run until Ctrl-C or SIGTERM
    (or until the service dies: ``why_stopped()`` then raises saying why);
    clean up in every case."""

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # Set both explicitly: a background job may have inherited SIGINT ignored.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        service.start()
        print(address(), flush=True)
        while service.is_running():
            time.sleep(0.5)
        why_stopped()
    except KeyboardInterrupt:
        pass
    finally:
        service.cleanup()
