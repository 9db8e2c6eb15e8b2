"""What the natively started services (:mod:`lifecycle.testing.postgres_server`,
:mod:`lifecycle.testing.kafka_broker`) share: a free loopback port, use as a
context manager, and running one as a program until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import TypeVar


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
