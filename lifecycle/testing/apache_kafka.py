"""Apache Kafka for tests, demos and benchmarks: one KRaft broker on loopback.

``ApacheKafka`` runs the real broker, the one users run, from the jars that
:mod:`lifecycle.testing.jars` fetched (set ``kafka-broker``): a combined
broker and controller (``process.roles=broker,controller``) on two free ports
of 127.0.0.1, its log directory in a temporary directory, formatted with
``kafka.tools.StorageTool format --standalone`` and started with
``kafka.Kafka``, stopped by its PID. ``config`` adds or overrides broker
settings (``transaction.max.timeout.ms``, ...); ``features`` sets feature
levels at format time (``{"transaction.version": 1}``: a broker with
transactions version 1, where Kafka 4.x formats with 2). ``security`` (a
:class:`~lifecycle.testing.kafka_security.SecureListener`) serves clients over
SASL_SSL (SCRAM) with ACLs enforced instead of PLAINTEXT; :meth:`ApacheKafka.client`
gives the settings of a client of the super user.

``kill()`` (SIGKILL) then ``start()`` brings the same broker back on the same
ports and log directory, as a crashed broker restarts. Unlike the embedded
tansu broker (:mod:`lifecycle.testing.kafka_broker`) it enforces transaction
timeouts, checks CRCs, sends the aborted-transactions list to read_committed
consumers, compacts, and keeps every transactional id's state in its
transaction coordinator.

The wheel ships no jar: when the set is not fetched, :class:`KafkaJarsMissing`
says how (``python -m lifecycle.testing.jars fetch kafka-broker``, which needs
Maven). Run as a program (``python -m lifecycle.testing.apache_kafka``) it
starts a broker, prints its bootstrap address and waits for Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from lifecycle.testing import jars
from lifecycle.testing.kafka_security import ADMIN, SecureListener
from lifecycle.testing.services import ProcessService, free_port, java, serve

KafkaJarsMissing = jars.JarsMissingError

DEFAULTS: dict[str, str] = {
    "num.partitions": "1",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "4",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    "log.cleaner.backoff.ms": "1000",
    "auto.create.topics.enable": "true",
}
"""a single broker's settings (replication factors of 1) and quick starts"""


class ApacheKafkaError(RuntimeError):
    """The broker did not start, or died; carries the tail of its log."""


def _java() -> str:
    return java("Apache Kafka", ApacheKafkaError)


class ApacheKafka(ProcessService):
    """One Apache Kafka broker (KRaft, combined mode) on 127.0.0.1.

    ``bootstrap`` is ``"127.0.0.1:PORT"`` once ``start()`` returned; ports and
    log directory are kept across ``stop()``/``kill()`` and ``start()``."""

    def __init__(
        self,
        config: dict[str, str] | None = None,
        *,
        heap: str = "512m",
        features: dict[str, int] | None = None,
        security: SecureListener | None = None,
    ) -> None:
        self.classpath = os.pathsep.join(str(p) for p in jars.jars("kafka-broker"))
        super().__init__("apachekafka-", "server.log")
        self.config = {**DEFAULTS, **(config or {})}
        self.heap = heap
        self.features = dict(features or {})
        self.security = security
        self.port: int | None = None
        self.controller_port: int | None = None
        self._formatted = False

    @property
    def bootstrap(self) -> str:
        """``host:port`` for ``bootstrap_servers``."""
        if self.port is None:
            raise ApacheKafkaError("the broker has not been started yet")
        return f"127.0.0.1:{self.port}"

    def client(self) -> dict[str, Any]:
        """kafka-python settings of a client of the broker's super user (none
        for a PLAINTEXT broker)."""
        return self.security.client(ADMIN) if self.security is not None else {}

    def _properties(self) -> Path:
        assert self.port is not None and self.controller_port is not None
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "listeners": (
                f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}",
            "log.dirs": str(self.workdir / "data"),
        }
        if self.security is not None:
            keytool = str(Path(_java()).resolve().parent / "keytool")
            self.security.prepare(self.workdir / "tls", keytool)
            props.update(self.security.broker_config(self.port, self.controller_port))
        props.update(self.config)
        path = self.workdir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def _java(self, main: str, *args: str) -> list[str]:
        return [
            _java(),
            f"-Xmx{self.heap}",
            "-XX:+UseG1GC",
            "-XX:TieredStopAtLevel=1",  # starts faster; a test broker needs no C2
            "-Djava.awt.headless=true",
            "-cp",
            self.classpath,
            main,
            *args,
        ]

    def _format(self, props: Path) -> None:
        cluster = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        levels = [a for k, v in self.features.items() for a in ("--feature", f"{k}={v}")]
        done = subprocess.run(
            self._java(
                "kafka.tools.StorageTool",
                "format",
                "--standalone",
                f"--cluster-id={cluster}",  # an id may begin with "-"
                "-c",
                str(props),
                *levels,
                *(self.security.scram_arguments() if self.security is not None else []),
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise ApacheKafkaError(
                f"formatting the log directory failed:\n{(done.stdout + done.stderr)[-3000:]}"
            )
        self.format_output = done.stdout
        self._formatted = True

    def start(self, timeout: float = 120.0) -> None:
        """Start the broker (formatting its log directory the first time) and
        wait until it answers a metadata request."""
        if self.is_running():
            return
        if self.port is None:
            self.port = free_port()
            self.controller_port = free_port()
        props = self._properties()
        if not self._formatted:
            self._format(props)
        self._spawn(self._java("kafka.Kafka", str(props)))
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _check_alive(self) -> None:
        status = self._exit_status()
        if status is not None:
            raise ApacheKafkaError(f"Apache Kafka exited with status {status}\n{self.log_tail()}")

    def _wait_ready(self, timeout: float) -> None:
        from kafka import KafkaAdminClient

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with socket.create_connection(("127.0.0.1", self.port or 0), timeout=1.0):
                    pass
                admin = KafkaAdminClient(
                    **self.client(),
                    bootstrap_servers=self.bootstrap,
                    bootstrap_timeout_ms=5000,
                    request_timeout_ms=5000,
                )
                try:
                    admin.list_topics()
                    return
                finally:
                    admin.close()
            except Exception as e:  # not ready yet
                last = e
                time.sleep(0.3)
        raise ApacheKafkaError(
            f"Apache Kafka on {self.bootstrap} did not answer within {timeout:.0f}s ({last})\n"
            f"{self.log_tail()}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the broker (SIGTERM: a controlled shutdown; SIGKILL after
        ``timeout`` s). Its log directory and ports are kept; ``kill()`` is a
        crash, after which ``start()`` recovers the same log directory."""
        super().stop(timeout)


def main(argv: list[str] | None = None) -> None:
    """Start a broker, print its bootstrap address, wait for Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a broker setting"
    )
    args = parser.parse_args(argv)
    broker = ApacheKafka(dict(s.split("=", 1) for s in args.set))
    serve(broker, lambda: broker.bootstrap, broker._check_alive)


if __name__ == "__main__":
    main()
