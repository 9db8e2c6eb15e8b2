"""Soak: hundreds of random driver SIGKILLs across one job writing PostgreSQL,
Kafka and Delta, restarted each time (``-m soak``; not in the default run).

A round is one bounded job (``tests/jobs/multi_sink_job.py``: one pipeline,
the same batches to the three sinks) over an input of many small files, two a
batch. The job is started, SIGKILLed with its JVM and Python workers after a
random time (a fifth of the kills during start-up and recovery, a fifth in
the run's first batch, the rest within 8 s of its first committed checkpoint:
in batches, records and commits), and
started again on the same state, until a run ends by itself; then every row
must be in every sink exactly once, with nothing prepared, open or staged,
and the ledger's checkpoints must map one to one onto Delta versions. Rounds
repeat until ``TWOPHASE_SOAK_KILLS`` kills (default 200) were made.

Resumable: with ``TWOPHASE_SOAK_LOG=FILE`` the kills, rounds and rows of
earlier invocations are read from and added to ``FILE`` (one JSON object), so
the soak can run in chunks (``TWOPHASE_SOAK_KILLS`` then counts the kills of
this chunk). The figures are printed at the end (run with ``-s``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from tests.conftest import write_input
from tests.multisink import Run
from tests.procs import JobProcess

pytestmark = pytest.mark.soak

FILES = 40
ROWS_PER_FILE = 25
# when a kill comes: a share of them timed from the process's start (start-up,
# recovery), a share from the pipeline's start (its first batch, which carries
# Spark's warm-up), the rest from the run's first committed checkpoint (later
# batches, records and commits at 1 to 2 s a batch)
EARLY_SHARE, EARLY_KILL = 0.2, (1.0, 15.0)
FIRST_SHARE, FIRST_KILL = 0.2, (0.0, 12.0)
LATE_KILL = (0.0, 8.0)
MAX_RUNS_PER_ROUND = 60


def _reached(job: JobProcess, text: str, timeout: float = 120.0) -> None:
    """Wait until this run of the job logged ``text`` (or ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.proc.poll() is None:
        if text in job.output().rsplit("===== ", 1)[-1]:
            return
        time.sleep(0.1)


def _totals(path: Path | None) -> dict[str, int]:
    if path is not None and path.exists():
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    return {"kills": 0, "rounds": 0, "rows": 0, "clean_exits": 0}


def test_random_driver_kills(
    pg_dsn: str, kafka_bootstrap: str, kafka_topic: Callable[[int], str], tmp_path: Path
) -> None:
    target = int(os.environ.get("TWOPHASE_SOAK_KILLS", "200"))
    log_env = os.environ.get("TWOPHASE_SOAK_LOG")
    log = Path(log_env) if log_env else None
    totals = _totals(log)
    rng = random.Random(int(os.environ.get("TWOPHASE_SOAK_SEED", str(time.time_ns()))))
    kills = 0
    counted = 0  # kills already added to totals
    round_no = 0
    started = time.monotonic()
    while kills < target:
        round_no += 1
        root = tmp_path / f"round{round_no}"
        n = write_input(root / "in", files=FILES, rows_per_file=ROWS_PER_FILE)
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute("DROP TABLE IF EXISTS orders")
            c.execute(
                "CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8, part bigint)"
            )
        run = Run(root, pg_dsn, kafka_bootstrap, kafka_topic(3))
        for _ in range(MAX_RUNS_PER_ROUND):
            job = run.start(files_per_batch=2, wait=False)
            where = rng.random()
            if where < EARLY_SHARE:  # at start-up: recovery, claims, sweeps
                after = rng.uniform(*EARLY_KILL)
            elif where < EARLY_SHARE + FIRST_SHARE:  # in the run's first batch
                _reached(job, "starting pipeline load")
                after = rng.uniform(*FIRST_KILL)
            else:  # once this run committed a checkpoint: batches, records, commits
                _reached(job, ") committed: cut")
                after = rng.uniform(*LATE_KILL)
            try:
                job.proc.wait(after)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait(60)
                assert job.killed(), job.tail()
                kills += 1
                continue
            job.wait(60)
            assert job.proc.returncode == 0, job.tail()
            totals["clean_exits"] += 1
            break
        else:
            pytest.fail(f"round {round_no} did not finish in {MAX_RUNS_PER_ROUND} runs")
        run.check(n)
        totals["rounds"] += 1
        totals["rows"] += n
        totals["kills"] += kills - counted
        counted = kills
        if log is not None:  # after every round: a chunk cut short keeps its rounds
            log.write_text(json.dumps(totals))
        print(
            f"soak: round {round_no} exactly once after {kills} kills so far "
            f"({time.monotonic() - started:.0f}s)",
            flush=True,
        )
    print(f"soak: this chunk {kills} kills in {round_no} rounds; all chunks {totals}", flush=True)


def test_a_delta_job_exits_zero_every_time(tmp_path: Path) -> None:
    """deltalake can abort a process as the interpreter finalizes (delta-rs#2184):
    a job whose final checkpoint committed must still exit 0, every time.
    ``TWOPHASE_SOAK_EXITS`` runs (default 50) of a bounded job with a Delta sink,
    each a fresh driver process."""
    runs = int(os.environ.get("TWOPHASE_SOAK_EXITS", "50"))
    statuses: dict[int, int] = {}
    for i in range(runs):
        root = tmp_path / f"r{i}"
        n = write_input(root / "in", files=2, rows_per_file=20)
        run = Run(root, None, None, None, sinks="delta")
        job = run.start()
        statuses[job.proc.returncode] = statuses.get(job.proc.returncode, 0) + 1
        assert job.proc.returncode == 0, job.tail()
        run.check(n)
    print(f"soak: {runs} Delta job runs, exit statuses {statuses}", flush=True)
