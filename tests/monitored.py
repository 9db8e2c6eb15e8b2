"""A running job scraped by a real Prometheus that evaluates the shipped rules
(``integration/prometheus/twophase-rules.yml``), and a stall to hold its
checkpoint back: shared by ``tests/test_prometheus.py`` and
``benchmarks/stall_plot.py``.

The job streams Spark's rate source into a PostgreSQL table. :meth:`stall`
holds an exclusive lock on the sink's progress table, which every commit reads
first: the checkpoint waits on it while batches go on being written and
prepared, so the prepared work ages and the checkpoint's duration grows, as
when a target is slow or locked by an operator's DDL.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import yaml
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from lifecycle import Job
from lifecycle.testing.prometheus import Prometheus
from lifecycle.testing.services import free_port
from sinks import PostgresSink
from tests.procs import wait_for

RULES = Path(__file__).resolve().parents[1] / "integration" / "prometheus" / "twophase-rules.yml"
DASHBOARD = (
    Path(__file__).resolve().parents[1] / "integration" / "grafana" / "twophase-dashboard.json"
)


def rules_scaled_down(out: Path, threshold: str | None = None, for_s: float | None = None) -> Path:
    """The shipped rules, with the stall threshold's expression replaced by
    ``threshold`` and every alert's ``for`` by ``for_s`` seconds (a test cannot
    wait minutes); every expression otherwise as shipped."""
    doc = copy.deepcopy(yaml.safe_load(RULES.read_text()))
    for group in doc["groups"]:
        for rule in group["rules"]:
            if threshold is not None and rule.get("record") == "twophase:stall_threshold_seconds":
                rule["expr"] = threshold
            if for_s is not None and "alert" in rule:
                rule["for"] = f"{int(for_s * 1000)}ms"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


class MonitoredJob:
    """``with MonitoredJob(...) as m:`` runs the job in a thread, and a
    Prometheus scraping it every ``interval`` seconds with ``rules``; on exit
    drains the job and stops Prometheus."""

    def __init__(
        self,
        spark: SparkSession,
        dsn: str,
        workdir: Path,
        rules: Path,
        *,
        name: str = "monitored",
        interval: float = 1.0,
        rows_per_second: int = 200,
        lock_timeout: float | None = None,
    ) -> None:
        self.spark, self.dsn, self.workdir, self.name = spark, dsn, workdir, name
        self.port = free_port()
        self.prometheus = Prometheus([f"127.0.0.1:{self.port}"], [rules], interval=interval)
        self.sink = PostgresSink(dsn, "ticks", sink_id="pg", lock_timeout=lock_timeout)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("CREATE TABLE ticks (id bigint PRIMARY KEY, at timestamptz)")
        src = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", rows_per_second)
            .option("numPartitions", 1)  # one prepared transaction per batch
            .load()
            .select(F.col("value").alias("id"), F.col("timestamp").alias("at"))
        )
        self.job = Job(
            spark,
            name,
            workdir / "state",
            checkpoint_interval=interval,
            metrics_port=self.port,
            progress="off",
        )
        # a batch a second: a stall of a minute holds about 60 prepared
        # transactions, within the test server's max_prepared_transactions (64)
        self.job.add_pipeline("ticks", src, [self.sink], trigger_interval=1.0)
        self.result: Any = None
        self._runner = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.result = self.job.run(handle_signals=False)

    def __enter__(self) -> MonitoredJob:
        self.prometheus.start()
        try:
            self._runner.start()
            wait_for(
                lambda: (
                    self.value(f'twophase_checkpoints_completed_total{{job="{self.name}"}}') >= 2
                ),
                120,
                "two checkpoints seen by Prometheus",
            )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.job.stop(drain=True)
            self._runner.join(120)
        finally:
            self.job.stop(drain=False)
            self._runner.join(60)
            self.prometheus.cleanup()

    def value(self, expr: str) -> float:
        """The sum of an instant query's values (0 when it has none)."""
        return sum(float(r["value"][1]) for r in self.prometheus.query(expr))

    def alert(self, name: str) -> Mapping[str, Any] | None:
        """The alert ``name`` while it is firing, else None."""
        for a in self.prometheus.alerts():
            if a["labels"]["alertname"] == name and a["state"] == "firing":
                return dict(a)
        return None

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        """Hold the sink's progress table locked (``ACCESS EXCLUSIVE``): every
        commit waits on it until the block ends."""
        progress = f'"{self.sink.marker_schema}"."progress"'
        with psycopg.connect(self.dsn) as conn:
            conn.execute(f"LOCK TABLE {progress} IN ACCESS EXCLUSIVE MODE")
            try:
                yield
            finally:
                conn.rollback()
