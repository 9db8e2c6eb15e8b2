"""The shipped alert rules and dashboard against a real Prometheus (Debian's
2.42) scraping a running job: every rule evaluates without error on the job's
series, the series the rules read exist under those names, the stall alerts
fire while a lock holds the checkpoint back and clear when it is released, and
every dashboard query answers with series.

The rules' own logic (thresholds, ``for``, the windows) is unit-tested by
``promtool test rules`` (``tests/test_alert_rules.py``); here the stall
threshold and the ``for`` of each alert are scaled down to seconds
(:func:`tests.monitored.rules_scaled_down`), every expression otherwise as
shipped."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml

from tests.monitored import DASHBOARD, RULES, MonitoredJob, rules_scaled_down
from tests.pgcheck import assert_exactly_once, job_prepared
from tests.procs import wait_for

pytestmark = pytest.mark.usefixtures("prometheus_installed")


@pytest.fixture(scope="module")
def prometheus_installed() -> None:
    from lifecycle.testing.prometheus import binary

    binary()  # fails, naming the package, when Prometheus is missing


@pytest.fixture(scope="module")
def monitored(  # type: ignore[no-untyped-def]
    spark, pg_module_dsn, tmp_path_factory
) -> Iterator[MonitoredJob]:
    work = tmp_path_factory.mktemp("monitored")
    rules = rules_scaled_down(
        work / "rules.yml", threshold="2 * twophase_checkpoint_interval_seconds + 15", for_s=0
    )
    # lock_timeout 40 s: the PostgreSQL prepared work's limit, so its ageing
    # alert (at half) fires within a test's stall
    with MonitoredJob(spark, pg_module_dsn, work, rules, lock_timeout=40.0) as m:
        yield m


def _names_in(expr: str) -> set[str]:
    """The twophase metric names an expression reads (histograms by their family)."""
    return {re.sub(r"_bucket$", "", n) for n in re.findall(r"\btwophase_[a-z_]+", expr)}


def test_every_rule_evaluates_on_the_jobs_series(monitored: MonitoredJob) -> None:
    """Each rule of the shipped file is loaded and evaluated without error, and
    every metric it reads is one the job exports, under that name and with
    the job's name in ``job`` (honor_labels)."""
    doc = yaml.safe_load(RULES.read_text())
    wanted = {n for g in doc["groups"] for r in g["rules"] for n in _names_in(r["expr"])}

    def missing() -> set[str]:
        held = {re.sub(r"_bucket$", "", n) for n in monitored.prometheus.series_names()}
        return wanted - held

    wait_for(lambda: not missing(), 30, f"every series the rules read: {missing()}")
    for name in sorted(wanted):
        found = monitored.prometheus.query(f'{{__name__=~"{name}|{name}_bucket"}}')
        assert found, name
        assert {r["metric"].get("job") for r in found} == {monitored.name}, name
    groups = monitored.prometheus.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    shipped = sum(len(g["rules"]) for g in doc["groups"])
    assert len(rules) == shipped
    wait_for(
        lambda: all(
            r["health"] == "ok"
            for g in monitored.prometheus.api("rules")["groups"]
            for r in g["rules"]
        ),
        10,
        "every rule evaluated",
    )
    assert monitored.value("twophase:server_prepared_transactions_ratio") >= 0


def test_a_held_back_checkpoint_fires_the_stall_alerts_and_they_clear(
    monitored: MonitoredJob,
) -> None:
    """A lock on the sink's progress table holds every commit back: the work
    ages past the stall threshold (2 intervals + 15 s here) and the prepared
    transactions past half the sink's lock_timeout, and both alerts fire; once
    the lock is released the checkpoint commits and both clear."""
    wait_for(
        lambda: monitored.alert("TwophaseCheckpointStalled") is None,
        60,
        "no stall alert before the stall",
    )
    with monitored.stall():
        wait_for(
            lambda: monitored.alert("TwophaseCheckpointStalled") is not None,
            60,
            "TwophaseCheckpointStalled to fire",
        )
        fired = monitored.alert("TwophaseCheckpointStalled")
        assert fired is not None and fired["labels"]["job"] == monitored.name
        assert fired["labels"]["severity"] == "page"
        wait_for(
            lambda: monitored.alert("TwophasePreparedWorkAging") is not None,
            60,
            "TwophasePreparedWorkAging to fire",
        )
        aging = monitored.alert("TwophasePreparedWorkAging")
        assert aging is not None and aging["labels"]["sink"] == "pg"
        assert monitored.value('twophase_prepared_age_limit_seconds{sink="pg"}') == 40
        assert monitored.value('twophase_batches_pending{pipeline="ticks"}') >= 2
    wait_for(
        lambda: (
            monitored.alert("TwophaseCheckpointStalled") is None
            and monitored.alert("TwophasePreparedWorkAging") is None
        ),
        60,
        "the stall alerts to clear",
    )
    assert monitored.value("twophase_checkpoint_duration_seconds_bucket") > 0


def _dashboard_queries() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    return [
        (p["title"], t["expr"]) for p in doc["panels"] if p["type"] != "row" for t in p["targets"]
    ]


def test_every_dashboard_query_answers_with_series(monitored: MonitoredJob) -> None:
    """Each query of the Grafana dashboard (``$job`` the job, Grafana's
    ``$__rate_interval`` 30 s) runs without error and returns series."""
    empty = []
    for title, expr in _dashboard_queries():
        query = expr.replace("$job", monitored.name).replace("$__rate_interval", "30s")
        if not monitored.prometheus.query(query):
            empty.append(f"{title}: {query}")
    assert not empty, "\n".join(empty)


def test_the_dashboard_model_is_one_jobs(tmp_path: Path) -> None:
    """The JSON model: a ``job`` variable read from the job's series, every
    panel's query filtered by it, unique panel ids, a datasource variable."""
    doc = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["job"]["definition"] == "label_values(twophase_job_info, job)"
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for title, expr in _dashboard_queries():
        assert 'job="$job"' in expr, title


def test_the_job_committed_every_row_once(monitored: MonitoredJob) -> None:
    """Monitoring and the stall change nothing the sink holds: after a drain,
    every id of the rate source is in the table once (runs last)."""
    monitored.job.stop(drain=True)
    wait_for(lambda: monitored.result is not None, 120, "the job to drain")
    assert monitored.result.committed
    with psycopg.connect(monitored.dsn) as c:
        row = c.execute("SELECT count(*), max(id) FROM ticks").fetchone()
    assert row is not None and row[0] > 0
    assert_exactly_once(monitored.dsn, "ticks", row[1] + 1)  # ids 0..max, each once
    assert job_prepared(monitored.dsn, monitored.name) == []
