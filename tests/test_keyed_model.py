"""Keyed writes against the dictionary model, with the driver SIGKILLed.

A random change feed (inserts, updates and deletes of overlapping keys over
many batches, ``tests/changefeed.py``) goes through ``tests/jobs/changefeed_job.py``
into PostgreSQL, a Kafka changelog topic and a keyed Delta table, each sink
alone and all three in one job. ``crash_test`` SIGKILLs the job (its whole
process group) at random instants and at the protocol's dangerous points, then
runs it to completion. Afterwards every sink must equal the model (each key's
last row by batch, then ``seq``; deleted keys absent):

* PostgreSQL row for row, nothing left prepared;
* Kafka read as a compacted table from the raw log (the last committed record
  per key, tombstones deleting), nothing left open;
* Delta row for row through deltalake, through Spark's own Parquet reader of the
  snapshot's files, and through DuckDB's Delta extension; nothing left staged
  (no change file, no merge output, no marker).

The short tier runs by default; ``-m soak`` runs the long kill loops (ten
kills each, over 24 batches of 25 keys).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lifecycle.testing import crash_test, verify
from tests import deltacheck, tiers
from tests.changefeed import write_feed, write_hostile_feed
from tests.pgcheck import job_prepared

JOB = str(Path(__file__).parent / "jobs" / "changefeed_job.py")
FAULTS = ("driver.after_record", "driver.before_commit", "driver.before_record")
"""(``driver.mid_commit`` fires between two of a checkpoint's transactions: these
jobs' small batches often have one per sink)"""
DELTA_FAULTS = ("driver.merge_staged", "driver.mid_commit", *FAULTS)
"""between a merge's staging and its commit, and right after its version"""


class Model:
    """One scenario: the feed, its model, the sinks' targets and the checks."""

    def __init__(
        self,
        tmp: Path,
        sinks: str,
        seed: int,
        files: int,
        rows: int,
        keys: int,
        hostile: bool = False,
    ) -> None:
        self.tmp = tmp
        self.sinks = sinks.split(",")
        self.seed = seed
        self.hostile = hostile
        feed = write_hostile_feed if hostile else write_feed
        self.model: dict[Any, dict[str, Any]] = feed(
            tmp / "in", files=files, rows_per_file=rows, keys=keys, seed=seed
        )
        self.job = f"km{uuid.uuid4().hex[:8]}"
        self.delta = tmp / "delta"
        self.dsn: str | None = None
        self.bootstrap: str | None = None
        self.topic: str | None = None
        self.delta_features = False
        """the Delta table has features whose rewrites go through delta-spark"""

    def args(self) -> list[str]:
        a = ["--input", str(self.tmp / "in"), "--state", str(self.tmp / "state")]
        a += ["--sinks", ",".join(self.sinks), "--job", self.job, "--delta", str(self.delta)]
        if self.dsn:
            a += ["--dsn", self.dsn]
        if self.bootstrap and self.topic:
            a += ["--bootstrap", self.bootstrap, "--topic", self.topic]
        a += ["--delta-spark"] if self.delta_features else []
        return a + (["--hostile"] if self.hostile else [])

    def columns(self) -> tuple[str, ...]:
        return ("region", "id", "seq", "name", "k") if self.hostile else ("id", "seq", "name")

    def rows(self) -> dict[Any, tuple[Any, ...]]:
        """Each live key's row (the Kafka key: ``id``, or ``k`` of the hostile feed)."""
        key = "k" if self.hostile else "id"
        return {r[key]: tuple(r[c] for c in self.columns()) for r in self.model.values()}

    def delta_rows(self) -> list[tuple[Any, ...]]:
        """The model as Delta stores it: "" in the partition column is null."""
        rows = list(self.rows().values())
        if self.hostile:
            rows = [(r[0] or None, *r[1:]) for r in rows]
        return sorted(rows, key=deltacheck.row_order)

    def check(self, spark: Any) -> None:
        want = self.rows()
        if "pg" in self.sinks:
            assert self.dsn is not None
            with psycopg.connect(self.dsn) as c:
                got = c.execute(f"SELECT {', '.join(self.columns())} FROM model").fetchall()
            assert sorted(got, key=deltacheck.row_order) == sorted(
                want.values(), key=deltacheck.row_order
            )
            assert job_prepared(self.dsn, self.job) == []
        if "kafka" in self.sinks:
            assert self.bootstrap is not None and self.topic is not None
            log = verify.assert_nothing_left_kafka(self.bootstrap, self.topic, self.job)
            table: dict[Any, bytes | None] = {}
            for r in sorted(log.committed, key=lambda r: (r.partition, r.offset)):
                assert r.key is not None
                table[r.key.decode() if self.hostile else int(r.key)] = r.value
            got_k = {
                k: tuple(v[c] for c in self.columns())
                for k, raw in table.items()
                if raw is not None
                for v in [json.loads(raw)]
            }
            assert got_k == want
        if "delta" in self.sinks:
            expected = self.delta_rows()
            assert deltacheck.delta_spark_rows(spark, self.delta) == expected
            if self.delta_features:  # deletion vectors: delta-spark's readers only
                replayed = deltacheck.assert_change_feed_replays_to_the_table(spark, self.delta)
                assert len(replayed) == len(expected)
            else:
                assert deltacheck.delta_rows(self.delta) == expected
                assert deltacheck.spark_rows(spark, self.delta) == expected
                assert deltacheck.duckdb_rows(self.delta) == expected
            verify.assert_nothing_left_delta(self.delta)


def _scenario(
    tmp_path: Path,
    sinks: str,
    *,
    seed: int,
    files: int = 12,
    rows: int = 40,
    keys: int = 15,
    pg_dsn: str | None = None,
    kafka_topic: Callable[..., str] | None = None,
    kafka_bootstrap: str | None = None,
    hostile: bool = False,
) -> Model:
    m = Model(tmp_path, sinks, seed, files, rows, keys, hostile)
    if "pg" in m.sinks:
        assert pg_dsn is not None
        m.dsn = pg_dsn
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(
                "CREATE TABLE model (region text, id bigint, seq bigint, name text, k text, "
                "PRIMARY KEY (region, id))"
                if hostile
                else "CREATE TABLE model (id bigint PRIMARY KEY, seq bigint, name text)"
            )
    if "kafka" in m.sinks:
        assert kafka_topic is not None
        m.bootstrap, m.topic = kafka_bootstrap, kafka_topic(3)
    return m


def _crash(m: Model, spark: Any, kills: int, max_delay: float = 16.0) -> None:
    report = crash_test(
        JOB,
        kills=kills,
        seed=m.seed,
        args=m.args(),
        fault_points=DELTA_FAULTS if "delta" in m.sinks else FAULTS,
        min_delay=4.0,
        max_delay=max_delay,
        timeout=600.0,
        verify=lambda: m.check(spark),
        log=m.tmp / "crash.log",
    )
    print(report)
    assert report.kills >= 1, f"the job was never killed:\n{report}"


# -- the short tier (default) ---------------------------------------------------------------

pytestmark = pytest.mark.crash


@tiers.SLOW
def test_postgres_equals_the_model_after_kills(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    m = _scenario(tmp_path, "pg", seed=101, pg_dsn=pg_dsn)
    _crash(m, spark, kills=2)


@tiers.SLOW
def test_kafka_equals_the_model_after_kills(spark, kafka_bootstrap, kafka_topic, tmp_path):  # type: ignore[no-untyped-def]
    m = _scenario(
        tmp_path, "kafka", seed=102, kafka_topic=kafka_topic, kafka_bootstrap=kafka_bootstrap
    )
    _crash(m, spark, kills=2)


@tiers.SLOW
def test_delta_equals_the_model_after_kills(spark, tmp_path):  # type: ignore[no-untyped-def]
    m = _scenario(tmp_path, "delta", seed=103)
    _crash(m, spark, kills=4)  # named kills: a merge's staged files, then right after its commit


@tiers.SLOW
def test_a_delta_table_with_features_equals_the_model_after_kills(spark, tmp_path):  # type: ignore[no-untyped-def]
    """The table delta-spark made with deletion vectors, the change data feed
    and row tracking, its merges read, removed and written through
    delta-spark's transaction: after kills (one between a merge's write and
    its commit) delta-spark reads the model, and its change feed, replayed
    from the first version, gives the table (no change missed or twice)."""
    from lifecycle.testing import jars

    jars.require("delta")
    m = _scenario(tmp_path, "delta", seed=106)
    m.delta_features = True
    spark.sql(
        f"CREATE TABLE delta.`{m.delta}` (id BIGINT, seq BIGINT, name STRING) USING delta "
        "TBLPROPERTIES (delta.enableDeletionVectors = true, delta.enableChangeDataFeed = true, "
        "delta.enableRowTracking = true)"
    )
    spark.sql(f"INSERT INTO delta.`{m.delta}` VALUES (-1, 0, 'kept')")  # not a key of the feed
    m.model[-1] = {"id": -1, "seq": 0, "name": "kept"}
    _crash(m, spark, kills=4)


def test_all_three_equal_the_model_after_kills(  # type: ignore[no-untyped-def]
    spark, pg_dsn, kafka_bootstrap, kafka_topic, tmp_path
):
    m = _scenario(
        tmp_path,
        "pg,kafka,delta",
        seed=104,
        pg_dsn=pg_dsn,
        kafka_topic=kafka_topic,
        kafka_bootstrap=kafka_bootstrap,
    )
    _crash(m, spark, kills=4)


@tiers.SLOW
def test_hostile_keys_equal_the_model_after_kills(  # type: ignore[no-untyped-def]
    spark, pg_dsn, kafka_bootstrap, kafka_topic, tmp_path
):
    """Keys of (region, id) whose region is often "" (Delta's partition column,
    where "" is stored as null), names often null or "": every sink equals the
    model (PostgreSQL keeps "", Delta and its readers give null, the Kafka
    changelog is keyed by the text "region/id"), delta-spark included."""
    m = _scenario(
        tmp_path,
        "pg,kafka,delta",
        seed=105,
        keys=6,
        pg_dsn=pg_dsn,
        kafka_topic=kafka_topic,
        kafka_bootstrap=kafka_bootstrap,
        hostile=True,
    )
    _crash(m, spark, kills=3)


# -- the long tier (-m soak) ----------------------------------------------------------------


@pytest.mark.soak
@pytest.mark.parametrize("sinks", ["pg", "kafka", "delta", "pg,kafka,delta"])
def test_long_kill_loops_equal_the_model(  # type: ignore[no-untyped-def]
    spark, pg_dsn, kafka_bootstrap, kafka_topic, tmp_path, sinks
):
    seed = int(uuid.uuid4().int % 100_000)
    m = _scenario(
        tmp_path,
        sinks,
        seed=seed,
        files=24,
        rows=60,
        keys=25,
        pg_dsn=pg_dsn,
        kafka_topic=kafka_topic,
        kafka_bootstrap=kafka_bootstrap,
    )
    _crash(m, spark, kills=10, max_delay=12.0)
