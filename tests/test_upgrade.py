"""Upgrade: a state written by an earlier version recovers under this one.

Two earlier versions are run, each taken from git:

* the version before the Committer joined the sink protocol (commit 590dbb6):
  its ledger (format 2), its transaction names (``tp2.``, pooled Kafka ids
  ``tp3.``), its progress records and its recorded settings must all read the
  same, though every driver-side call now goes through a committer;
* the version before incarnations (below).

The version before this change (commit e43e90d) is taken from git and run as a
real driver on PostgreSQL, Kafka and Delta until a fault SIGKILLs it while a
checkpoint is decided (its ledger is one ``ledger.json`` in format 1; its
prepared transactions, transactional ids and staged files are named ``tp1.``
without an incarnation). This version then runs the same job on the same
state_dir: it converts the ledger, claims the sinks with a fresh incarnation,
finishes the old decision, and every row is in every sink exactly once, with
nothing of either version left prepared, open or staged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from lifecycle.ledger import read_ledger
from sinks.kafka.checks import check_transaction_timeout
from sinks.kafka.wire import KafkaWire
from tests import tiers
from tests.conftest import write_input
from tests.multisink import Run
from tests.pgcheck import job_prepared
from tests.procs import JobProcess, tree_at

PREVIOUS = "e43e90d"  # the last commit before incarnations
BEFORE_COMMITTER = "590dbb6"  # the last commit before the Committer in the sink protocol

pytestmark = pytest.mark.crash


def _killed_by(
    commit: str, point: str, pg_dsn: str, kafka_bootstrap: str, topic: str, tmp_path: Path
) -> tuple[Run, int]:
    """The three-sink job of the project's tree at ``commit`` (from git),
    SIGKILLed at ``point`` with a checkpoint decided and not committed; the
    run to start this version on the same state, and the rows to expect."""
    old_tree = tree_at(commit, tmp_path / commit)
    n = write_input(tmp_path / "in", files=4, rows_per_file=100)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(
            "CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8, part bigint)"
        )
    run = Run(tmp_path, pg_dsn, kafka_bootstrap, topic)
    with KafkaWire(kafka_bootstrap) as wire:
        # a new broker creates and loads __transaction_state at its first
        # transaction, and e43e90d's preflight did not wait for it (it failed when
        # it came first in a run): this version's preflight probe, which waits
        check_transaction_timeout(wire, "warm-up", 60_000, "twophase-preflight.kafka")
    args = [
        *("--dsn", pg_dsn, "--bootstrap", kafka_bootstrap, "--topic", str(run.topic)),
        *("--delta", str(run.delta), "--state", str(run.state), "--input", str(tmp_path / "in")),
        *("--job", run.job, "--interval", "2", "--files-per-batch", "1"),
    ]
    old = JobProcess("multi_sink_job.py", args, tmp_path / "old.log", point, root=old_tree)
    old.wait(240)
    assert old.killed(), old.tail()
    return run, n


@pytest.mark.parametrize(
    "point",
    # the slow tier: the default run upgrades from the newer version below
    tiers.params(["driver.before_commit=kill", "driver.mid_commit=kill"], keep=[]),
)
def test_a_crashed_state_of_the_previous_version_recovers(
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_topic: Callable[[int], str],
    tmp_path: Path,
    point: str,
) -> None:
    run, n = _killed_by(PREVIOUS, point, pg_dsn, kafka_bootstrap, kafka_topic(3), tmp_path)
    before = (run.state / "ledger" / "ledger.json").read_text()
    assert '"format": 1' in before and '"decided": {' in before, before[:500]
    if point == "driver.before_commit=kill":
        # mid_commit stops inside whichever sink commits first, which may be
        # PostgreSQL: only before_commit leaves its transactions prepared for sure
        assert any(g.startswith("tp1.") for g in job_prepared(pg_dsn, run.job))

    # this version on the same state_dir
    new = run.start()
    assert new.proc.returncode == 0, new.tail()
    run.check(n, per_checkpoint=False)
    doc = read_ledger(run.state)
    assert doc is not None and doc["incarnation"]
    assert (run.state / "ledger" / "ledger.json.v1").exists()


# Both in the slow tier since the stop after the committer landed (CI's budget;
# a change of the ledger's or the names' format brings one back to the default).
@pytest.mark.parametrize(
    "point", tiers.params(["driver.before_commit=kill", "driver.mid_commit=kill"], keep=[])
)
def test_a_crashed_state_of_the_version_before_the_committer_recovers(
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_topic: Callable[[int], str],
    tmp_path: Path,
    point: str,
) -> None:
    topic = kafka_topic(3)
    run, n = _killed_by(BEFORE_COMMITTER, point, pg_dsn, kafka_bootstrap, topic, tmp_path)
    before = read_ledger(run.state)
    assert before is not None and before["incarnation"] and before["decided"], before
    incarnation = before["incarnation"]
    if point == "driver.before_commit=kill":
        prepared = job_prepared(pg_dsn, run.job)
        assert prepared and all(f".i{incarnation}." in g for g in prepared), prepared

    # this version on the same state_dir: the same incarnation finishes the decision
    new = run.start()
    assert new.proc.returncode == 0, new.tail()
    run.check(n, per_checkpoint=False)
    after = read_ledger(run.state)
    assert after is not None and after["incarnation"] == incarnation
    assert after["sinks"] == before["sinks"]  # the recorded settings read the same
