"""The writers' connections, kept in an executor's Python worker from task to task.

Spark runs the tasks that follow in the same Python worker
(``spark.python.worker.reuse``, on by default), one task at a time. Opening a
:class:`~sinks.kafka.wire.KafkaWire` costs a network thread, a connection to a
bootstrap broker, ApiVersions and Metadata, then a connection to the
coordinator: 10-20 ms a task on a quiet machine, 90-175 ms measured with Spark
busy on the same 2 cores, each micro-batch. So a writer takes a wire that an
earlier task of the worker left (:func:`take`) and leaves it when it is done
(:func:`give_back`).

Rules:

* A wire holds no transactional state: the producer id, epoch, sequences and
  coordinator belong to the task's :class:`~sinks.kafka.produce.TxnProducer`,
  so a request means the same on a reused wire as on a new one.
* A wire is held by one writer at a time: :func:`take` removes it from the
  idle ones.
* Only a wire that ended well goes back: the writer prepared, or never
  opened a transaction, nothing is in flight (``prepare`` waited for every
  answer), and no error was raised. A writer that failed or aborted closes its
  wire (an abort that did not end in time may still be using it).
* A reused wire reconnects on its own after a broker restarted or an idle
  connection was dropped (kafka-python's connection manager); a request that
  fails on the way is retried like any other.
* Wires are kept by what reaches the cluster: bootstrap servers, the client
  settings of ``producer_config`` (by their ``repr``: a setting that does not
  compare by value, such as an SSL context, just never matches, and the
  writer opens a wire of its own) and the request timeout; at most
  :data:`MAX_IDLE` idle, the oldest closed first.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any

from sinks.kafka.wire import KafkaWire, client_config

MAX_IDLE = 4
"""idle wires a Python worker keeps, whatever they connect to"""

_lock = threading.Lock()
_idle: collections.OrderedDict[int, tuple[tuple[Any, ...], KafkaWire]] = collections.OrderedDict()


def _key(
    bootstrap_servers: str | list[str], config: dict[str, Any], timeout_s: float
) -> tuple[Any, ...]:
    servers = (bootstrap_servers,) if isinstance(bootstrap_servers, str) else (*bootstrap_servers,)
    settings = tuple(sorted((k, repr(v)) for k, v in client_config(config).items()))
    return (servers, settings, timeout_s)


def take(bootstrap_servers: str | list[str], config: dict[str, Any], timeout_s: float) -> KafkaWire:
    """An idle wire to this cluster with these settings, else a new one."""
    key = _key(bootstrap_servers, config, timeout_s)
    with _lock:
        for slot, (k, wire) in _idle.items():
            if k == key:
                del _idle[slot]
                return wire
    return KafkaWire(bootstrap_servers, config=config, timeout_s=timeout_s)


def give_back(wire: KafkaWire, config: dict[str, Any], timeout_s: float) -> None:
    """Keep ``wire`` (from :func:`take` with the same arguments, ended well:
    module docstring) for the next writer of this worker."""
    key = _key(wire.bootstrap_servers, config, timeout_s)
    evicted = []
    with _lock:
        _idle[id(wire)] = (key, wire)
        while len(_idle) > MAX_IDLE:
            evicted.append(_idle.popitem(last=False)[1][1])
    for old in evicted:
        with contextlib.suppress(Exception):
            old.close()


def idle_count() -> int:
    """How many wires wait for a writer in this process."""
    with _lock:
        return len(_idle)


def close_idle() -> None:
    """Close every idle wire (tests; a worker's exit needs nothing)."""
    with _lock:
        wires = [w for _, w in _idle.values()]
        _idle.clear()
    for wire in wires:
        with contextlib.suppress(Exception):
            wire.close()
