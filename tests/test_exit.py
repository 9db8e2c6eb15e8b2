"""Leaving a process: ``twophase`` ends with its own status, after the exit
handlers, without the interpreter teardown during which deltalake can abort
the process (delta-rs#2184; lifecycle/_exit.py).

Deterministic: an object kept in a module global says when the interpreter
finalizes it; under ``entry()`` that never happens, while every ``atexit``
handler (the user's) still runs and the command's status is the exit status.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.procs import ROOT

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    class Finalized:
        def __del__(self):
            print("finalized", flush=True)
    kept = Finalized()
    atexit.register(lambda: print("handler ran", flush=True))
    sys.argv = ["twophase", *sys.argv[1:]]
    if sys.argv[1] == "--plain":
        sys.exit(0)
    from lifecycle.cli import entry
    entry()
    """
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "status"),
    [(("status", "/nonexistent/state"), 2), (("--help",), 0), (("no-such-command",), 2)],
)
def test_twophase_leaves_with_its_status_after_the_exit_handlers(
    args: tuple[str, ...], status: int
) -> None:
    run = _run(*args)
    assert run.returncode == status, run.stderr[-2000:]
    assert "handler ran" in run.stdout
    assert "finalized" not in run.stdout  # no interpreter teardown after the handlers


def test_the_script_can_tell_a_teardown() -> None:
    """The check above can fail: without ``entry()`` the teardown is seen."""
    run = _run("--plain")
    assert run.returncode == 0 and "handler ran" in run.stdout and "finalized" in run.stdout
