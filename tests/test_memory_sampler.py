"""The benchmarks' memory sampler (``benchmarks/_memory.py``) on real processes:
a driver that grew and shrank again is reported at its high-water mark, and a
worker it started is reported as a worker, once, not added to the driver."""

from __future__ import annotations

import subprocess
import sys

from benchmarks._memory import TreeSampler

MIB = 2**20

# 300 MiB held for a moment, then freed; meanwhile a child holds 120 MiB for 1.5 s
DRIVER = f"""
import subprocess, sys, time
big = b"x" * (300 * {MIB})
time.sleep(0.5)
del big
child = subprocess.Popen([sys.executable, "-c",
    "import time; held = b'y' * (120 * {MIB}); time.sleep(1.5)"])
child.wait()
"""


def test_the_sampler_reports_each_role_at_its_peak() -> None:
    proc = subprocess.Popen([sys.executable, "-c", DRIVER])
    with TreeSampler(proc.pid, period=0.05) as sampler:
        assert proc.wait(timeout=60) == 0
    peaks = sampler.peaks
    assert peaks.processes["driver"] == 1
    assert peaks.processes["workers"] == 1
    assert peaks.processes["jvm"] == 0 and peaks.bytes["jvm"] == 0
    # the driver freed its 300 MiB before the child started: only its mark keeps them
    assert 300 * MIB <= peaks.bytes["driver"] < 420 * MIB
    # the worker's 120 MiB, counted once (not the driver's, not twice)
    assert 120 * MIB <= peaks.bytes["workers"] < 240 * MIB
