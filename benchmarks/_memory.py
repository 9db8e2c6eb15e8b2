"""Peak memory of a benchmark's process tree, read from ``/proc`` (Linux).

:class:`TreeSampler` watches one process and its descendants on a thread and
keeps, per role, the peak it saw:

* ``driver``: the watched process itself (the driver's Python);
* ``jvm``: the ``java`` processes under it (Spark's driver JVM; in
  ``local[N]`` the executors run in it too);
* ``workers``: the other Python processes under it (Spark's Python workers,
  the executors' Python side: the ``pyspark.daemon`` and the workers it
  forks; or a baseline's own producer processes);
* ``other``: anything else (a helper a script starts).

For the single processes (``driver``, ``jvm``) the peak is the kernel's
high-water mark of the resident set (``VmHWM`` in ``/proc/<pid>/status``),
exact whatever the sampling rate; for ``jvm`` the greatest of the java
processes' (Spark's launcher runs a small JVM before the driver's own, and a
process's role is the last one seen: ``spark-class`` is a shell until it
execs java). A role of several processes has no such
mark: its peak is the greatest sum of their proportional set sizes (``Pss``
in ``/proc/<pid>/smaps_rollup``) over the samples, so that pages the forked
workers share with their daemon count once; a peak shorter than the sampling
period (``period``, 0.1 s) may be missed. Services the benchmark uses (a
PostgreSQL server, a Kafka broker) must be started outside the watched tree,
or they are counted under ``jvm`` or ``other``.

The watched process must be this one's child or share its user (``/proc``
hides other users' ``smaps_rollup``); psutil is not needed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

ROLES = ("driver", "jvm", "workers", "other")
PROC = Path("/proc")


def _status(pid: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _kib(value: str) -> int:
    """``"1234 kB"`` in bytes."""
    return int(value.split()[0]) * 1024 if value else 0


def _pss(pid: int) -> int:
    for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return _kib(line.partition(":")[2])
    return 0


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in (PROC / str(pid) / "task").iterdir():
        text = (task / "children").read_text().split()
        kids.extend(int(k) for k in text)
    return kids


def role_of(pid: int, root: int) -> str:
    """What ``pid`` is in the tree under ``root``: one of :data:`ROLES`."""
    if pid == root:
        return "driver"
    argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    exe = Path(argv[0].decode(errors="replace")).name if argv and argv[0] else ""
    if exe == "java":
        return "jvm"
    if exe.startswith("python"):
        return "workers"
    return "other"


@dataclass
class Peaks:
    """The peaks a :class:`TreeSampler` saw, in bytes, per role."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    processes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    """how many processes of each role were seen"""
    samples: int = 0

    def mib(self, role: str) -> float:
        return self.bytes[role] / 2**20


class TreeSampler:
    """Samples the tree under ``pid`` every ``period`` seconds until :meth:`stop`."""

    def __init__(self, pid: int, period: float = 0.1) -> None:
        self.pid = pid
        self.period = period
        self.peaks = Peaks()
        self._role: dict[int, str] = {}
        self._hwm: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> Peaks:
        """Stops sampling (after one last sample) and returns the peaks."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peaks

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.period):
                self.sample()
                return

    def _tree(self) -> list[int]:
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            try:
                todo.extend(_children(pid))
            except OSError:  # it ended meanwhile
                continue
        return out

    def sample(self) -> None:
        """One look at the tree: every process's mark and set, each role's sum."""
        sums = dict.fromkeys(ROLES, 0)
        for pid in self._tree():
            try:
                role = role_of(pid, self.pid)
                status = _status(pid)
                hwm = _kib(status.get("VmHWM", ""))
                pss = _pss(pid) if role in ("workers", "other") else _kib(status.get("VmRSS", ""))
            except (OSError, ValueError, IndexError):  # ended meanwhile, or a zombie
                continue
            self._role[pid] = role
            self._hwm[pid] = max(self._hwm.get(pid, 0), hwm)
            sums[role] += pss
        p = self.peaks
        p.samples += 1
        for role in ROLES:
            mine = [pid for pid, r in self._role.items() if r == role]
            p.processes[role] = len(mine)
            if role in ("driver", "jvm"):
                p.bytes[role] = max((self._hwm[pid] for pid in mine), default=0)
            else:
                p.bytes[role] = max(p.bytes[role], sums[role])
