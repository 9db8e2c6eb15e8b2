"""The Delta sink against real Delta tables on local disk, without Spark.

Writers stage files for several task contexts, the driver side commits, aborts
and sweeps; every check reads the table back with deltalake. Nothing is mocked.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from lifecycle.testing.services import free_port
from sinks import _faults
from sinks.audit import CheckpointEvidence, Verdict
from sinks.base import Committable, JobScope, WriteContext
from sinks.delta import DeltaSchemaError, DeltaSink
from sinks.delta.committer import app_id
from sinks.delta.storage import STAGING_DIR, TableStorage
from sinks.errors import PreflightError, TransactionLostError
from sinks.naming import TxnName
from sinks.progress import IncarnationConflictError

UTC = dt.timezone.utc
INCARNATION = "0123456789ab"
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("name", pa.string()),
        ("amount", pa.float64()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("day", pa.date32()),
        ("kind", pa.string()),
    ]
)
KINDS = ["a", "b", "c:/d", None]


def rows(start: int, n: int) -> pa.RecordBatch:
    """Rows ``start .. start+n-1``; every column has nulls, ``kind`` has 4 values."""
    ids = list(range(start, start + n))
    return pa.record_batch(
        {
            "id": ids,
            "name": [None if i % 7 == 3 else f"name-{i}" for i in ids],
            "amount": [None if i % 5 == 1 else i * 1.5 for i in ids],
            "ts": pa.array(
                [1_700_000_000_000_000 + i * 1_001 for i in ids], pa.timestamp("us", "UTC")
            ),
            "day": pa.array([19_000 + i % 30 for i in ids], pa.date32()),
            "kind": [KINDS[i % 4] for i in ids],
        },
        schema=SCHEMA,
    )


def stage(
    sink: DeltaSink,
    scope: JobScope,
    batch_id: int,
    partition: int,
    batches: Iterable[pa.RecordBatch],
    *,
    attempt: int | None = None,
    run: int = 1,
) -> Committable | None:
    """What one Spark task does: open a writer, write, prepare, close."""
    attempt = attempt if attempt is not None else batch_id * 100 + partition
    w = sink.open_writer(WriteContext(scope, run, batch_id, partition, attempt), SCHEMA)
    ok = False
    try:
        for b in batches:
            w.write(b)
        c = w.prepare()
        ok = True
    finally:
        w.close(failed=not ok)
    return c


def ids(uri: str) -> list[int]:
    return sorted(DeltaTable(uri).to_pyarrow_table(columns=["id"]).column("id").to_pylist())


def version(uri: str) -> int:
    return DeltaTable(uri).version()


def markers(uri: str) -> list[str]:
    d = Path(uri) / STAGING_DIR
    return sorted(os.listdir(d)) if d.exists() else []


def parquet_files(uri: str) -> set[str]:
    root = Path(uri)
    return {
        str(p.relative_to(root))
        for p in root.rglob("*.parquet")
        if not str(p.relative_to(root)).startswith("_")
    }


def paths(cs: Iterable[Committable | None]) -> set[str]:
    return {a["path"] for c in cs if c for a in c["adds"]}


@pytest.fixture
def uri(tmp_path: Path) -> str:
    return str(tmp_path / "orders")


@pytest.fixture
def scope() -> JobScope:
    return JobScope("job1", "live", "orders", INCARNATION)


@pytest.fixture
def sink(uri: str) -> DeltaSink:
    s = DeltaSink(uri, partition_by=["kind"], sink_id="orders")
    s.preflight(SCHEMA)
    return s


# -- commit -----------------------------------------------------------------------


def test_commit_makes_rows_visible_once_in_one_version(
    sink: DeltaSink, scope: JobScope, uri: str
) -> None:
    assert version(uri) == 0
    cs = [
        stage(sink, scope, 4, 0, [rows(0, 50), rows(50, 50)]),
        stage(sink, scope, 4, 1, [rows(100, 30)]),
        stage(sink, scope, 5, 0, [rows(130, 20)]),
        stage(sink, scope, 5, 1, []),  # an empty partition writes nothing
    ]
    assert cs[3] is None
    cs = [c for c in cs if c]
    assert sum(c["rows"] for c in cs) == 150
    staged = paths(cs)
    assert staged == parquet_files(uri)
    for c in cs:
        for a in c["adds"]:
            assert Path(a["path"]).name.startswith(c["txn"] + "-")
            assert a["size"] == os.path.getsize(Path(uri) / a["path"])
            assert abs(a["modification_time"] / 1000 - time.time()) < 600
            assert TxnName.parse(c["txn"]) is not None
    assert len(markers(uri)) == len(staged)

    # prepared, not committed: invisible
    assert ids(uri) == []
    assert version(uri) == 0

    sink.committer().commit(cs)
    assert ids(uri) == list(range(150))
    assert version(uri) == 1
    t = DeltaTable(uri)
    assert t.transaction_version(app_id(scope)) == 5  # the highest batch id
    assert markers(uri) == []  # committed work leaves no staging bookkeeping
    assert {r["operation"] for r in t.history(1)} == {"WRITE"}

    # the same commit again (a retry, a restart): skipped
    sink.committer().commit(cs)
    assert version(uri) == 1
    assert ids(uri) == list(range(150))
    # partition values round-trip, escaped directories included
    kinds = DeltaTable(uri).to_pyarrow_table(columns=["id", "kind"]).sort_by("id")
    assert kinds.column("kind").to_pylist() == [KINDS[i % 4] for i in range(150)]
    assert any("kind=c%3A%2Fd/" in p for p in staged)
    assert any("kind=__HIVE_DEFAULT_PARTITION__/" in p for p in staged)
    # the audit finds every file of the commit, escaped partition directories included
    evidence = [sink.committer().evidence(c) for c in cs]
    found = sink.committer().audit(scope, [CheckpointEvidence(1, time.time(), evidence)])
    assert [f.verdict for f in found] == [Verdict.OK] * len(cs), found


def test_later_checkpoints_get_new_versions_and_an_older_one_is_refused(
    sink: DeltaSink, scope: JobScope, uri: str
) -> None:
    c1 = [stage(sink, scope, 1, 0, [rows(0, 10)]), stage(sink, scope, 2, 0, [rows(10, 10)])]
    sink.committer().commit(c1)
    c2 = [stage(sink, scope, 3, 0, [rows(20, 10)])]
    sink.committer().commit(c2)
    assert version(uri) == 2
    assert DeltaTable(uri).transaction_version(app_id(scope)) == 3
    assert ids(uri) == list(range(30))

    # work of batch 2 showing up after batch 3 was committed by this incarnation (a
    # replay): recognised as done, not committed again, its staged file deleted.
    stale = [stage(sink, scope, 2, 1, [rows(30, 5)], run=2)]
    sink.committer().commit(stale)
    assert version(uri) == 2
    assert ids(uri) == list(range(30))
    assert not os.path.exists(os.path.join(uri, stale[0]["adds"][0]["path"]))

    # the same batches written by another incarnation (a lost state_dir) are not
    # this incarnation's progress: they commit under their own app id only if it
    # holds the claim, else the commit refuses
    sink.committer().claim(scope)
    other = JobScope(scope.job, scope.pipeline, scope.sink_id, "ba9876543210")
    foreign = [stage(sink, other, 2, 1, [rows(30, 5)], run=1)]
    with pytest.raises(IncarnationConflictError, match="another start took the claim over"):
        sink.committer().commit(foreign)
    assert ids(uri) == list(range(30))


def test_crash_after_the_delta_commit_then_recommit_skips(
    sink: DeltaSink, scope: JobScope, uri: str
) -> None:
    cs = [stage(sink, scope, 7, p, [rows(p * 10, 10)]) for p in range(3)]

    def crash() -> None:
        raise _faults.InjectedFault("driver died after the Delta commit")

    _faults.register("driver.mid_commit", crash)
    try:
        with pytest.raises(_faults.InjectedFault):
            sink.committer().commit(cs)
    finally:
        _faults.clear()
    assert version(uri) == 1
    assert markers(uri)  # the crash came before the markers were removed
    # a restarted driver commits the decided checkpoint again
    restarted = DeltaSink(uri, partition_by=["kind"], sink_id="orders")
    restarted.committer().commit(cs)
    assert version(uri) == 1
    assert ids(uri) == list(range(30))
    assert markers(uri) == []


def test_two_sinks_committing_concurrently_both_land(uri: str) -> None:
    sinks = [DeltaSink(uri, partition_by=["kind"], sink_id=f"s{i}") for i in range(2)]
    for s in sinks:
        s.preflight(SCHEMA)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        s = sinks[i]
        sc = JobScope("job1", "live", s.sink_id, INCARNATION)
        try:
            for b in range(5):
                start = i * 1000 + b * 10
                s.committer().commit([stage(s, sc, b, 0, [rows(start, 10)])])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert ids(uri) == sorted([*range(0, 50), *range(1000, 1050)])
    assert version(uri) == 10
    t = DeltaTable(uri)
    apps = [f"tp2.job1.live.s{i}.i{INCARNATION}" for i in range(2)]
    assert [t.transaction_version(a) for a in apps] == [4, 4]


def test_large_partitions_roll_row_groups_and_files(
    sink: DeltaSink, scope: JobScope, uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sinks.delta import writer

    monkeypatch.setattr(writer, "ROW_GROUP_BYTES", 4_000)
    monkeypatch.setattr(writer, "FILE_BYTES", 20_000)
    c = stage(sink, scope, 1, 0, [rows(i * 100, 100) for i in range(30)])
    assert c is not None and c["rows"] == 3000
    per_kind: dict[str | None, int] = {}
    for a in c["adds"]:
        kind = a["partition_values"]["kind"]
        per_kind[kind] = per_kind.get(kind, 0) + 1
        meta = pq.read_metadata(Path(uri) / a["path"])
        assert meta.num_rows == json.loads(a["stats"])["numRecords"]
        assert meta.num_row_groups > 1
        assert "kind" not in meta.schema.names  # partition values live in the log only
        ts = meta.schema.column(meta.schema.names.index("ts")).logical_type
        assert "isAdjustedToUTC=true, timeUnit=microseconds" in str(ts)
    assert set(per_kind) == {"a", "b", "c:/d", None}
    assert all(n > 1 for n in per_kind.values())  # files rolled over
    sink.committer().commit([c])
    assert ids(uri) == list(range(3000))
    assert version(uri) == 1


# -- abort and close ------------------------------------------------------------------


def test_abort_deletes_staged_files_idempotently(
    sink: DeltaSink, scope: JobScope, uri: str
) -> None:
    cs = [stage(sink, scope, 1, p, [rows(p * 10, 10)]) for p in range(2)]
    assert parquet_files(uri) == paths(cs)
    sink.committer().abort(cs)
    assert parquet_files(uri) == set()
    assert markers(uri) == []
    sink.committer().abort(cs)  # again: nothing left, no error
    assert version(uri) == 0
    assert ids(uri) == []


def test_abort_never_deletes_committed_files(sink: DeltaSink, scope: JobScope, uri: str) -> None:
    cs = [stage(sink, scope, 1, 0, [rows(0, 10)])]
    sink.committer().commit(cs)
    sink.committer().abort(cs)  # a confused caller: the committed files stay
    assert ids(uri) == list(range(10))


def test_failed_task_cleans_up_its_files(sink: DeltaSink, scope: JobScope, uri: str) -> None:
    # fails after prepare: its committable never reaches the driver
    w = sink.open_writer(WriteContext(scope, 1, 1, 0, 11), SCHEMA)
    w.write(rows(0, 20))
    assert w.prepare() is not None
    assert parquet_files(uri)
    w.close(failed=True)
    assert parquet_files(uri) == set()
    assert markers(uri) == []
    # fails while writing (before prepare)
    w = sink.open_writer(WriteContext(scope, 1, 1, 0, 12), SCHEMA)
    w.write(rows(0, 20))
    w.close(failed=True)
    assert parquet_files(uri) == set()
    assert markers(uri) == []


def test_not_null_and_lossy_casts_are_refused_while_writing(uri: str, scope: JobScope) -> None:
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("ts", pa.timestamp("us"))])
    s = DeltaSink(uri, sink_id="orders")
    s.preflight(schema)
    w = s.open_writer(WriteContext(scope, 1, 1, 0, 1), schema)
    with pytest.raises(DeltaSchemaError, match="'id' is NOT NULL"):
        w.write(
            pa.record_batch({"id": [1, None], "ts": pa.array([None, None], pa.timestamp("us"))})
        )
    ns = pa.schema([pa.field("id", pa.int64(), nullable=False), ("ts", pa.timestamp("ns"))])
    with pytest.raises(DeltaSchemaError, match="'ts'"):
        w.write(pa.record_batch({"id": [1], "ts": pa.array([1_500], pa.timestamp("ns"))}, ns))
    w.write(pa.record_batch({"id": [2], "ts": pa.array([2_000], pa.timestamp("ns"))}, ns))
    c = w.prepare()
    w.close()
    s.committer().commit([c])
    t = DeltaTable(uri)
    assert t.protocol().min_reader_version == 3 and "timestampNtz" in t.protocol().writer_features
    assert t.to_pyarrow_table().to_pylist() == [
        {"id": 2, "ts": dt.datetime(1970, 1, 1, 0, 0, 0, 2)}
    ]
    meta = pq.ParquetFile(Path(uri) / c["adds"][0]["path"]).metadata
    assert "isAdjustedToUTC=false, timeUnit=microseconds" in str(meta.schema.column(1).logical_type)


def test_an_empty_string_in_a_not_null_partition_column_is_refused(
    uri: str, scope: JobScope
) -> None:
    """ "" in a partition column is stored as null; under NOT NULL the pyarrow
    route refuses it as Spark's route and the keyed writer do (it used to pass
    the check and be stored as null)."""
    schema = pa.schema([pa.field("region", pa.string(), nullable=False), ("id", pa.int64())])
    write_deltalake(uri, schema.empty_table(), partition_by=["region"])
    s = DeltaSink(uri, sink_id="orders", write_with="arrow")
    s.preflight(schema)
    w = s.open_writer(WriteContext(scope, 1, 1, 0, 1), schema)
    with pytest.raises(DeltaSchemaError, match=r"'region' is NOT NULL .* empty string"):
        w.write(pa.record_batch({"region": ["eu", ""], "id": [1, 2]}, schema))
    w.close(failed=True)


# -- sweeping lingering work ------------------------------------------------------------


def test_the_sweep_deletes_orphans_never_committed_files(
    sink: DeltaSink, scope: JobScope, uri: str
) -> None:
    committed = [stage(sink, scope, 1, 0, [rows(0, 10)], attempt=10)]
    sink.committer().commit(committed)
    # an earlier attempt of the same partition that died after writing (no close)
    w = sink.open_writer(WriteContext(scope, 1, 1, 0, 9), SCHEMA)
    w.write(rows(1000, 10))
    dead = f"tp2.job1.live.orders.i{INCARNATION}.r1.b1.p0.a9"
    # a prepared task of batch 2 the ledger owns, and one of batch 3 still running
    owned = stage(sink, scope, 2, 0, [rows(10, 10)])
    running = stage(sink, scope, 3, 0, [rows(20, 10)])
    # another sink's orphan in the same table is not this scope's business
    other = DeltaSink(uri, partition_by=["kind"], sink_id="other")
    other.preflight(SCHEMA)
    foreign = stage(other, JobScope("job1", "live", "other", INCARNATION), 1, 0, [rows(5000, 5)])

    seen: list[TxnName] = []

    def is_orphan(n: TxnName) -> bool:  # the coordinator's rule after a cut at batch 2
        seen.append(n)
        return str(n) != owned["txn"] and n.batch_id <= 2

    swept = sink.committer().sweep(scope, is_orphan)
    assert swept == [dead]
    assert committed[0]["txn"] not in {str(n) for n in seen}  # committed: no marker left
    left = parquet_files(uri)
    assert paths(committed) <= left  # committed files are never deleted
    assert paths([owned, running, foreign]) <= left
    assert not any(p.rsplit("/", 1)[-1].startswith(dead) for p in left)
    assert ids(uri) == list(range(10))

    # even when told that everything is an orphan, committed files stay
    sink.committer().commit([owned])
    m = Path(uri) / STAGING_DIR / (Path(owned["adds"][0]["path"]).name.split(".snappy")[0])
    m.write_text(owned["adds"][0]["path"])  # a marker left behind by a crash
    swept = sink.committer().sweep(scope, lambda n: True)
    assert swept == [running["txn"]]
    assert paths([owned]) <= parquet_files(uri)
    assert not paths([running]) & parquet_files(uri)
    assert ids(uri) == list(range(20))
    assert markers(uri) == sorted(Path(a["path"]).name.split(".snappy")[0] for a in foreign["adds"])
    assert sink.committer().sweep(scope, lambda n: True) == []


def test_a_damaged_marker_deletes_nothing_else(sink: DeltaSink, scope: JobScope, uri: str) -> None:
    sink.committer().commit([stage(sink, scope, 1, 0, [rows(0, 10)])])
    victim = next(iter(parquet_files(uri)))
    d = Path(uri) / STAGING_DIR
    (d / "tp1.job1.live.orders.r1.b9.p0.a1-00000").write_text(victim)
    (d / "tp1.job1.live.orders.r1.b9.p0.a2-00000").write_text("")
    (d / "tp1.job1.live.orders.r1.b9.p0.a3-00000").write_text("../../elsewhere")
    assert sink.committer().sweep(scope, lambda n: True) == [
        "tp1.job1.live.orders.r1.b9.p0.a2",
        "tp1.job1.live.orders.r1.b9.p0.a3",
    ]
    assert victim in parquet_files(uri)
    assert markers(uri) == []


# -- validation -------------------------------------------------------------------------


def test_missing_staged_file_is_a_lost_transaction(
    sink: DeltaSink, scope: JobScope, uri: str
) -> None:
    cs = [stage(sink, scope, 1, p, [rows(p * 10, 10)]) for p in range(2)]
    os.remove(Path(uri) / cs[1]["adds"][0]["path"])
    with pytest.raises(TransactionLostError, match=cs[1]["adds"][0]["path"].replace("%", ".")):
        sink.committer().commit(cs)
    assert version(uri) == 0 and ids(uri) == []


def test_missing_files_are_fine_once_committed(sink: DeltaSink, scope: JobScope, uri: str) -> None:
    cs = [stage(sink, scope, 1, 0, [rows(0, 10)])]
    sink.committer().commit(cs)
    # e.g. compacted by OPTIMIZE and vacuumed: the retry must still skip
    for p in paths(cs):
        os.remove(Path(uri) / p)
    sink.committer().commit(cs)
    assert version(uri) == 1


def test_preflight_refuses_mismatched_schema_and_partitioning(sink: DeltaSink, uri: str) -> None:
    before = version(uri)
    wrong_type = SCHEMA.set(0, pa.field("id", pa.string()))
    with pytest.raises(PreflightError, match="column 'id' is string in the DataFrame but long"):
        DeltaSink(uri, sink_id="x").preflight(wrong_type)
    with pytest.raises(PreflightError, match=r"missing from the DataFrame: \['amount'\]"):
        DeltaSink(uri, sink_id="x").preflight(SCHEMA.remove(2))
    with pytest.raises(PreflightError, match="'ID' vs the table's 'id'"):
        DeltaSink(uri, sink_id="x").preflight(SCHEMA.set(0, pa.field("ID", pa.int64())))
    with pytest.raises(PreflightError, match=r"partitioned by \['kind'\].*partition_by=\['day'\]"):
        DeltaSink(uri, partition_by=["day"], sink_id="x").preflight(SCHEMA)
    with pytest.raises(PreflightError, match="partitioned by"):
        DeltaSink(uri, partition_by=[], sink_id="x").preflight(SCHEMA)
    assert version(uri) == before
    # compatible: other column order, a narrower integer, a time zone that is not UTC
    ok = pa.schema(
        [
            ("kind", pa.large_string()),
            ("id", pa.int32()),
            ("name", pa.string()),
            ("amount", pa.float64()),
            ("ts", pa.timestamp("ms", tz="Europe/Paris")),
            ("day", pa.date32()),
        ]
    )
    s = DeltaSink(uri, sink_id="x")
    s.preflight(ok)
    w = s.open_writer(WriteContext(JobScope("j", "p", "x"), 1, 1, 0, 1), ok)
    w.write(
        pa.record_batch(
            {
                "kind": ["a"],
                "id": [7],
                "name": ["n"],
                "amount": [1.0],
                "ts": pa.array([1_000], pa.timestamp("ms", tz="Europe/Paris")),
                "day": pa.array([1], pa.date32()),
            },
            schema=ok,
        )
    )
    s.committer().commit([w.prepare()])
    got = DeltaTable(uri).to_pyarrow_table().to_pylist()
    assert got == [
        {
            "id": 7,
            "name": "n",
            "amount": 1.0,
            "ts": dt.datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC),
            "day": dt.date(1970, 1, 2),
            "kind": "a",
        }
    ]


def test_preflight_without_create_and_unsupported_types(tmp_path: Path) -> None:
    missing = str(tmp_path / "none")
    with pytest.raises(PreflightError, match=r"does not exist.*create_table=True"):
        DeltaSink(missing, create_table=False).preflight(SCHEMA)
    with pytest.raises(PreflightError, match="unsigned"):
        DeltaSink(missing).preflight(pa.schema([("u", pa.uint32())]))
    with pytest.raises(PreflightError, match="partition column 'amount' is double"):
        DeltaSink(missing, partition_by=["amount"]).preflight(SCHEMA)
    with pytest.raises(PreflightError, match=r"partition column\(s\) \['nope'\]"):
        DeltaSink(missing, partition_by=["nope"]).preflight(SCHEMA)
    assert not DeltaTable.is_deltatable(missing)


def test_commit_validates_staged_files_against_the_table(
    sink: DeltaSink, scope: JobScope, uri: str
) -> None:
    cs = [stage(sink, scope, 1, p, [rows(p * 10, 10)]) for p in range(2)]
    # wrong partition columns in a committable: nothing is committed
    bad = json.loads(json.dumps(cs))
    bad[1]["adds"][0]["partition_values"] = {"day": "2024-01-01"}
    with pytest.raises(DeltaSchemaError, match=r"staged file .* partitioned by \['day'\]"):
        sink.committer().commit(bad)
    assert version(uri) == 0

    # the table's schema changes under the staged files: amount becomes a string
    other = rows(0, 1).to_pandas()
    other["amount"] = other["amount"].astype(str)
    write_deltalake(
        uri,
        pa.Table.from_pandas(other, preserve_index=False).cast(
            SCHEMA.set(2, pa.field("amount", pa.string()))
        ),
        mode="overwrite",
        schema_mode="overwrite",
        partition_by=["kind"],
    )
    changed = version(uri)
    with pytest.raises(
        DeltaSchemaError, match=r"staged file .*column 'amount' is double in the file but string"
    ):
        sink.committer().commit(cs)
    assert version(uri) == changed


# -- creating the table -------------------------------------------------------------------


def _create_racer(uri: str, barrier: Any, out: Any, tables: int) -> None:
    for i in range(tables):
        barrier.wait()
        try:
            DeltaSink(f"{uri}{i}", partition_by=["kind"], sink_id="race").preflight(SCHEMA)
            out.put((i, "ok"))
        except BaseException as e:  # reported to the test
            out.put((i, f"{type(e).__name__}: {e}"))


def test_concurrent_creators_leave_one_valid_table(tmp_path: Path) -> None:
    procs_n, tables = 4, 4
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(procs_n)
    out = ctx.Queue()
    base = str(tmp_path / "race")
    procs = [
        ctx.Process(target=_create_racer, args=(base, barrier, out, tables)) for _ in range(procs_n)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in range(procs_n * tables)]
    for p in procs:
        p.join(timeout=60)
    assert [r for r in results if r[1] != "ok"] == []
    for i in range(tables):
        log = sorted(os.listdir(f"{base}{i}/_delta_log"))
        assert log == ["00000000000000000000.json"], log
        t = DeltaTable(f"{base}{i}")
        assert t.metadata().partition_columns == ["kind"]
        assert pa.schema(t.schema().to_arrow()) == SCHEMA


# -- statistics ---------------------------------------------------------------------------


def test_stats_in_the_log_match_the_data(uri: str, scope: JobScope) -> None:
    schema = pa.schema(
        [
            ("i", pa.int32()),
            ("s", pa.string()),
            ("f", pa.float64()),
            ("g", pa.float32()),
            ("ts", pa.timestamp("us", tz="UTC")),
            ("d", pa.date32()),
            ("b", pa.bool_()),
            ("dec", pa.decimal128(10, 2)),
            ("st", pa.struct([("x", pa.int64())])),
            ("p", pa.int64()),
        ]
    )
    sink = DeltaSink(uri, partition_by=["p"], sink_id="orders")
    sink.preflight(schema)

    def batch(p: int, start: int) -> pa.RecordBatch:
        n = 40
        return pa.record_batch(
            {
                "i": [None if k % 6 == 0 else (start + k) * (-1) ** k for k in range(n)],
                "s": [None if k % 9 == 0 else ("é" * (k % 40)) + chr(0x10FFFF) for k in range(n)],
                "f": [float("nan") if p == 1 and k == 5 else k / 3 for k in range(n)],
                "g": [None if k == 2 else k * 0.1 for k in range(n)],
                "ts": pa.array(
                    [1_700_000_000_123_456 + k * 777 for k in range(n)], pa.timestamp("us", "UTC")
                ),
                "d": pa.array([18_000 - k for k in range(n)], pa.date32()),
                "b": [k % 2 == 0 for k in range(n)],
                "dec": pa.array([None] * n, pa.decimal128(10, 2)),
                "st": [{"x": k} for k in range(n)],
                "p": [p] * n,
            },
            schema=schema,
        )

    w = sink.open_writer(WriteContext(scope, 1, 1, 0, 1), schema)
    for start in (0, 100):
        for p in (0, 1):
            w.write(batch(p, start))
    c = w.prepare()
    w.close()
    sink.committer().commit([c])

    t = DeltaTable(uri)
    actions = pa.table(t.get_add_actions(flatten=True)).to_pylist()
    assert len(actions) == 2
    for a in actions:
        data = pq.read_table(Path(uri) / a["path"])
        stats = json.loads(next(x["stats"] for x in c["adds"] if x["path"] == a["path"]))
        assert stats["numRecords"] == a["num_records"] == data.num_rows == 80
        nulls = stats["nullCount"]
        for name in ("i", "s", "f", "g", "ts", "d", "b", "dec"):
            assert nulls[name] == data.column(name).null_count, name
        assert "st" not in nulls  # nested columns: omitted
        if a["partition.p"] == 1:
            # a NaN in f: no bound for f, so none for any column (deltalake prunes
            # a file whose bounds lack a column from every scan filtering on it)
            assert "minValues" not in stats and "maxValues" not in stats
            continue
        lo, hi = stats["minValues"], stats["maxValues"]
        assert "st" not in lo and "dec" not in lo  # nested; only nulls
        assert (lo["b"], hi["b"]) == (False, True)
        mm = pc.min_max(data.column("i"))
        assert (lo["i"], hi["i"]) == (mm["min"].as_py(), mm["max"].as_py())
        strings = [v for v in data.column("s").to_pylist() if v is not None]
        assert lo["s"] == min(strings)[:32] != min(strings)  # a prefix of a long minimum
        assert hi["s"] == max(strings) and len(max(strings)) <= 32
        mm = pc.min_max(data.column("f"))
        assert (lo["f"], hi["f"]) == (mm["min"].as_py(), mm["max"].as_py())
        g = [v for v in data.column("g").to_pylist() if v is not None]
        assert (lo["g"], hi["g"]) == (min(g), max(g))
        ts = data.column("ts").cast(pa.int64()).to_pylist()
        assert lo["ts"] == "2023-11-14T22:13:20.123Z"  # floor(min) to ms
        assert a["min.ts"] <= dt.datetime.fromtimestamp(min(ts) / 1e6, UTC)
        assert a["max.ts"] >= dt.datetime.fromtimestamp(max(ts) / 1e6, UTC)
        assert a["max.ts"] - dt.datetime.fromtimestamp(max(ts) / 1e6, UTC) < dt.timedelta(
            milliseconds=1
        )
        days = data.column("d").to_pylist()
        assert (lo["d"], hi["d"]) == (min(days).isoformat(), max(days).isoformat())
        assert (a["min.d"], a["max.d"]) == (min(days), max(days))
        assert a["min.i"] == lo["i"] and a["null_count.s"] == nulls["s"]
    # bounds never exclude a matching row: look up values through file skipping,
    # in both files (with and without bounds); a boolean column had no bounds and
    # deltalake then found none of its rows
    full = t.to_pyarrow_table()
    for row in full.to_pylist()[::9]:
        for col in ("i", "ts", "d", "s", "b", "f", "g"):
            if row[col] is None or row[col] != row[col]:  # null, NaN
                continue
            hit = t.to_pyarrow_table(filters=[(col, "=", row[col])])
            assert hit.num_rows >= 1, (col, row[col])
    assert not math.isnan(sum(v for v in full.column("g").to_pylist() if v is not None))


# -- S3 (moto's server on loopback) -----------------------------------------------------


@pytest.fixture(scope="module")
def s3_options() -> Iterator[dict[str, str]]:
    """A moto S3 server on a loopback port with an empty bucket ``twophase``."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    boto3 = pytest.importorskip("boto3")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        opts = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        ).create_bucket(Bucket="twophase")
        yield opts
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_s3_commit_abort_and_sweep(s3_options: dict[str, str], scope: JobScope) -> None:
    uri = "s3://twophase/orders"
    sink = DeltaSink(uri, partition_by=["kind"], sink_id="orders", storage_options=s3_options)
    sink.preflight(SCHEMA)
    # the sink is pickled to executors: the store is reopened there
    sink = pickle.loads(pickle.dumps(sink))
    store = TableStorage(uri, s3_options)

    cs = [
        stage(sink, scope, 1, p, [rows(p * 1500, 1000), rows(p * 1500 + 1000, 500)])
        for p in range(2)
    ]
    for c in cs:
        for a in c["adds"]:
            assert store.info(a["path"])[0] == a["size"]
            assert abs(a["modification_time"] / 1000 - time.time()) < 600
            assert (
                pq.read_metadata(a["path"], filesystem=store.fs).num_rows
                == json.loads(a["stats"])["numRecords"]
            )
    dropped = stage(sink, scope, 1, 2, [rows(9000, 10)])
    w = sink.open_writer(WriteContext(scope, 1, 1, 3, 999), SCHEMA)
    w.write(rows(8000, 10))  # a task that dies here

    def table(version: int | None = None) -> DeltaTable:
        return DeltaTable(uri, storage_options=s3_options, version=version)

    assert table().to_pyarrow_table().num_rows == 0
    sink.committer().commit(cs)
    sink.committer().commit(cs)
    assert table().version() == 1
    got = table().to_pyarrow_table(columns=["id"]).column("id").to_pylist()
    assert sorted(got) == list(range(3000))

    sink.committer().abort([dropped])
    assert all(store.info(a["path"]) is None for a in dropped["adds"])
    swept = sink.committer().sweep(scope, lambda n: True)
    assert swept == [f"tp2.job1.live.orders.i{INCARNATION}.r1.b1.p3.a999"]
    assert store.list_files(STAGING_DIR) == []
    assert sorted(table().to_pyarrow_table(columns=["id"]).column("id").to_pylist()) == list(
        range(3000)
    )


def test_s3_files_are_created_exclusively(s3_options: dict[str, str]) -> None:
    """A name collision on S3 is an error, never an overwrite: markers by a
    conditional PUT (If-None-Match: *, which moto serves), data files after
    their marker."""
    store = TableStorage("s3://twophase/excl", s3_options)
    store.put("_twophase/staged/t-00000", b"part=a/t-00000.snappy.parquet")
    with pytest.raises(FileExistsError):
        store.put("_twophase/staged/t-00000", b"another incarnation's marker")
    assert store.read("_twophase/staged/t-00000") == b"part=a/t-00000.snappy.parquet"
    with store.open_output("part=a/t-00000.snappy.parquet") as out:
        out.write(b"committed rows")
    with pytest.raises(FileExistsError):
        store.open_output("part=a/t-00000.snappy.parquet")
    assert store.read("part=a/t-00000.snappy.parquet") == b"committed rows"
