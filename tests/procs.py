"""Running job scripts as real driver processes, for crash and lifecycle tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.sparkcluster import SPARK_HOME
from tests.sparkutil import EXECUTOR_ENV_ENV, MASTER_ENV

ROOT = Path(__file__).resolve().parents[1]


class JobProcess:
    """A job script in its own process (own JVM and Python workers), output in a log."""

    def __init__(
        self,
        script: str,
        args: list[str],
        log: Path,
        fault: str | None = None,
        env: dict[str, str] | None = None,
        root: Path = ROOT,
        cwd: Path | None = None,
    ):
        """``root``: the source tree whose job script and packages run (another
        version of the project, for upgrade tests); ``cwd``: the job's working
        directory (default ``root``)."""
        env = {**os.environ, **(env or {})}
        if root != ROOT:
            env["PYTHONPATH"] = str(root)
        env.pop("TWOPHASE_FAULT", None)
        if fault:
            env["TWOPHASE_FAULT"] = fault
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(log, "a")  # noqa: SIM115 (closed in wait)
        self._out.write(f"\n===== {script} {' '.join(args)} (fault: {fault})\n")
        self._out.flush()
        self.proc = subprocess.Popen(
            _command(root / "tests" / "jobs" / script, args, env),
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=cwd or root,
            start_new_session=True,
        )

    def wait(self, timeout: float = 240) -> int:
        """The exit status; on timeout the process group is killed and the
        assertion shows the end of the job's log."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"the job did not exit within {timeout}s (killed):\n{self.tail()}"
            ) from None
        finally:
            self._out.close()

    def kill(self) -> None:
        """SIGKILL the job and everything it started (JVM, Python workers)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def killed(self) -> bool:
        """Whether the job's driver died by SIGKILL: the process itself, or the
        Python driver under ``spark-submit`` (which then exits with 128 + 9)."""
        return self.proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text()

    def result(self) -> dict[str, Any]:
        """The RESULT line of the last run in the log."""
        line = self.output().rsplit("RESULT ", 1)[1].splitlines()[0]
        return json.loads(line)  # type: ignore[no-any-return]

    def tail(self, n: int = 6000) -> str:
        """The end of the log, without JVM stack frames (they would crowd out
        the job's own lines)."""
        lines = [ln for ln in self.output().splitlines() if not ln.lstrip().startswith("at ")]
        return "\n".join(lines)[-n:]


def _command(script: Path, args: list[str], env: dict[str, str]) -> list[str]:
    """``python SCRIPT ARGS``; on a cluster (``TWOPHASE_TEST_MASTER`` set) the
    way users launch a job there: ``spark-submit`` in client mode with the
    executors' environment as an archive (docs/deploying.md)."""
    master = env.get(MASTER_ENV)
    if not master:
        return [sys.executable, str(script), *args]
    cmd = [str(SPARK_HOME / "bin" / "spark-submit"), "--master", master]
    if env.get(EXECUTOR_ENV_ENV):
        cmd += ["--archives", f"{env[EXECUTOR_ENV_ENV]}#environment"]
        cmd += ["--conf", "spark.pyspark.python=./environment/bin/python"]
    cmd += ["--conf", f"spark.pyspark.driver.python={sys.executable}"]
    return [*cmd, str(script), *args]


def run_job(
    script: str,
    args: list[str],
    log: Path,
    fault: str | None = None,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> JobProcess:
    """Run a job script to its end (``env``: variables added to the job's;
    ``cwd``: its working directory)."""
    jp = JobProcess(script, args, log, fault, env, cwd=cwd)
    jp.wait(timeout)
    return jp


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, proc: JobProcess | None = None
) -> Any:
    """Poll ``predicate`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.proc.poll() is not None:
            raise AssertionError(
                f"the job exited ({proc.proc.returncode}) before {what}:\n" + proc.tail()
            )
        time.sleep(0.2)
    if proc is not None:
        proc.kill()  # a job left running would hold prepared work past the test
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}" + (f":\n{proc.tail()}" if proc else "")
    )


def tree_at(commit: str, into: Path) -> Path:
    """The project's tree at ``commit``, extracted from git into ``into`` (to run
    an earlier version against today's state)."""
    import io
    import tarfile

    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return into


def twophase(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``twophase ARGS`` in a process (and, for a URI STATE_DIR, a JVM) of its
    own; ``env``: variables added to this process's."""
    return subprocess.run(
        [sys.executable, "-m", "lifecycle.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def crash_delta_store_job(args: list[str], log: Path) -> Any:
    """``tests/jobs/delta_store_job.py ARGS`` through the kit's ``crash_test``:
    four kills, at random instants within 5-15 s of a start and at named
    points, every start on a fresh host, then a run to the end; at least three
    runs must really have been killed (one that ends before its kill counts as
    done). Returns the report."""
    from lifecycle.testing import crash_test

    report = crash_test(
        ROOT / "tests" / "jobs" / "delta_store_job.py",
        args=args,
        kills=4,
        env={"PYTHONPATH": str(ROOT)},
        min_delay=5.0,
        max_delay=15.0,
        timeout=400.0,
        log=log,
        fresh_host=True,
    )
    print(report)
    assert report.kills >= 3, report
    return report
