"""``crash_test``: SIGKILL a user's job again and again, restart it until it is done,
then verify its sinks.

The job runs in a child process of its own (its own Spark driver JVM and
Python workers), as in production: ``job`` is the path of a script, or
``"package.module:function"`` (the function is called with no arguments; its
return value, if an int, is the exit status). It must end by itself (bounded
pipelines, or a drain once its input is consumed) and exit 0 when its run
committed (``JobResult.committed``), and it must use the same ``state_dir``
every time, so that each start recovers what the last one left.

Each of the ``kills`` runs is SIGKILLed, alternately:

* at a random instant (``min_delay`` to ``max_delay`` seconds after it started),
* at a named point of the commit protocol (:data:`FAULT_POINTS`, in turn): the
  driver kills itself there (``TWOPHASE_FAULT``; see :mod:`sinks._faults`),
  where a crash is the most dangerous: after a batch is recorded but before
  Spark knows it, between a checkpoint's decision and its commit, in the
  middle of a commit (inside the project's own sinks), before a batch is
  recorded, and after every sink committed but before the ledger says so.

Each run has a session of its own, and a kill takes the whole session (the
driver's JVM and Python workers with it), as a lost machine would. With
``fresh_host=True`` each run also starts on a "host" of its own: a new
working directory, temp dir (``TMPDIR``) and Spark local dir
(``SPARK_LOCAL_DIRS``), deleted when the run ends, so a job whose state is on
shared storage (a ``state_dir`` URI) shows it needs nothing of the last
host's disk. A run that
ends with 0 before its kill (a named point it never reached) counts as done; one
that ends otherwise fails the test. Then the job runs once more
without faults until it exits (``timeout`` each run); ``verify()``, when given,
checks the sinks (see :mod:`lifecycle.testing.verify`). The random choices come
from ``seed`` (printed in the report, so a failure can be replayed).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

FAULT_POINTS = (
    "driver.after_record",
    "driver.before_commit",
    "driver.mid_commit",
    "driver.before_record",
    "driver.after_commit",
)
"""Where a named kill strikes (the first time the driver reaches the point)."""


@dataclass(frozen=True)
class Run:
    """One start of the job."""

    how: str  # "random 3.2s", "at driver.before_commit", "to completion"
    exit_code: int
    seconds: float
    killed: bool


@dataclass
class CrashReport:
    """What :func:`crash_test` did."""

    seed: int
    runs: list[Run] = field(default_factory=list)
    log: Path | None = None

    @property
    def kills(self) -> int:
        """How many runs were killed."""
        return sum(1 for r in self.runs if r.killed)

    def __str__(self) -> str:
        lines = [f"crash test, seed {self.seed}: {self.kills} kill(s), log {self.log}"]
        lines += [
            f"  run {i}: {r.how}: {'SIGKILL' if r.killed else f'exit {r.exit_code}'} after "
            f"{r.seconds:.1f}s"
            for i, r in enumerate(self.runs, 1)
        ]
        return "\n".join(lines)


class CrashTestError(AssertionError):
    """The job did not finish cleanly after its kills (the message has the log tail)."""


def crash_test(
    job: str | os.PathLike[str],
    *,
    kills: int = 3,
    seed: int | None = None,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    verify: Callable[[], object] | None = None,
    fault_points: Sequence[str] = FAULT_POINTS,
    min_delay: float = 2.0,
    max_delay: float = 12.0,
    timeout: float = 300.0,
    log: str | os.PathLike[str] | None = None,
    fresh_host: bool = False,
) -> CrashReport:
    """Kill ``job`` ``kills`` times, run it to completion, then ``verify()``
    (module docstring). ``args`` and ``env`` go to every run; ``log`` collects
    every run's output (default: a temporary file, named in the report).
    Raises :class:`CrashTestError` when the last run fails or does not end."""
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    out = (
        Path(log)
        if log is not None
        else Path(tempfile.mkstemp(prefix="crash-test-", suffix=".log")[1])
    )
    report = CrashReport(seed, log=out)
    command = _command(job, args)
    base = {**os.environ, **(env or {})}
    base.pop("TWOPHASE_FAULT", None)
    points = list(fault_points)
    for k in range(kills):
        named = bool(points) and k % 2 == 1
        with _host(fresh_host) as host:
            if named:
                point = points[(k // 2) % len(points)]
                faulty = {**base, **host.env, "TWOPHASE_FAULT": f"{point}=kill"}
                run = _run(command, faulty, out, timeout, None, f"at {point}", host.cwd)
            else:
                delay = rng.uniform(min_delay, max_delay)
                how = f"random {delay:.1f}s"
                run = _run(command, {**base, **host.env}, out, timeout, delay, how, host.cwd)
        report.runs.append(run)
        if not run.killed:
            if run.exit_code != 0:
                raise CrashTestError(
                    f"{report}\nrun {k + 1} ({run.how}) exited {run.exit_code} without being "
                    f"killed:\n{_tail(out)}"
                )
            break  # it finished before the kill (a named point it never reached)
    with _host(fresh_host) as host:
        final = _run(command, {**base, **host.env}, out, timeout, None, "to completion", host.cwd)
    report.runs.append(final)
    if final.exit_code != 0:
        raise CrashTestError(f"{report}\nthe last run exited {final.exit_code}:\n{_tail(out)}")
    if verify is not None:
        verify()
    return report


@dataclass(frozen=True)
class _Host:
    cwd: str | None
    env: dict[str, str]


@contextlib.contextmanager
def _host(fresh: bool) -> Iterator[_Host]:
    """Where one run starts: this process's directory, or a fresh "host"."""
    if not fresh:
        yield _Host(None, {})
        return
    with tempfile.TemporaryDirectory(prefix="crash-host-") as root:
        dirs = {name: Path(root) / name for name in ("cwd", "tmp", "spark-local")}
        for d in dirs.values():
            d.mkdir()
        env = {"TMPDIR": str(dirs["tmp"]), "SPARK_LOCAL_DIRS": str(dirs["spark-local"])}
        yield _Host(str(dirs["cwd"]), env)


def _command(job: str | os.PathLike[str], args: Sequence[str]) -> list[str]:
    text = os.fspath(job)
    if Path(text).exists():
        text = str(Path(text).resolve())  # a fresh host's run starts elsewhere
    if ":" in text and not Path(text).exists():
        module, _, function = text.partition(":")
        code = (
            "import importlib, sys\n"
            f"result = getattr(importlib.import_module({module!r}), {function!r})()\n"
            "sys.exit(result if isinstance(result, int) else 0)\n"
        )
        return [sys.executable, "-c", code, *args]
    return [sys.executable, text, *args]


def _run(
    command: list[str],
    env: dict[str, str],
    log: Path,
    timeout: float,
    kill_after: float | None,
    how: str,
    cwd: str | None = None,
) -> Run:
    began = time.monotonic()
    with open(log, "ab") as out:
        out.write(f"\n===== {how}: {' '.join(command[:2])} ...\n".encode())
        out.flush()
        # a session of its own: a kill takes the driver's JVM and Python workers too,
        # so none of them outlives it into the next run
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        killed = False
        try:
            if kill_after is not None:
                try:
                    proc.wait(kill_after)
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    killed = True
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            raise CrashTestError(
                f"the job ({how}) did not end within {timeout:.0f}s:\n{_tail(log)}"
            ) from None
    killed = killed or proc.returncode == -signal.SIGKILL
    if killed:
        _kill_group(proc)  # what a driver that killed itself left running
    return Run(how, code, time.monotonic() - began, killed)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(log: Path, n: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"
