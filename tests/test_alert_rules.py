"""The shipped Prometheus rules (``integration/prometheus``): ``promtool`` checks
them and runs their unit tests (``scripts/test.sh`` does too), the unit tests
fail when any alert is broken, and every series the rules read is one a job
exports. A real Prometheus runs them against a running job in
``tests/test_prometheus.py``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from lifecycle.metrics import JobMetrics

HERE = Path(__file__).resolve().parents[1] / "integration" / "prometheus"
RULES = HERE / "twophase-rules.yml"
UNIT_TESTS = (HERE / "twophase-rules.test.yml", HERE / "twophase-rules.seconds.test.yml")


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: `apt-get install prometheus` (.ci/run installs it)")
    return found


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    checked = _run("check", "rules", RULES.name, cwd=HERE)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 17 rules found" in checked.stdout
    tested = _run("test", "rules", *(t.name for t in UNIT_TESTS), cwd=HERE)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    config = _run("check", "config", "prometheus.yml", cwd=HERE)  # the example, with the rules
    assert config.returncode == 0, config.stdout + config.stderr


def _alerts() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r]


@pytest.mark.parametrize("alert", _alerts())
def test_the_unit_tests_fail_when_an_alert_is_broken(alert: str, tmp_path: Path) -> None:
    """Each alert has cases that fire and cases that do not: one that always
    fires, or never does, fails the unit tests."""
    for broken in ("vector(1)", "vector(1) > 2"):
        doc = yaml.safe_load(RULES.read_text())
        for g in doc["groups"]:
            for r in g["rules"]:
                if r.get("alert") == alert:
                    r["expr"] = broken
        (tmp_path / RULES.name).write_text(yaml.safe_dump(doc, sort_keys=False))
        for t in UNIT_TESTS:
            shutil.copy(t, tmp_path / t.name)
        tested = _run("test", "rules", *(t.name for t in UNIT_TESTS), cwd=tmp_path)
        assert tested.returncode != 0, f"{alert} as {broken!r} passed the unit tests"
        assert f"alertname: {alert}" in tested.stdout + tested.stderr


def test_every_series_the_rules_read_is_one_a_job_exports() -> None:
    """Names the rules read, against a job's registry with a PostgreSQL-like sink
    (its server's prepared transactions known) and a Kafka-like one (a
    transaction timeout); ``up`` is Prometheus's own."""
    doc = yaml.safe_load(RULES.read_text())
    read = {
        re.sub(r"_bucket$", "", n)
        for g in doc["groups"]
        for r in g["rules"]
        for n in re.findall(r"\btwophase_[a-z_]+", r["expr"])
    }
    m = JobMetrics("j")
    m.began(
        "inc",
        1,
        lambda: {"p": "RUNNING"},
        ["RUNNING"],
        [("p", "pg"), ("p", "kafka")],
        {("p", "kafka"): 60.0},
        interval=5.0,
        age_limits={("p", "pg"): 120.0, ("p", "kafka"): 60.0},
        server_slots={("p", "pg"): lambda: (3, 100)},
    )
    m.checkpoint_committed("periodic", 0.1, {("p", "pg"): [{"rows": 1, "registered_at": 1.0}]}, 2)
    exported = {re.sub(r"_(bucket|count|sum)$", "", s.name) for s in m.samples()}
    assert read - exported == set()
    assert "twophase_commit_latency_seconds" in exported
