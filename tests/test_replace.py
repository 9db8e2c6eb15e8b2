"""Partition replaces for bounded backfills (``replace_where``), PostgreSQL and Delta.

A backfill rewrites one slice of a table (one day): what matches the predicate
goes, what the pipeline writes comes, in one step at the pipeline's final
checkpoint, nothing visible before. Re-running the finished backfill on
purpose (a start-over) gives the same table, not twice the rows; a row outside
the slice fails the backfill with nothing committed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lifecycle import Job, TaskFailedError
from lifecycle.ledger import read_ledger
from sinks import ConfigError, KafkaSink, PostgresSink, _faults
from tests import deltacheck

DAY = "day = '2026-11-01'"
SCHEMA = "day string, id long, v string"


def _sql(dsn: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        cur = c.execute(query)
        return cur.fetchall() if cur.description else []


def _backfill_input(src: Path, files: int = 3, rows: int = 10, day: str = "2026-11-01") -> None:
    src.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        part = src / f"part-{f}.json"
        part.write_text(
            "".join(
                json.dumps({"day": day, "id": f * rows + i, "v": f"new-{f}-{i}"}) + "\n"
                for i in range(rows)
            )
        )
        os.utime(part, (1_700_000_000 + f, 1_700_000_000 + f))


def _run(spark, src: Path, state: Path, sinks: list[Any], start_over_from: str | None = None):  # type: ignore[no-untyped-def]
    job = Job(spark, "backfill", state, checkpoint_interval=0, start_over_from=start_over_from)
    df = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(src))
    job.add_pipeline("day", df, sinks, bounded=True)
    return job.run()


def _pg_table(dsn: str) -> None:
    _sql(dsn, "CREATE TABLE events (day text NOT NULL, id bigint NOT NULL, v text)")
    _sql(
        dsn,
        "INSERT INTO events SELECT '2026-11-01', g, 'old' FROM generate_series(1, 5) g "
        "UNION ALL SELECT '2026-11-02', g, 'other' FROM generate_series(1, 3) g",
    )


def _pg_rows(dsn: str) -> list[tuple[Any, ...]]:
    return _sql(dsn, "SELECT day, id, v FROM events ORDER BY day, id, v")


def test_postgres_replace_commits_once_and_reruns_give_the_same_table(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    _pg_table(pg_dsn)
    _backfill_input(tmp_path / "in")
    seen: list[list[tuple[Any, ...]]] = []
    # while the backfill runs, after its second batch is recorded: the table as it was
    _faults.register("driver.after_record", lambda: seen.append(_pg_rows(pg_dsn)))
    result = _run(
        spark, tmp_path / "in", tmp_path / "s1", [PostgresSink(pg_dsn, "events", replace_where=DAY)]
    )
    assert result.committed
    assert seen and [r for r in seen[0] if r[0] == "2026-11-01"] == [
        ("2026-11-01", i, "old") for i in range(1, 6)
    ]
    after = _pg_rows(pg_dsn)
    assert [r for r in after if r[0] == "2026-11-01"] == sorted(
        ("2026-11-01", f * 10 + i, f"new-{f}-{i}") for f in range(3) for i in range(10)
    )
    assert [r for r in after if r[0] == "2026-11-02"] == [
        ("2026-11-02", i, "other") for i in (1, 2, 3)
    ]
    doc = read_ledger(tmp_path / "s1")
    assert doc is not None
    cuts = [cp["cut"] for cp in doc["history"]]
    assert [c for c in cuts if c.get("day") is not None] == [{"day": 2}]  # one commit, at the end
    assert _sql(pg_dsn, "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'replace_%'") == [(0,)]
    # the finished backfill, re-run on purpose three times: the same table
    previous = doc["incarnation"]
    for i in range(3):
        state = tmp_path / f"again{i}"
        sink = PostgresSink(pg_dsn, "events", replace_where=DAY)
        assert _run(spark, tmp_path / "in", state, [sink], start_over_from=previous).committed
        assert _pg_rows(pg_dsn) == after
        again = read_ledger(state)
        assert again is not None
        previous = again["incarnation"]


def test_a_row_outside_the_predicate_fails_the_backfill(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    _pg_table(pg_dsn)
    before = _pg_rows(pg_dsn)
    _backfill_input(tmp_path / "in", files=2)
    _backfill_input(tmp_path / "in", files=1, day="2026-11-05")  # part-0 now holds another day
    with pytest.raises(TaskFailedError, match=r"do not match replace_where"):
        _run(
            spark,
            tmp_path / "in",
            tmp_path / "s",
            [PostgresSink(pg_dsn, "events", replace_where=DAY)],
        )
    assert _pg_rows(pg_dsn) == before


def test_replace_is_for_bounded_pipelines_without_expiring_sinks(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    job = Job(spark, "bad", tmp_path / "s")
    df = spark.readStream.schema(SCHEMA).json(str(tmp_path))
    with pytest.raises(ConfigError, match="bounded=True"):
        job.add_pipeline("p", df, [PostgresSink(pg_dsn, "events", replace_where=DAY)])
    kafka = KafkaSink("127.0.0.1:1", "t")
    with pytest.raises(ConfigError, match="would hold its transactions open"):
        job.add_pipeline(
            "q", df, [PostgresSink(pg_dsn, "events", replace_where=DAY), kafka], bounded=True
        )
    with pytest.raises(ConfigError, match="neither an upsert"):
        PostgresSink(pg_dsn, "events", key=["id"], replace_where=DAY)


def test_a_replacing_pipeline_refuses_sinks_that_hold_prepared_transactions(
    spark, pg_dsn, tmp_path
):  # type: ignore[no-untyped-def]
    """A replace keeps every batch of its pipeline prepared until the pipeline
    finishes. A keyed PostgresSink beside it used to block forever on the row
    locks of its own prepared batch 0 (LockWaitError, again after a restart),
    and a plain one piles up prepared transactions past max_prepared_transactions
    on a long backfill: both are refused when the pipeline is added."""
    from sinks import DeltaSink

    job = Job(spark, "bad", tmp_path / "s")
    df = spark.readStream.schema(SCHEMA).json(str(tmp_path))
    replacing = DeltaSink(str(tmp_path / "t"), replace_where=DAY)
    for other in (
        PostgresSink(pg_dsn, "events", key=["id"], delete_when=("v", "gone"), lock_timeout=5),
        PostgresSink(pg_dsn, "events"),
    ):
        with pytest.raises(ConfigError, match=r"row locks block .* max_prepared_transactions"):
            job.add_pipeline("q", df, [replacing, other], bounded=True)
    # Two replaces in one pipeline stage their batches and hold nothing: allowed.
    job.add_pipeline(
        "r", df, [replacing, PostgresSink(pg_dsn, "events", replace_where=DAY)], bounded=True
    )


# -- Delta ------------------------------------------------------------------------------


def _delta_table(uri: Path) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    old = pa.table(
        {
            "day": ["2026-11-01"] * 5 + ["2026-11-02"] * 3,
            "id": [1, 2, 3, 4, 5, 1, 2, 3],
            "v": ["old"] * 5 + ["other"] * 3,
        }
    )
    write_deltalake(str(uri), old, partition_by=["day"])


def _delta_rows(uri: Path) -> list[tuple[Any, ...]]:
    from deltalake import DeltaTable

    rows = DeltaTable(str(uri)).to_pyarrow_table().to_pylist()
    return sorted((r["day"], r["id"], r["v"]) for r in rows)


def test_delta_and_postgres_replace_together_and_reruns_give_the_same_tables(  # type: ignore[no-untyped-def]
    spark, pg_dsn, tmp_path
):
    from lifecycle.testing import verify
    from sinks import DeltaSink

    uri = tmp_path / "delta"
    _delta_table(uri)
    _pg_table(pg_dsn)
    _backfill_input(tmp_path / "in")
    seen: list[list[tuple[Any, ...]]] = []
    _faults.register("driver.after_record", lambda: seen.append(_delta_rows(uri)))
    sinks = [DeltaSink(uri, replace_where=DAY), PostgresSink(pg_dsn, "events", replace_where=DAY)]
    assert _run(spark, tmp_path / "in", tmp_path / "s1", sinks).committed
    assert seen and seen[0] == sorted(
        [("2026-11-01", i, "old") for i in range(1, 6)]
        + [("2026-11-02", i, "other") for i in (1, 2, 3)]
    )
    want = sorted(
        [("2026-11-01", f * 10 + i, f"new-{f}-{i}") for f in range(3) for i in range(10)]
        + [("2026-11-02", i, "other") for i in (1, 2, 3)]
    )
    assert _delta_rows(uri) == want
    assert _pg_rows(pg_dsn) == want
    verify.assert_nothing_left_delta(uri)
    doc = read_ledger(tmp_path / "s1")
    assert doc is not None
    previous = doc["incarnation"]
    for i in range(3):
        state = tmp_path / f"again{i}"
        sinks = [
            DeltaSink(uri, replace_where=DAY),
            PostgresSink(pg_dsn, "events", replace_where=DAY),
        ]
        assert _run(spark, tmp_path / "in", state, sinks, start_over_from=previous).committed
        assert _delta_rows(uri) == want and _pg_rows(pg_dsn) == want
        verify.assert_nothing_left_delta(uri)
        again = read_ledger(state)
        assert again is not None
        previous = again["incarnation"]


def test_delta_replace_checks_its_predicate_and_rows(spark, tmp_path):  # type: ignore[no-untyped-def]
    from sinks import DeltaSink, PreflightError

    uri = tmp_path / "delta"
    _delta_table(uri)
    before = _delta_rows(uri)
    _backfill_input(tmp_path / "in", files=2)
    with pytest.raises(PreflightError, match="partition columns"):
        _run(spark, tmp_path / "in", tmp_path / "s0", [DeltaSink(uri, replace_where="id > 3")])
    _backfill_input(tmp_path / "in", files=1, day="2026-11-05")
    with pytest.raises(TaskFailedError, match=r"does not match replace_where"):
        _run(spark, tmp_path / "in", tmp_path / "s", [DeltaSink(uri, replace_where=DAY)])
    assert _delta_rows(uri) == before


def test_an_empty_partition_value_is_replaced_as_null(spark, tmp_path):  # type: ignore[no-untyped-def]
    """Delta stores day "" as null. ``replace_where="day = ''"`` used to accept
    the batch's "" rows but match no stored file (null = '' is null), so every
    re-run added the slice again; now such a predicate is refused before
    anything runs, a batch row "" outside another slice names the rule, and
    ``day IS NULL`` replaces the slice once, as often as it runs."""
    from sinks import DeltaSink, PreflightError

    uri = tmp_path / "delta"
    src = tmp_path / "in"
    src.mkdir()
    (src / "part-0.json").write_text(json.dumps({"day": "", "id": 1, "v": "old"}) + "\n")
    assert _run(
        spark, src, tmp_path / "s0", [DeltaSink(uri, partition_by=["day"], sink_id="a")]
    ).committed
    (src / "part-0.json").write_text(json.dumps({"day": "", "id": 1, "v": "new"}) + "\n")
    with pytest.raises(PreflightError, match=r"compares with '', .* Say IS NULL"):
        _run(spark, src, tmp_path / "s1", [DeltaSink(uri, replace_where="day = ''", sink_id="b")])
    other = DeltaSink(uri, replace_where="day = '2026-11-01'", sink_id="c")
    with pytest.raises(TaskFailedError, match=r"as null: day is null here; say `day IS NULL`"):
        _run(spark, src, tmp_path / "s1b", [other])
    assert _delta_rows(uri) == [(None, 1, "old")]
    for run in ("s2", "s3"):  # a re-run replaces the same slice again
        sink = DeltaSink(uri, replace_where="day IS NULL", sink_id=run)
        assert _run(spark, src, tmp_path / run, [sink]).committed
        assert _delta_rows(uri) == [(None, 1, "new")]
        read = spark.read.format("delta").load(str(uri)).collect()
        assert [tuple(r) for r in read] == [(None, 1, "new")]
    # every version (each replace removing the slice's files) read alike by delta-spark
    deltacheck.assert_delta_spark_reads_every_version(spark, uri)


def test_a_predicate_whose_value_changes_is_refused(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """A replace evaluates its predicate on every batch and again at the commit
    that finishes the backfill, maybe days apart: current_date() (or rand())
    could name two slices, keeping rows of one and adding the other's. Both
    sinks refuse such a predicate before writing anything."""
    import pyarrow as pa

    from sinks import DeltaSink, PreflightError

    schema = pa.schema([("day", pa.string()), ("id", pa.int64()), ("v", pa.string())])
    uri = tmp_path / "delta"
    _delta_table(uri)
    for predicate, named in (
        ("day = cast(current_date() as string)", "current_date()"),
        ("day > date_sub(current_date(), 3) and day < '2027'", "current_date()"),
        ("rand() < 0.5 and day = '2026-11-01'", "rand()"),
        ("day = cast(DATE 'today' as string)", "'today'"),  # a constant once parsed
        ("day = (SELECT cast(max(id) AS string) FROM range(3))", "a subquery"),
    ):
        with pytest.raises(PreflightError, match=re.escape(f"uses {named}, whose value changes")):
            DeltaSink(uri, replace_where=predicate).preflight(schema)
    DeltaSink(uri, replace_where="day = '2026-11-01' or day = date_add('2026-11-01', 1)").preflight(
        schema
    )
    _pg_table(pg_dsn)
    for predicate in (
        "day = current_date::text",
        "day::date > now() - interval '1 day'",
        "day::date = 'Yesterday'::date",
    ):
        with pytest.raises(PreflightError, match=r"whose value changes between evaluations"):
            PostgresSink(pg_dsn, "events", replace_where=predicate).preflight(schema)
    with pytest.raises(PreflightError, match=r"is not a predicate over the table's columns"):
        PostgresSink(pg_dsn, "events", replace_where="nope = 1").preflight(schema)
    PostgresSink(pg_dsn, "events", replace_where="day = '2026-11-01'").preflight(schema)


@pytest.mark.crash
def test_a_killed_backfill_stays_staged_and_replaces_once(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """SIGKILLed at random and while recording batches: every restart keeps what
    the earlier runs staged (PostgreSQL's staging table, Delta's staged files),
    the table is untouched until the last run's final checkpoint, which replaces
    the day in both at once; nothing is left staged."""
    from lifecycle.testing import crash_test, verify

    uri = tmp_path / "delta"
    _delta_table(uri)
    _pg_table(pg_dsn)
    _backfill_input(tmp_path / "in", files=10, rows=20)
    want = sorted(
        [("2026-11-01", f * 20 + i, f"new-{f}-{i}") for f in range(10) for i in range(20)]
        + [("2026-11-02", i, "other") for i in (1, 2, 3)]
    )

    def check() -> None:
        assert _delta_rows(uri) == want
        assert _pg_rows(pg_dsn) == want
        verify.assert_nothing_left_delta(uri)
        assert _sql(pg_dsn, "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'replace_%'") == [
            (0,)
        ]

    report = crash_test(
        str(Path(__file__).parent / "jobs" / "replace_job.py"),
        kills=3,
        seed=21,
        args=[
            "--input",
            str(tmp_path / "in"),
            "--state",
            str(tmp_path / "state"),
            "--dsn",
            pg_dsn,
            "--delta",
            str(uri),
        ],
        fault_points=("driver.before_commit", "driver.mid_commit"),
        min_delay=5.0,
        max_delay=14.0,
        verify=check,
        log=tmp_path / "crash.log",
    )
    print(report)
    assert report.kills >= 2, str(report)
