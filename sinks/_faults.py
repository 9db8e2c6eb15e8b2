"""Fault injection for crash tests. A no-op unless a test enables it.

Crash tests name a point in the commit protocol and what happens there, in the
environment of the process under test (inherited by Spark's Python workers)::

    TWOPHASE_FAULT="driver.after_record@2=kill"       # SIGKILL the driver in batch 2
    TWOPHASE_FAULT="executor.write=kill-driver"       # an executor kills the driver
    TWOPHASE_FAULT="executor.prepared#0=raise"        # first task attempt fails after PREPARE
    TWOPHASE_FAULT="executor.prepared@1=stall:20"     # tasks of batch 1 hang 20 s after PREPARE
    TWOPHASE_FAULT="executor.prepared@1+once=kill-executor"  # one executor JVM dies, once

Syntax: ``point[@batch][#attempt_number][+once]=action`` (several joined by
``;``); a sink's point can name the kind of sink, ``driver.mid_commit.delta``,
to fire in that sink alone (the sinks of a checkpoint commit at once); actions:
``kill`` (SIGKILL this process), ``kill-driver`` (SIGKILL the process in
``TWOPHASE_DRIVER_PID``, then go on as a zombie would),
``kill-executor`` (SIGKILL the executor JVM this Python worker runs under),
``kill-worker`` (SIGKILL the process group of the Spark standalone Worker this
task runs under: the Worker, its executor JVMs and their Python workers),
``raise`` (:class:`InjectedFault`), ``stall:SECONDS`` (sleep, e.g. to be caught
in flight by a stop). In-process tests can instead ``register`` a callback.

``+once`` makes a fault fire once in the whole test, across processes and
hosts that share a directory: the first process to create the token file
``$TWOPHASE_FAULT_TOKENS/<spec>`` (exclusively) fires it, every other passes.
Keying a fault on the attempt number alone is not enough on a cluster: after
an executor is lost Spark starts the numbering again, so ``#0`` would fire on
the retry too.

On a cluster, executors inherit the Worker's environment, not the driver's:
pass these variables with ``spark.executorEnv.TWOPHASE_FAULT`` (and
``TWOPHASE_FAULT_TOKENS``, ``TWOPHASE_DRIVER_PID``); ``tests/sparkutil.py``
does so for the test jobs.

Points: ``executor.write``, ``executor.prepared``, ``executor.producer_id``
(a Kafka writer took its producer id and has added no partition to its
transaction yet), ``driver.before_record``,
``driver.before_record_ending_input`` (the same, in a query ending its input),
``driver.after_record``, ``driver.before_commit``, ``driver.mid_commit``
(inside the project's sinks, after the first of several transactions),
``driver.after_commit`` (every sink committed, the ledger not yet told),
``driver.ending_input`` (a pipeline has recorded that its input ends),
``driver.before_repay`` (an owed batch was written again and its work recorded,
not committed: :mod:`lifecycle.replay`), ``driver.merge_planned``
(a keyed Delta sink planned its merge: chose the files it rewrites, read none),
``driver.merge_staged`` (it staged its merge and has not committed it).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

ENV = "TWOPHASE_FAULT"
TOKENS_ENV = "TWOPHASE_FAULT_TOKENS"
_callbacks: dict[str, Callable[[], None]] = {}


class InjectedFault(RuntimeError):
    """Raised at a fault point by the ``raise`` action."""


def register(point: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` (in this process) the next time ``point`` is hit."""
    _callbacks[point] = fn


def clear() -> None:
    _callbacks.clear()


def _matches(
    spec: str, point: str, batch: int | None, attempt: int | None, sink: str | None
) -> str | None:
    where, _, action = spec.partition("=")
    where = where.removesuffix("+once")
    where, _, attempt_s = where.partition("#")
    name, _, batch_s = where.partition("@")
    if name.strip() not in (point, f"{point}.{sink}" if sink else point):
        return None
    if batch_s and (batch is None or int(batch_s) != batch):
        return None
    if attempt_s and (attempt is None or int(attempt_s) != attempt):
        return None
    return action.strip() or "kill"


def hit(
    point: str, *, batch: int | None = None, attempt: int | None = None, sink: str | None = None
) -> None:
    """Called by the protocol at ``point``; does nothing unless a fault is set.
    ``sink``: the kind of sink that hits it (a fault named ``point.<kind>`` fires
    there only)."""
    for name in (point, f"{point}.{sink}") if sink else (point,):
        cb = _callbacks.pop(name, None)
        if cb is not None:
            cb()
    specs = os.environ.get(ENV)
    if not specs:
        return
    for spec in specs.split(";"):
        action = _matches(spec, point, batch, attempt, sink)
        if action is None or not _first_time(spec):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "kill-driver":
            os.kill(int(os.environ["TWOPHASE_DRIVER_PID"]), signal.SIGKILL)
        elif action == "kill-executor":
            os.kill(_ancestor("CoarseGrainedExecutorBackend"), signal.SIGKILL)
        elif action == "kill-worker":
            worker = _ancestor("org.apache.spark.deploy.worker.Worker")
            os.killpg(os.getpgid(worker), signal.SIGKILL)
        elif action.startswith("stall:"):
            time.sleep(float(action.removeprefix("stall:")))
        elif action == "raise":
            raise InjectedFault(f"injected fault at {point} (batch {batch}, attempt {attempt})")
        else:
            raise ValueError(f"unknown fault action {action!r} in {ENV}")


def _first_time(spec: str) -> bool:
    """For a ``+once`` spec: whether this process is the first to fire it."""
    where = spec.partition("=")[0].strip()
    if not where.endswith("+once"):
        return True
    tokens = os.environ.get(TOKENS_ENV)
    if not tokens:
        raise RuntimeError(f"a +once fault ({spec!r}) needs {TOKENS_ENV}, a shared directory")
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in spec.strip())
    try:
        fd = os.open(os.path.join(tokens, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    return True


def _ancestor(marker: str) -> int:
    """The nearest ancestor process whose command line contains ``marker``."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if marker.encode() in f.read():
                return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4: ppid
    raise RuntimeError(f"no ancestor process runs {marker}: not on a Spark standalone cluster?")
