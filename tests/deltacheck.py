"""Assertions on Delta tables shared by the Spark-level Delta tests (like pgcheck.py).

Everything is read back from the table directory itself: rows with deltalake,
each version's commit from ``_delta_log/<version>.json`` (Delta's own format,
not the sink's bookkeeping), the data files and the sink's staging markers by
listing the directory. Local tables only.

* "exactly once": the table's ``id`` column holds every input id once, nothing else;
* "nothing staged left": every data file in the table directory is in the
  snapshot, and no staging marker is left (``_twophase/staged``);
* "one version per checkpoint": the versions after the table's creation map one
  to one, in order, onto the ledger's checkpoints that committed rows to the
  sink: same app transaction version (the checkpoint's cut), same row count, and
  files of exactly the batches the checkpoint covers.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable

from lifecycle.testing import verify
from sinks.delta.storage import SPARK_STAGING_DIR, STAGING_DIR
from sinks.naming import TxnName

_LOG = "_delta_log"
_VERSION_FILE = re.compile(r"^(\d{20})\.json$")


def read_rows(uri: str | Path, columns: list[str] | None = None) -> pa.Table:
    """The table's committed rows (latest version), sorted by ``id``."""
    return DeltaTable(str(uri)).to_pyarrow_table(columns=columns).sort_by("id")


def assert_exactly_once(uri: str | Path, n: int, start: int = 0) -> pa.Table:
    """Every id in [start, start+n) is in the table exactly once, and nothing else.
    Returns the table's rows sorted by id."""
    rows = read_rows(uri)
    ids = rows.column("id").to_pylist()
    dups = sorted((i, c) for i, c in Counter(ids).items() if c > 1)
    assert dups == [], f"duplicated ids in {uri} (id, copies): {dups[:10]}"
    expected = set(range(start, start + n))
    got = set(ids)
    assert got == expected, (
        f"{len(ids)} rows in {uri}, expected {n}; missing {sorted(expected - got)[:10]}, "
        f"unexpected {sorted(got - expected)[:10]}"
    )
    return rows


# -- files -------------------------------------------------------------------------------


data_files = verify.data_files_delta
"""Every file of the table directory outside ``_delta_log`` and ``_twophase``."""


def snapshot_files(uri: str | Path) -> set[str]:
    """The data files of the latest snapshot (relative paths, as on disk)."""
    root = Path(uri).resolve()
    return {str(Path(u).relative_to(root)) for u in DeltaTable(str(uri)).file_uris()}


def markers(uri: str | Path) -> list[str]:
    """The sink's staging markers left in the table directory."""
    d = Path(uri) / STAGING_DIR
    return sorted(os.listdir(d)) if d.exists() else []


def assert_nothing_staged(uri: str | Path) -> None:
    """No data file outside the snapshot, no staging marker: nothing was left behind."""
    missing = snapshot_files(uri) - data_files(uri)
    assert not missing, f"snapshot files missing from disk: {sorted(missing)}"
    verify.assert_nothing_left_delta(uri)


def spark_staging(uri: str | Path) -> list[str]:
    """Spark's staging directories (one per batch staged by Spark's writer) left
    in the table directory, with what is in them."""
    d = Path(uri) / SPARK_STAGING_DIR
    if not d.exists():
        return []
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


# -- versions ----------------------------------------------------------------------------


@dataclass
class Version:
    """One commit of the table, as ``_delta_log`` records it."""

    version: int
    operation: str | None
    app_txns: dict[str, int] = field(default_factory=dict)
    """``txn`` actions: app id -> version"""
    batch: int | None = None
    """the ``twophaseBatch`` the sink put in commitInfo"""
    rows: int = 0
    """sum of ``numRecords`` of the added files"""
    files: list[str] = field(default_factory=list)
    """added paths, as in the log (URI-encoded)"""
    metadata: bool = False
    """whether the commit carries a ``metaData`` action (creation, schema change)"""

    def txn_names(self) -> list[TxnName]:
        """The transaction names of the added files (staged file name = txn-seq)."""
        out = []
        for path in self.files:
            stem = path.rsplit("/", 1)[-1].split(".snappy.parquet")[0].rsplit("-", 1)[0]
            name = TxnName.parse(stem)
            assert name is not None, f"{path} is not a file staged by the sink"
            out.append(name)
        return out

    def batches(self) -> set[int]:
        """Spark batch ids of the added files."""
        return {n.batch_id for n in self.txn_names()}


def versions(uri: str | Path) -> list[Version]:
    """Every commit the table's log still holds, in version order, read from ``_delta_log``."""
    log = Path(uri) / _LOG
    out = []
    for name in sorted(os.listdir(log)):
        m = _VERSION_FILE.match(name)
        if not m:
            continue
        v = Version(int(m[1]), None)
        for line in (log / name).read_text().splitlines():
            if not line.strip():
                continue
            action: dict[str, Any] = json.loads(line)
            if "commitInfo" in action:
                info = action["commitInfo"]
                v.operation = info.get("operation")
                if "twophaseBatch" in info:
                    v.batch = int(info["twophaseBatch"])
            elif "txn" in action:
                v.app_txns[action["txn"]["appId"]] = int(action["txn"]["version"])
            elif "add" in action:
                v.files.append(action["add"]["path"])
                v.rows += int(json.loads(action["add"]["stats"])["numRecords"])
            elif "metaData" in action:
                v.metadata = True
        out.append(v)
    first = out[0].version if out else 0  # log cleanup deletes the oldest commits
    assert [v.version for v in out] == list(range(first, first + len(out))), f"gaps in {log}"
    return out


def runs_of_batch(versions: list[Version], batch: int) -> set[int]:
    """The job runs whose staged files of ``batch`` the table committed."""
    return {n.run for v in versions for n in v.txn_names() if n.batch_id == batch}


def assert_created_once(uri: str | Path) -> list[Version]:
    """Version 0 created the table (``CREATE TABLE``, or a first ``WRITE`` carrying
    the metadata); no later version re-created it or changed its metadata.
    Returns every version."""
    vs = versions(uri)
    assert vs and vs[0].metadata, vs[:1]
    later = [v.version for v in vs[1:] if v.metadata or v.operation == "CREATE TABLE"]
    assert later == [], f"{uri}: versions {later} re-created the table or changed its metadata"
    return vs


def assert_one_version_per_checkpoint(
    uri: str | Path, ledger: dict[str, Any], pipeline: str, sink_label: str, app: str
) -> list[Version]:
    """The sink's versions of ``app`` and the ledger's checkpoints that committed
    rows to ``sink_label`` correspond one to one, in order: the version's app
    transaction is the checkpoint's cut, it holds the checkpoint's rows, and its
    files belong to exactly the batches after the previous cut up to this one.
    Returns the sink's versions."""
    ours = [v for v in versions(uri) if app in v.app_txns]
    cps = [cp for cp in ledger["history"] if cp["rows"].get(sink_label)]
    assert len(ours) == len(cps), (
        f"{len(ours)} Delta version(s) of {app} ({[v.version for v in ours]}) but "
        f"{len(cps)} checkpoint(s) committed rows to {sink_label} "
        f"(cuts {[cp['cut'] for cp in cps]})"
    )
    previous = -1
    for v, cp in zip(ours, cps, strict=True):
        cut = cp["cut"][pipeline]
        what = f"version {v.version} vs checkpoint {cp['id']} (cut {cut})"
        assert v.operation == "WRITE", what
        assert v.app_txns[app] == cut and v.batch == cut, f"{what}: txn {v.app_txns}"
        assert v.rows == cp["rows"][sink_label], f"{what}: {v.rows} rows vs {cp['rows']}"
        got = v.batches()
        assert got <= set(range(previous + 1, cut + 1)) and cut in got, (
            f"{what}: files of batches {sorted(got)}, expected batches {previous + 1}..{cut}"
        )
        previous = cut
    return ours


def spark_rows(spark: Any, uri: str | Path) -> list[tuple[Any, ...]]:
    """The snapshot's data files read by Spark's own Parquet reader (partition
    values from the Hive-style directories, ``basePath`` = the table root),
    as sorted tuples of the table's columns in table order."""
    dt = DeltaTable(str(uri))
    files = dt.file_uris()
    columns = [f.name for f in dt.schema().fields]
    if not files:
        return []
    df = spark.read.option("basePath", str(Path(uri).resolve())).parquet(*files)
    return sorted((tuple(r) for r in df.select(*columns).collect()), key=row_order)


def delta_rows(uri: str | Path) -> list[tuple[Any, ...]]:
    """The table's rows read by deltalake, as sorted tuples in table order."""
    t = DeltaTable(str(uri)).to_pyarrow_table()
    return sorted(
        zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True), key=row_order
    )


def row_order(row: tuple[Any, ...]) -> tuple[tuple[bool, Any], ...]:
    """Sort key of a row that may hold nulls."""
    return tuple((v is None, "" if v is None else v) for v in row)


def delta_spark_rows(spark: Any, uri: str | Path) -> list[tuple[Any, ...]]:
    """The table read by delta-spark (``format("delta")``, the engine Delta
    users run), as sorted tuples of the table's columns in table order; the
    test is skipped when delta-spark's jars are not fetched."""
    from lifecycle.testing import jars

    jars.require("delta")
    columns = [f.name for f in DeltaTable(str(uri)).schema().fields]
    df = spark.read.format("delta").load(str(Path(uri).resolve()))
    return sorted((tuple(r) for r in df.select(*columns).collect()), key=row_order)


def duckdb_rows(uri: str | Path) -> list[tuple[Any, ...]]:
    """The table's rows read by DuckDB's Delta extension (``delta_scan``: a
    reader that is not deltalake), as sorted tuples in table order. The
    extension comes from its PyPI package, pinned to DuckDB's version (``INSTALL
    delta`` would download it)."""
    import duckdb
    import duckdb_extension_delta

    found = sorted(Path(duckdb_extension_delta.__file__).parent.glob("extensions/*/delta.*"))
    assert found, "duckdb-extension-delta holds no extension file"
    columns = [f.name for f in DeltaTable(str(uri)).schema().fields]
    con = duckdb.connect(config={"allow_unsigned_extensions": "true"})
    try:
        con.execute(f"LOAD '{found[-1]}'")
        cols = ", ".join('"' + c.replace('"', '""') + '"' for c in columns)
        path = str(Path(uri).resolve()).replace("'", "''")
        rows = con.execute(f"SELECT {cols} FROM delta_scan('{path}')").fetchall()
    finally:
        con.close()
    return sorted((tuple(r) for r in rows), key=row_order)


# -- delta-spark, the engine Delta users run ------------------------------------------------

SINK_OPERATIONS = {"WRITE", "STREAMING UPDATE"}
"""what ``DESCRIBE HISTORY`` names the sink's data commits: delta-rs's append or
rewrite, or delta-spark's streaming update (tables committed through it)"""


def _as_spark(value: Any) -> Any:
    """A value deltalake reads as Spark collects it: an instant (``timestamp``)
    as naive wall-clock time in UTC, the tests' session time zone."""
    if isinstance(value, datetime.datetime) and value.tzinfo is not None:
        return value.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    return value


def assert_delta_spark_reads_every_version(
    spark: Any, uri: str | Path, *, since: int = 0
) -> list[Any]:
    """delta-spark reads every version of the table its log still holds, from
    ``since`` on (``versionAsOf``), exactly as deltalake does, and ``DESCRIBE HISTORY`` names
    each of the sink's commits (:data:`SINK_OPERATIONS`) with its app
    transaction (``userMetadata``) and ``numOutputRows`` equal to the rows its
    added files hold. Returns the history rows."""
    from lifecycle.testing import jars

    jars.require("delta")
    path = str(Path(uri).resolve())
    history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()
    assert history, f"delta-spark finds no history in {uri}"
    rows = {x.version: x.rows for x in versions(path)}
    for h in history:
        v = int(h["version"])
        if v < since:
            continue
        df = spark.read.format("delta").option("versionAsOf", v).load(path)
        got = sorted((tuple(r) for r in df.collect()), key=row_order)
        t = DeltaTable(path, version=v).to_pyarrow_table()
        values = ([_as_spark(x) for x in t.column(c).to_pylist()] for c in df.columns)
        want = sorted(zip(*values, strict=True), key=row_order)
        assert got == want, f"{uri} version {v}: delta-spark and deltalake read different rows"
        meta = h["userMetadata"] or ""
        if meta.startswith("twophase "):
            assert h["operation"] in SINK_OPERATIONS, (v, h["operation"])
            metrics = h["operationMetrics"] or {}
            assert int(metrics.get("numOutputRows", -1)) == rows[v], (v, metrics, rows[v])
    return history


def assert_streaming_read_sees_each_row_once(
    spark: Any,
    uri: str | Path,
    checkpoint: Path,
    *,
    skip_change_commits: bool = False,
    starting_version: int = 0,
) -> list[tuple[Any, ...]]:
    """A delta-spark streaming read of the table from its first version
    (``startingVersion`` 0, ``availableNow``: each version's files in order,
    not the latest snapshot) sees every row of an append-only table once: what
    the snapshot holds, no row twice. With ``skip_change_commits`` (a keyed
    or replacing sink's table, whose versions remove files) it runs through the
    rewrites without failing and sees no row twice. From a ``starting_version``
    past 0 it checks no row is seen twice (the snapshot also holds older rows).
    Returns the rows seen, sorted."""
    from lifecycle.testing import jars

    jars.require("delta")
    seen: list[tuple[Any, ...]] = []

    def collect(df: Any, _batch: int) -> None:
        seen.extend(tuple(r) for r in df.collect())

    reader = spark.readStream.format("delta").option("startingVersion", str(starting_version))
    if skip_change_commits:
        reader = reader.option("skipChangeCommits", "true")
    query = (
        reader.load(str(Path(uri).resolve()))
        .writeStream.trigger(availableNow=True)
        .option("checkpointLocation", str(checkpoint))
        .foreachBatch(collect)
        .start()
    )
    query.awaitTermination()
    seen.sort(key=row_order)
    assert len(set(seen)) == len(seen), f"a streaming read of {uri} saw rows twice"
    if not skip_change_commits and starting_version == 0:
        assert seen == delta_spark_rows(spark, uri), "the stream and the snapshot differ"
    return seen


def assert_change_feed_replays_to_the_table(
    spark: Any, uri: str | Path, *, key: str = "id", since: int = 0
) -> list[tuple[Any, ...]]:
    """delta-spark's change feed, replayed version by version from ``since``
    (the table's state at ``since - 1`` given by ``versionAsOf``, empty at 0),
    ends at the table delta-spark reads: no change missed or seen twice. In
    each version a ``delete`` or ``update_preimage`` must find the row as it
    was, an ``insert`` must find its key absent and an ``update_postimage``
    its preimage taken. Returns the final rows (sorted)."""
    path = str(Path(uri).resolve())
    latest = spark.read.format("delta").load(path)
    columns = [c for c in latest.columns]
    state: dict[Any, tuple[Any, ...]] = {}
    if since > 0:
        before = spark.read.format("delta").option("versionAsOf", since - 1).load(path)
        state = {r[key]: tuple(r[c] for c in columns) for r in before.collect()}
    feed = spark.sql(f"SELECT * FROM table_changes_by_path('{path}', {since})").collect()
    by_version: dict[int, list[Any]] = {}
    for r in feed:
        by_version.setdefault(int(r["_commit_version"]), []).append(r)
    for v in sorted(by_version):
        rows = by_version[v]
        gone = [r for r in rows if r["_change_type"] in ("delete", "update_preimage")]
        came = [r for r in rows if r["_change_type"] in ("insert", "update_postimage")]
        for r in gone:
            row = tuple(r[c] for c in columns)
            assert state.get(r[key]) == row, (
                f"version {v}: {r['_change_type']} of {row}, table had {state.get(r[key])}"
            )
            del state[r[key]]
        for r in came:
            assert r[key] not in state, f"version {v}: {r['_change_type']} of key {r[key]} present"
            state[r[key]] = tuple(r[c] for c in columns)
    want = sorted(tuple(r[c] for c in columns) for r in latest.collect())
    got = sorted(state.values())
    assert got == want, f"{uri}: the change feed replays to {got}, the table holds {want}"
    return got
