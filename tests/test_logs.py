"""Logs a person can read: quiet by default, chatty when asked, never configured
on import (lifecycle/logs.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from lifecycle import Job
from sinks import PostgresSink
from tests.conftest import write_input
from tests.sparkutil import INPUT_SCHEMA

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json, logging, sys
import lifecycle, sinks  # importing must not configure logging
before = {"handlers": len(logging.getLogger().handlers)}
from lifecycle import configure_logging
configure_logging()
names = ("lifecycle", "sinks", "py4j", "kafka")
levels = {n: logging.getLogger(n).getEffectiveLevel() for n in names}
print(json.dumps({**before, "after": len(logging.getLogger().handlers), **levels}))
"""


def _probe(**env: str) -> dict[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TWOPHASE_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_configures_nothing_and_the_switch_works() -> None:
    quiet = _probe()
    assert quiet["handlers"] == 0 and quiet["after"] == 1
    assert quiet["lifecycle"] == quiet["sinks"] == logging.INFO
    assert quiet["py4j"] == quiet["kafka"] == logging.WARNING
    loud = _probe(TWOPHASE_LOG_LEVEL="debug", TWOPHASE_VERBOSE="1")
    assert loud["lifecycle"] == loud["sinks"] == logging.DEBUG
    assert loud["py4j"] == loud["kafka"] == logging.DEBUG


def test_a_job_says_one_line_per_checkpoint_and_transition(spark, pg_dsn, tmp_path, caplog):  # type: ignore[no-untyped-def]
    n = write_input(tmp_path / "in", files=4, rows_per_file=50)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id bigint, name text, amount float8)")
    job = Job(spark, "quiet", tmp_path / "state", checkpoint_interval=0)
    df = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1)
    job.add_pipeline(
        "load", df.json(str(tmp_path / "in")), [PostgresSink(pg_dsn, "orders")], bounded=True
    )
    caplog.set_level(logging.INFO, logger="lifecycle")
    caplog.set_level(logging.INFO, logger="sinks")
    result = job.run()
    assert sum(result.rows_committed.values()) == n
    ours = [r for r in caplog.records if r.name.startswith(("lifecycle", "sinks"))]
    messages = [r.getMessage() for r in ours]
    checkpoints = [m for m in messages if m.startswith("checkpoint ")]
    assert len(checkpoints) == result.checkpoints >= 4  # one line each
    others = [m for m in messages if not m.startswith("checkpoint ")]
    # the transitions: started, finished its logic, finished; nothing per batch
    assert len(others) == 3, others
    assert all(r.levelno == logging.INFO for r in ours), [(r.levelname, r.msg) for r in ours]


def test_a_bad_level_is_refused() -> None:
    from lifecycle import configure_logging

    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("LOUD")  # refused before anything is set
