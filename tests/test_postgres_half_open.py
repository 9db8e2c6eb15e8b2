"""A half-open connection to PostgreSQL cannot hold a commit for the OS TCP timeout.

The scenario (``tests/jobs/half_open.py``) runs in a private network namespace
of its own: a real server on that namespace's loopback, two prepared
transactions, and the loopback taken down between the two ``COMMIT PREPARED``
statements, so the second waits on a connection whose peer never answers.
Without keepalives it would wait about 15 minutes; the sink's connections notice
the dead peer within a third of ``commit_timeout`` and the commit fails after
``commit_timeout`` with its retries spent. With the network back, the next
commit finishes the work.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.procs import ROOT

COMMIT_TIMEOUT = 12.0
# a network namespace of its own; a PID namespace too, so that every process of
# the scenario (the server included) dies with it if the test kills it
UNSHARE = ["unshare", "--net", "--pid", "--fork", "--kill-child"]


def _can_unshare_net() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(
        [*UNSHARE, "ip", "link", "set", "lo", "up"], capture_output=True, check=False
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_unshare_net(), reason="needs unshare --net and ip (root)")
def test_commit_on_a_half_open_connection_fails_within_commit_timeout() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [*UNSHARE, sys.executable, "-m", "tests.jobs.half_open", str(COMMIT_TIMEOUT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=COMMIT_TIMEOUT + 90,  # without keepalives: ~15 minutes
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["first"].startswith("CommitError") and f"within {COMMIT_TIMEOUT:g}s" in out["first"]
    assert "could not receive data from server" in run.stderr  # the dead peer, noticed
    assert out["seconds"] < COMMIT_TIMEOUT + 10
    assert out["rows"] == 2 and out["prepared"] == 0
