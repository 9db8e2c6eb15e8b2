"""delta-spark jobs on a table while the sink writes it.

Each delta-spark operation runs at the worst moment for the sink: a keyed
sink's merge has planned and staged its rewrite on one version, and delta-spark
commits the next (``driver.merge_staged``), or compacts and vacuums the files
the merge planned to read (``driver.merge_planned``); an append's checkpoint is
about to commit (``driver.before_commit``). Whatever delta-spark commits comes
first, so the table must end as the model says when delta-spark's change is
applied before the sink's batch: no update of delta-spark lost, no row it
deleted back, every row of the sink once. delta-spark (``versionAsOf``, the
history) and deltalake read every version alike.

The threaded soak (slow tier) runs delta-spark's DML, OPTIMIZE and VACUUM in a
loop beside a keyed job, where either side may commit first.
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from lifecycle import Job
from lifecycle.testing import jars, verify
from sinks import DeltaSink, _faults
from sinks.delta import progress
from tests import deltacheck
from tests.tiers import SLOW, params

Model = dict[int, dict[str, int]]

SCHEMA = "id long, v long, w long"


@pytest.fixture
def dspark(spark):  # type: ignore[no-untyped-def]
    """The session, with delta-spark, without code generation (its DML on small
    tables compiles more than it runs) and with VACUUM's retention check off."""
    jars.require("delta")
    keys = {
        "spark.sql.codegen.factoryMode": "NO_CODEGEN",
        "spark.databricks.delta.retentionDurationCheck.enabled": "false",
    }
    before = {k: spark.conf.get(k, None) for k in keys}
    for k, v in keys.items():
        spark.conf.set(k, v)
    yield spark
    for k, v in before.items():
        if v is None:
            spark.conf.unset(k)
        else:
            spark.conf.set(k, v)


def _sql(spark, uri: Path, statement: str) -> None:  # type: ignore[no-untyped-def]
    spark.sql(statement.format(t=f"delta.`{uri}`")).collect()


def _table_rows(uri: Path) -> Model:
    rows = DeltaTable(str(uri)).to_pyarrow_table().to_pylist()
    got = {r["id"]: {"v": r["v"], "w": r["w"]} for r in rows}
    assert len(got) == len(rows), "a key is in the table more than once"
    return got


def _made_by_delta_spark(spark, uri: Path, n: int, files: int, props: str = "") -> Model:  # type: ignore[no-untyped-def]
    model = {i: {"v": 0, "w": 0} for i in range(n)}
    rows = [(i, 0, 0) for i in range(n)]
    if props:
        spark.sql(
            f"CREATE TABLE delta.`{uri}` (id BIGINT, v BIGINT, w BIGINT) USING delta "
            f"TBLPROPERTIES ({props})"
        )
    df = spark.createDataFrame(rows, SCHEMA).repartition(files)
    df.write.format("delta").mode("append").save(str(uri))
    return model


def _spark_rows(spark, uri: Path) -> Model:  # type: ignore[no-untyped-def]
    rows = spark.read.format("delta").load(str(uri)).collect()
    got = {r["id"]: {"v": r["v"], "w": r["w"]} for r in rows}
    assert len(got) == len(rows), "a key is in the table more than once"
    return got


FEATURES = (
    "delta.enableDeletionVectors = true, delta.enableChangeDataFeed = true, "
    "delta.enableRowTracking = true"
)
"""the table of the matrix's second run: its merges read, remove and write
through delta-spark (sinks/delta/spark_rewrite.py)"""


def _run_with(spark, tmp_path: Path, sink: DeltaSink, rows: list[dict[str, int]]) -> None:  # type: ignore[no-untyped-def]
    """Run a job on ``rows``: one batch, one checkpoint."""
    n = len([p for p in os.listdir(tmp_path) if p.startswith("in")])
    src = tmp_path / f"in{n}"
    src.mkdir()
    (src / "part-0.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = spark.readStream.schema(SCHEMA).json(str(src))
    job = Job(spark, f"concurrent{n}", tmp_path / f"state{n}", checkpoint_interval=0)
    job.add_pipeline("p", df, [sink], bounded=True)
    job.run()


class _Op:
    """delta-spark statements (a callable step runs as it is) and what they do
    to the model."""

    def __init__(
        self, name: str, sql: list[str | Callable[[Any, Path], Any]], apply: Callable[[Model], None]
    ) -> None:
        self.name, self.sql, self.apply = name, sql, apply

    def at(self, point: str, spark: Any, uri: Path, ran: list[tuple[_Op, int]]) -> None:
        """Run the statements the next time ``point`` is hit, then record in
        ``ran`` the table version they ended on."""

        def run() -> None:
            for s in self.sql:
                s(spark, uri) if callable(s) else _sql(spark, uri, s)
            ran.append((self, DeltaTable(str(uri)).version()))

        _faults.register(point, run)


def _add(model: Model, ids: list[int], v: int = 0, w: int = 0) -> None:
    for i in ids:
        model[i] = {"v": v, "w": w}


def _bump(model: Model, ids: list[int], by: int) -> None:
    for i in ids:
        if i in model:
            model[i]["w"] += by


def _drop(model: Model, ids: list[int]) -> None:
    for i in ids:
        model.pop(i, None)


def _ops() -> list[_Op]:
    """One delta-spark operation per sink batch. Each touches odd keys (which
    the sink never writes) in files the sink's merge rewrites, and some touch
    the batch's own keys too (the sink's row, committed later, wins)."""
    return [
        _Op(
            "merge",
            [
                "MERGE INTO {t} t USING (SELECT * FROM VALUES (3, 0, 5), (4, 0, 5), (901, 1, 1) "
                "AS s(id, v, w)) s ON t.id = s.id WHEN MATCHED THEN UPDATE SET t.w = t.w + s.w "
                "WHEN NOT MATCHED THEN INSERT *"
            ],
            lambda m: (_bump(m, [3, 4], 5), _add(m, [901], 1, 1)),
        ),
        _Op(
            "update",
            ["UPDATE {t} SET w = w + 10 WHERE id % 8 = 1 OR id = 10"],
            lambda m: _bump(m, [i for i in list(m) if i % 8 == 1 or i == 10], 10),
        ),
        _Op(
            "delete",
            ["DELETE FROM {t} WHERE id IN (7, 11, 12)"],
            lambda m: _drop(m, [7, 11, 12]),
        ),
        _Op(
            "append",
            # new keys only: an INSERT of a key the table holds makes it twice, whoever else writes
            ["INSERT INTO {t} VALUES (902, 2, 2), (903, 2, 2)"],
            lambda m: _add(m, [902, 903], 2, 2),
        ),
        _Op(
            "insert-merge",
            # adds keys the sink's batch upserts too, removing no file the sink's merge
            # read: only the whole table read makes that a conflict (the sink's row wins)
            [
                "MERGE INTO {t} t USING (SELECT id, 7L AS v, 7L AS w FROM range(500, 510)) s "
                "ON t.id = s.id WHEN NOT MATCHED THEN INSERT *"
            ],
            lambda m: _add(m, [i for i in range(500, 510) if i not in m], 7, 7),
        ),
        _Op("optimize", ["OPTIMIZE {t}"], lambda m: None),
        _Op("zorder", ["OPTIMIZE {t} ZORDER BY (w)"], lambda m: None),
        _Op(
            "update-then-vacuum",
            [
                "UPDATE {t} SET w = w + 100 WHERE id = 13",
                # every version so far, before VACUUM deletes the files they read
                deltacheck.assert_delta_spark_reads_every_version,
                "VACUUM {t} RETAIN 0 HOURS",
            ],
            lambda m: _bump(m, [13], 100),
        ),
    ]


def _sink_batches(n: int) -> list[list[dict[str, int]]]:
    """Batch b upserts the even keys 2b..2b+6 and adds key 500+b."""
    out = []
    for b in range(n):
        rows = [{"id": 2 * b + 2 * k, "v": b + 1, "w": 0} for k in range(4)]
        rows.append({"id": 500 + b, "v": b + 1, "w": 0})
        out.append(rows)
    return out


def _apply_batch(model: Model, rows: list[dict[str, int]]) -> None:
    for r in rows:
        model[r["id"]] = {"v": r["v"], "w": r["w"]}


def _model_by_history(
    uri: Path, model: Model, ran: list[tuple[_Op, int]], batches: list[list[dict[str, int]]]
) -> Model:
    """The model after the operations and the sink's batches in the order the
    table's versions hold them: an operation at the version it ended on, each
    batch (one job each) at its merge's version."""
    history = DeltaTable(str(uri)).history()
    events: list[tuple[int, Callable[[Model], None]]] = [(v, op.apply) for op, v in ran]
    merges = sorted(
        h["version"] for h in history if progress.parse_user_metadata(h.get("userMetadata"))
    )
    assert len(merges) == len(batches), f"{len(merges)} merge versions for {len(batches)} batches"
    for v, rows in zip(merges, batches, strict=True):
        events.append((v, lambda m, rows=rows: _apply_batch(m, rows)))
    for _, apply in sorted(events, key=lambda e: e[0]):
        apply(model)
    return model


_CORE = ("merge", "delete", "zorder", "update-then-vacuum")
"""the operations of the default run; the rest (update, append, plain OPTIMIZE)
are in the slow tier"""


_FEATURED = ("merge", "insert-merge", "delete", "zorder", "update")
"""the operations of the run on a table with deletion vectors, the change feed
and row tracking (no VACUUM: the change feed is checked from the start)"""


# "features" (delta-spark's own transaction commits the merge) is the slow tier's:
# its conflicts are delta-spark's to detect; the default run keeps "core"
@pytest.mark.parametrize("subset", params(["core", "rest", "features"], keep=["core"]))
def test_delta_spark_commits_between_a_keyed_merge_s_plan_and_its_commit(dspark, tmp_path, subset):  # type: ignore[no-untyped-def]
    """At each checkpoint's merge, after it staged its rewrite on version N, a
    delta-spark MERGE, DELETE, OPTIMIZE ZORDER BY and UPDATE + VACUUM RETAIN 0
    HOURS (slow tier: UPDATE, INSERT, OPTIMIZE) commits N+1 (VACUUM also
    deletes every file no longer in the snapshot, the merge's staged rewrite
    among them).
    Committed on its stale plan, the merge would undo the update, bring the
    deleted rows back or add compacted rows twice; it plans again instead.
    ``features``: the same on a table with deletion vectors, the change feed
    and row tracking, where the merge commits through delta-spark's
    transaction (delta-spark's DML leaves deletion vectors): delta-spark's
    conflict makes it plan again, and the change feed replayed from the
    table's start gives the table (no change missed or seen twice)."""
    uri = tmp_path / "t"
    featured = subset == "features"
    model = _made_by_delta_spark(dspark, uri, 24, files=4, props=FEATURES if featured else "")
    if featured:
        ops = [op for op in _ops() if op.name in _FEATURED]
    else:
        ops = [op for op in _ops() if (op.name in _CORE) == (subset == "core")]
    batches = _sink_batches(len(ops))
    ran: list[tuple[_Op, int]] = []
    sink = DeltaSink(uri, key=["id"])
    for op, rows in zip(ops, batches, strict=True):  # one batch, one checkpoint a run
        op.at("driver.merge_staged", dspark, uri, ran)
        try:
            _run_with(dspark, tmp_path, sink, rows)
        finally:
            _faults.clear()
    assert [op.name for op, _ in ran] == [op.name for op in ops]
    model = _model_by_history(uri, model, ran, batches)
    assert _spark_rows(dspark, uri) == model
    if featured:  # deltalake reads no deletion vectors
        deltacheck.assert_change_feed_replays_to_the_table(dspark, uri)
        ids = dspark.read.format("delta").load(str(uri)).select("_metadata.row_id").collect()
        assert len({r[0] for r in ids}) == len(ids)
    else:
        assert _table_rows(uri) == model
        deltacheck.assert_delta_spark_reads_every_version(dspark, uri, since=_last_vacuum(uri))
    verify.assert_nothing_left_delta(uri)


def test_files_a_merge_planned_to_read_are_compacted_and_vacuumed_away(dspark, tmp_path):  # type: ignore[no-untyped-def]
    """Between a keyed merge's plan and its rewrite, delta-spark compacts the
    table (OPTIMIZE) and VACUUM RETAIN 0 HOURS deletes the files the merge
    planned to read. The rewrite cannot read them: the merge plans again on
    the compacted version, and the job goes on."""
    uri = tmp_path / "t"
    model = _made_by_delta_spark(dspark, uri, 24, files=4)
    rows = _sink_batches(1)[0]
    ran: list[tuple[_Op, int]] = []
    op = _Op("optimize-vacuum", ["OPTIMIZE {t}", "VACUUM {t} RETAIN 0 HOURS"], lambda m: None)

    op.at("driver.merge_planned", dspark, uri, ran)
    try:
        _run_with(dspark, tmp_path, DeltaSink(uri, key=["id"]), rows)
    finally:
        _faults.clear()
    assert ran
    assert _table_rows(uri) == _model_by_history(uri, model, ran, [rows])
    verify.assert_nothing_left_delta(uri)


def test_delta_spark_commits_while_appends_wait_for_their_checkpoint(dspark, tmp_path):  # type: ignore[no-untyped-def]
    """Appends are blind: whatever delta-spark commits while a checkpoint's
    staged files wait for their commit (an INSERT, a DELETE, a MERGE, OPTIMIZE
    with and without ZORDER BY, VACUUM with a short retention), both land, and
    the sink's staged files, younger than any retention, survive the VACUUM."""
    uri = tmp_path / "t"
    model = _made_by_delta_spark(dspark, uri, 24, files=4)
    op = _Op(
        "everything",
        [
            "INSERT INTO {t} VALUES (901, 1, 1)",
            "DELETE FROM {t} WHERE id IN (3, 4)",
            "MERGE INTO {t} t USING (SELECT * FROM VALUES (5, 0, 5), (902, 2, 2) "
            "AS s(id, v, w)) s ON t.id = s.id WHEN MATCHED THEN UPDATE SET t.w = s.w "
            "WHEN NOT MATCHED THEN INSERT *",
            "OPTIMIZE {t} ZORDER BY (id)",
            "UPDATE {t} SET w = 9 WHERE id = 6",
            "OPTIMIZE {t}",
            "VACUUM {t} RETAIN 1 HOURS",
        ],
        lambda m: (
            _add(m, [901], 1, 1),
            _drop(m, [3, 4]),
            _bump(m, [5], 5),
            _add(m, [902], 2, 2),
            _bump(m, [6], 9),
        ),
    )
    rows = [{"id": 1000 + k, "v": 1, "w": 0} for k in range(5)]
    ran: list[tuple[_Op, int]] = []

    op.at("driver.before_commit", dspark, uri, ran)
    try:
        _run_with(dspark, tmp_path, DeltaSink(uri), rows)
    finally:
        _faults.clear()
    assert ran
    model = _model_by_history(uri, model, ran, [rows])
    assert _table_rows(uri) == model
    deltacheck.assert_delta_spark_reads_every_version(dspark, uri, since=_last_vacuum(uri))
    verify.assert_nothing_left_delta(uri)


def _last_vacuum(uri: Path) -> int:
    """The last version a VACUUM logged (the versions before it may read files it deleted)."""
    history = DeltaTable(str(uri)).history()
    return max((h["version"] for h in history if "VACUUM" in h["operation"]), default=0)


@SLOW
def test_delta_spark_dml_in_a_loop_beside_a_keyed_job(dspark, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A thread runs delta-spark's UPDATE, DELETE, INSERT, MERGE and OPTIMIZE
    (with and without ZORDER BY) on the odd keys in a loop while a keyed job
    upserts the even keys, batch after batch, in the same files. Either side
    may commit first; a delta-spark statement that conflicts fails (and is not
    counted), the sink plans again. In the end every successful statement's
    effect and every batch's last row is in the table, once."""
    uri = tmp_path / "t"
    model = _made_by_delta_spark(dspark, uri, 64, files=6)
    # batches 2 s apart: delta-spark's statements (seconds each here) land between
    monkeypatch.setenv(_faults.ENV, "driver.after_record=stall:2")
    rng = random.Random(7)
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"ok": 0, "conflict": 0}

    def statements() -> tuple[list[str], Callable[[Model], None]]:
        odd = [i for i in model if i % 2 == 1 and i < 1000]
        k, fresh = rng.choice(odd), 10_000 + counts["ok"]
        return rng.choice(
            [
                ([f"UPDATE {{t}} SET w = w + 1 WHERE id = {k}"], lambda m: _bump(m, [k], 1)),
                ([f"DELETE FROM {{t}} WHERE id = {k}"], lambda m: _drop(m, [k])),
                ([f"INSERT INTO {{t}} VALUES ({fresh}, 0, 0)"], lambda m: _add(m, [fresh])),
                (
                    [
                        f"MERGE INTO {{t}} t USING (SELECT * FROM VALUES ({k}, 0, 1), "
                        f"({fresh}, 0, 1) AS s(id, v, w)) s ON t.id = s.id WHEN MATCHED THEN "
                        "UPDATE SET t.w = t.w + s.w WHEN NOT MATCHED THEN INSERT *"
                    ],
                    lambda m: (_bump(m, [k], 1), _add(m, [fresh], 0, 1)),
                ),
                (["OPTIMIZE {t}"], lambda m: None),
                (["OPTIMIZE {t} ZORDER BY (w)"], lambda m: None),
            ]
        )

    def loop() -> None:
        try:
            while not stop.is_set():
                sql, apply = statements()
                try:
                    for s in sql:
                        _sql(dspark, uri, s)
                except Exception as e:
                    if "Concurrent" not in type(e).__name__ + str(e)[:2000]:
                        raise
                    counts["conflict"] += 1
                    continue
                apply(model)
                counts["ok"] += 1
        except BaseException as e:
            errors.append(e)

    batches = [
        [{"id": 2 * rng.randrange(32), "v": b, "w": 0} for _ in range(6)] for b in range(1, 31)
    ]
    sink_model: Model = {}
    for rows in batches:
        _apply_batch(sink_model, rows)
    other = threading.Thread(target=loop, name="delta-spark-dml")
    other.start()
    try:
        src = tmp_path / "in"
        src.mkdir()
        for b, rows in enumerate(batches):
            (src / f"part-{b:03d}.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
            os.utime(src / f"part-{b:03d}.json", (1_700_000_000 + b, 1_700_000_000 + b))
        df = spark_stream(dspark, src)
        job = Job(dspark, "soak", tmp_path / "state", checkpoint_interval=0)
        job.add_pipeline("p", df, [DeltaSink(uri, key=["id"])], bounded=True)
        job.run()
    finally:
        stop.set()
        other.join()
    assert not errors, errors
    assert counts["ok"] >= 5, counts
    model.update(sink_model)
    assert _table_rows(uri) == model, counts
    verify.assert_nothing_left_delta(uri)


def spark_stream(spark, src: Path):  # type: ignore[no-untyped-def]
    """The files of ``src`` as a stream, one file a batch, in name order."""
    return spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(src))
