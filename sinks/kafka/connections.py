"""The Kafka sink's connections on the driver, kept from one checkpoint to the next.

One :class:`DriverConnections` per :class:`~sinks.kafka.sink.KafkaSink` on the
driver (never pickled to executors):

* :meth:`~DriverConnections.wire`: the connection for raw protocol requests
  (EndTxn, InitProducerId, reads of the registry and of control markers);
* :meth:`~DriverConnections.spare`: a connection of its own for one part of a
  commit or an abort that runs at once with others (a broker answers one
  request of a connection at a time, and tansu closes the connection that
  carried a refused EndTxn, which must not fail the other parts' requests);
* :meth:`~DriverConnections.each`: runs the parts, the first on the main
  connection and the others on spares;
* :meth:`~DriverConnections.producer`: the plain, acks=all producer of the
  registry's records (claims, progress records, tombstones).

Each is dropped on an error and opened anew the next time it is needed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import kafka.errors as Errors
from kafka import KafkaProducer

from sinks._parallel import run_parts
from sinks.kafka.wire import KafkaWire


class DriverConnections:
    """Connections to one cluster (``bootstrap_servers``, ``config``: kafka-python
    settings); a request never waits much longer than a quarter of
    ``commit_timeout``, so one attempt never outlasts a commit's retry budget."""

    def __init__(
        self, bootstrap_servers: str | list[str], config: dict[str, Any], commit_timeout: float
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.config = config
        self.timeout_s = min(30.0, max(2.0, commit_timeout / 4))
        self._lock = threading.RLock()
        self._wire: KafkaWire | None = None
        self._spares: list[KafkaWire] = []
        self._spares_lock = threading.Lock()
        self._producer: KafkaProducer | None = None

    def _new_wire(self) -> KafkaWire:
        return KafkaWire(self.bootstrap_servers, config=self.config, timeout_s=self.timeout_s)

    @contextlib.contextmanager
    def wire(self) -> Iterator[KafkaWire]:
        """The main connection, held by one caller at a time."""
        with self._lock:
            if self._wire is None:
                self._wire = self._new_wire()
            try:
                yield self._wire
            except BaseException:
                wire, self._wire = self._wire, None
                with contextlib.suppress(Exception):
                    wire.close()
                raise

    @contextlib.contextmanager
    def spare(self) -> Iterator[KafkaWire]:
        """A connection of its own, kept for the next caller when it ends well."""
        with self._spares_lock:
            wire = self._spares.pop() if self._spares else None
        if wire is None:
            wire = self._new_wire()
        try:
            yield wire
        except BaseException:
            with contextlib.suppress(Exception):
                wire.close()
            raise
        with self._spares_lock:
            self._spares.append(wire)

    def each(
        self,
        wire: KafkaWire,
        parts: list[list[str]],
        work: Callable[[KafkaWire, list[str]], None],
        what: str,
    ) -> None:
        """``work(connection, part)`` for every part at once, the first on
        ``wire`` (the main connection, which the caller holds) and each other on
        a spare; the first error is raised once every part has ended."""
        run_parts(parts, work, wire, self.spare, name=f"twophase-kafka-{what}")

    @contextlib.contextmanager
    def producer(self) -> Iterator[KafkaProducer]:
        """The plain (non-transactional, acks=all) producer; dropped on a Kafka error."""
        with self._lock:
            if self._producer is None:
                self._producer = KafkaProducer(
                    **{**self.config, "bootstrap_servers": self.bootstrap_servers, "acks": "all"}
                )
            try:
                yield self._producer
            except Errors.KafkaError:
                producer, self._producer = self._producer, None
                if producer is not None:
                    with contextlib.suppress(Exception):
                        producer.close(timeout=0)
                raise

    def close(self) -> None:
        """Close every connection (optional: their threads are daemons)."""
        with self._lock:
            wire, self._wire = self._wire, None
            producer, self._producer = self._producer, None
        with self._spares_lock:
            spares, self._spares = self._spares, []
        for w in [wire, *spares]:
            if w is not None:
                w.close()
        if producer is not None:
            producer.close(timeout=5)
