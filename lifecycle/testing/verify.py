"""Verifiers: does a sink hold every expected row exactly once, and nothing unfinished?

Each reads the target itself, never the job's own bookkeeping:

* PostgreSQL: the table's rows, and ``pg_prepared_xacts`` for prepared
  transactions left behind;
* Kafka: the topic read raw and resolved by its control markers
  (:mod:`sinks.kafka.log`: what a ``read_committed`` consumer sees, without
  trusting the broker's aborted-transactions list), and the sink's registry
  topic for the job's transactions still open;
* Delta: the table's latest snapshot, and the table directory for staged files
  and staging markers left behind: a local directory, or a URI of any store
  deltalake opens (``s3://``, ``hdfs://``, ...; pass ``storage_options=`` as
  to ``DeltaSink``), listed through deltalake's own store.

``assert_exactly_once_*(…, expected_keys, …)``: every expected key is there
exactly once and nothing else is (append writes). ``assert_final_state_*(…,
expected, …)``: after keyed writes (upserts, deletes), the rows are exactly
``expected`` (key -> row, or for Kafka key -> last value, ``None`` for a
tombstone). Both also assert that nothing is left prepared, open or staged
(pass ``job=`` to look at one job's transactions only where a sink shares its
target with others). Failures say what is missing, duplicated or unexpected,
with examples.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from sinks.kafka.log import Record, TopicLog, read_topic
from sinks.naming import TxnName

SETTLE_S = 15.0
"""How long a Kafka check waits for the markers of decided transactions to land
(Apache Kafka writes them just after it answers EndTxn)."""


def assert_keys_once(where: str, got: Iterable[Any], expected_keys: Iterable[Any]) -> None:
    """``got`` holds every key of ``expected_keys`` once and nothing else; the
    message names ``where``, duplicates, missing and unexpected keys."""
    _compare(where, list(got), expected_keys)


def _compare(where: str, got: list[Any], expected_keys: Iterable[Any]) -> None:
    dups = sorted(((k, n) for k, n in Counter(got).items() if n > 1), key=repr)
    assert not dups, f"{where}: keys written more than once (key, copies): {dups[:10]}"
    expected = set(expected_keys)
    have = set(got)
    missing = sorted(expected - have, key=repr)
    extra = sorted(have - expected, key=repr)
    assert not missing and not extra, (
        f"{where}: {len(got)} row(s), expected {len(expected)}; missing {len(missing)} "
        f"(e.g. {missing[:10]}), unexpected {len(extra)} (e.g. {extra[:10]})"
    )


# -- PostgreSQL -------------------------------------------------------------------------


def prepared_postgres(dsn: str, job: str | None = None) -> list[str]:
    """Prepared transactions left in the database of ``dsn`` (of ``job`` only, if given)."""
    import psycopg

    with psycopg.connect(dsn) as c:
        if job is None:
            rows = c.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            ).fetchall()
        else:
            rows = c.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                " AND (starts_with(gid, %s) OR starts_with(gid, %s))",
                TxnName.job_prefixes(job),
            ).fetchall()
    return sorted(r[0] for r in rows)


def assert_nothing_left_postgres(dsn: str, job: str | None = None) -> None:
    """No prepared transaction is left on the server (of ``job``'s, when given)."""
    left = prepared_postgres(dsn, job)
    assert not left, f"{len(left)} prepared transaction(s) left in PostgreSQL: {left[:5]}"


def _pg_rows(
    dsn: str, table: str, columns: list[str] | None
) -> tuple[list[str], list[tuple[Any, ...]]]:
    import psycopg
    from psycopg import sql

    schema, _, name = table.rpartition(".")
    ident = sql.Identifier(schema, name) if schema else sql.Identifier(name)
    cols = sql.SQL("*") if columns is None else sql.SQL(", ").join(map(sql.Identifier, columns))
    with psycopg.connect(dsn) as c:
        cur = c.execute(sql.SQL("SELECT {} FROM {}").format(cols, ident))
        names = [d.name for d in cur.description or ()]
        return names, cur.fetchall()


def assert_exactly_once_postgres(
    dsn: str, table: str, expected_keys: Iterable[Any], *, key: str = "id", job: str | None = None
) -> None:
    """Every key of ``expected_keys`` is in column ``key`` of ``table`` exactly
    once, nothing else is, and no prepared transaction is left."""
    _names, rows = _pg_rows(dsn, table, [key])
    _compare(f"PostgreSQL table {table}", [r[0] for r in rows], expected_keys)
    assert_nothing_left_postgres(dsn, job)


def assert_final_state_postgres(
    dsn: str,
    table: str,
    expected: Mapping[Any, Mapping[str, Any]],
    *,
    key: str = "id",
    job: str | None = None,
) -> None:
    """``table`` holds exactly the rows of ``expected`` (key -> {column: value}, the
    columns to compare), and no prepared transaction is left."""
    names, rows = _pg_rows(dsn, table, None)
    got = [dict(zip(names, r, strict=True)) for r in rows]
    _compare(f"PostgreSQL table {table}", [r[key] for r in got], expected)
    _same_rows(f"PostgreSQL table {table}", {r[key]: r for r in got}, expected)
    assert_nothing_left_postgres(dsn, job)


def _same_rows(
    where: str, got: Mapping[Any, Mapping[str, Any]], expected: Mapping[Any, Mapping[str, Any]]
) -> None:
    wrong = [
        (k, {c: got[k].get(c) for c in want}, dict(want))
        for k, want in expected.items()
        if any(got[k].get(c) != v for c, v in want.items())
    ]
    assert not wrong, f"{where}: {len(wrong)} row(s) differ (key, got, expected): {wrong[:5]}"


# -- Kafka ----------------------------------------------------------------------------


def read_settled(bootstrap: str, topic: str, timeout: float = SETTLE_S) -> TopicLog:
    """The topic's log, re-read until no record is in an open transaction or
    ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while True:
        log = read_topic(bootstrap, topic)
        if log.n_open == 0 or time.monotonic() > deadline:
            return log
        time.sleep(0.2)


def json_field(name: str) -> Callable[[Record], Any]:
    """A key function: field ``name`` of the record's JSON value (KafkaSink's
    default value is a JSON object of every column)."""

    def key_of(record: Record) -> Any:
        assert record.value is not None, (
            f"record at {record.partition}/{record.offset} has no value"
        )
        return json.loads(record.value)[name]

    return key_of


def record_key(record: Record) -> Any:
    """A key function: the record's key, decoded as UTF-8."""
    return None if record.key is None else record.key.decode()


def announced_txn(record: Record) -> str | None:
    """The transaction name a registry record announces (its value's ``txn``;
    the key itself in announcements of version 1), or None for a tombstone or a
    record that is no announcement."""
    if record.key is None or record.value is None:
        return None
    try:
        txn = json.loads(record.value).get("txn")
    except (ValueError, AttributeError):
        return None
    return txn if isinstance(txn, str) else record.key.decode("utf-8", "replace")


def open_transactions_kafka(bootstrap: str, job: str, *, settle: float = 0.0) -> list[str]:
    """Names of ``job``'s transactions that are still open, from their
    announcements in the sink's registry topic (every writer announces its
    transaction inside it, before any data)."""
    from sinks.kafka.registry import DEFAULT_TOPIC

    deadline = time.monotonic() + settle
    prefixes = TxnName.job_prefixes(job)
    while True:
        try:
            log = read_topic(bootstrap, DEFAULT_TOPIC)
        except LookupError:  # no registry: the job never wrote a transaction
            return []
        found = sorted(
            name
            for r in log.open
            for name in [announced_txn(r)]
            if name is not None and name.startswith(prefixes)
        )
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def assert_nothing_left_kafka(bootstrap: str, topic: str, job: str | None = None) -> TopicLog:
    """No record of ``topic`` is in an open transaction (and, with ``job``, the
    registry holds none of its transactions open); returns the settled log."""
    log = read_settled(bootstrap, topic)
    assert log.n_open == 0, f"{log.n_open} record(s) of {topic} left in open transactions"
    if job is not None:
        left = open_transactions_kafka(bootstrap, job, settle=SETTLE_S)
        assert not left, f"{len(left)} transaction(s) of job {job} left open: {left[:5]}"
    return log


def assert_exactly_once_kafka(
    bootstrap: str,
    topic: str,
    expected_keys: Iterable[Any],
    *,
    key_of: Callable[[Record], Any] | str = "id",
    job: str | None = None,
) -> TopicLog:
    """Every key of ``expected_keys`` is committed in ``topic`` exactly once,
    nothing else is committed, and nothing is left open. ``key_of``: a JSON field
    of the value (default ``"id"``) or a function of a :class:`~sinks.kafka.log.Record`
    (e.g. :func:`record_key`). Returns the log."""
    get = json_field(key_of) if isinstance(key_of, str) else key_of
    log = assert_nothing_left_kafka(bootstrap, topic, job)
    _compare(f"Kafka topic {topic}", [get(r) for r in log.committed], expected_keys)
    return log


def assert_final_state_kafka(
    bootstrap: str,
    topic: str,
    expected: Mapping[Hashable, bytes | None],
    *,
    job: str | None = None,
) -> TopicLog:
    """The topic read as a compacted table (the last committed value per record
    key, a tombstone removing the key) is exactly ``expected`` (key string ->
    value bytes); nothing is left open."""
    log = assert_nothing_left_kafka(bootstrap, topic, job)
    table: dict[Any, bytes | None] = {}
    for r in sorted(log.committed, key=lambda r: (r.partition, r.offset)):
        k = record_key(r)
        if r.value is None:
            table.pop(k, None)
        else:
            table[k] = r.value
    want = {k: v for k, v in expected.items() if v is not None}
    _compare(f"Kafka topic {topic} (as a table)", list(table), want)
    wrong = [(k, table[k], v) for k, v in want.items() if table[k] != v]
    assert not wrong, (
        f"Kafka topic {topic}: {len(wrong)} key(s) differ (key, got, expected): {wrong[:5]}"
    )
    return log


# -- Delta ----------------------------------------------------------------------------

_LOG_DIR = "_delta_log"
_OWN_DIR = "_twophase"
_CHANGE_DATA_DIR = "_change_data"
"""delta-spark's change-data files (``cdc`` actions of its UPDATE, DELETE, MERGE)"""


Options = Mapping[str, str] | None


def _is_local(table_uri: str | Path) -> bool:
    return "://" not in str(table_uri) or str(table_uri).startswith("file://")


def _store_files(
    table_uri: str, storage_options: Options
) -> tuple[list[str], Callable[[str], bytes]]:
    """Every file of the table at the URI ``table_uri`` (relative to it), and a
    reader of one, through deltalake's store (what the sink writes through)."""
    import pyarrow.fs as pafs
    from deltalake.fs import DeltaStorageHandler

    fs = pafs.PyFileSystem(DeltaStorageHandler(table_uri, dict(storage_options or {}) or None))
    infos = fs.get_file_info(pafs.FileSelector("", recursive=True, allow_not_found=True))
    files = sorted(
        i.path for i in infos if i.type == pafs.FileType.File and not i.path.endswith("/")
    )

    def read(rel: str) -> bytes:
        with fs.open_input_stream(rel) as f:
            return bytes(f.read())

    return files, read


def data_files_delta(table_uri: str | Path, *, storage_options: Options = None) -> set[str]:
    """Every file of the table outside ``_delta_log``, ``_change_data`` and the
    sink's ``_twophase`` directory (relative paths)."""
    skipped = (_LOG_DIR, _OWN_DIR, _CHANGE_DATA_DIR)
    if not _is_local(table_uri):
        files, _ = _store_files(str(table_uri), storage_options)
        return {f for f in files if f.split("/", 1)[0] not in skipped}
    root = Path(str(table_uri).removeprefix("file://"))
    out: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in skipped]
        out.update(str(rel_dir / f) if rel_dir != Path(".") else f for f in filenames)
    return out


_DELTA_SPARK_FILE = re.compile(
    r"^\.?((part|cdc)-\d+-[0-9a-f-]{36}[^/]*\.parquet|deletion_vector_[0-9a-f-]{36}\.bin)"
    r"(\.crc)?$"
)
"""delta-spark's data files (``part-00000-<uuid>-c000.snappy.parquet``), change-data
files (``cdc-00000-<uuid>...``) and deletion vectors, with Hadoop's checksums
(``.<name>.crc``)"""


def _engine_file(rel: str, added: set[str]) -> bool:
    """A file another engine keeps beside the data, never one the sink stages:
    delta-spark's data files and deletion vectors (among them the files of its
    statements that conflicted, left for VACUUM), and Hadoop's checksums of
    the sink's files the table added."""
    name = Path(rel).name
    if _DELTA_SPARK_FILE.match(name):
        return True
    if name.startswith(".") and name.endswith(".crc"):
        return str(Path(rel).with_name(name[1:-4])) in added
    return False


def staged_delta(table_uri: str | Path, *, storage_options: Options = None) -> list[str]:
    """What the sink left staged in a table: data files that no version of the
    table ever added (a merge's removed files are history, not leftovers),
    staging markers, change files and Spark staging directories."""
    from deltalake import DeltaTable

    from sinks.delta.changes import CHANGES_DIR
    from sinks.delta.storage import SPARK_STAGING_DIR, STAGING_DIR

    options = dict(storage_options or {}) or None
    table = DeltaTable(str(table_uri), storage_options=options)
    base = str(table_uri).rstrip("/") + "/"
    if _is_local(table_uri):
        root = Path(str(table_uri).removeprefix("file://"))
        resolved = str(root.resolve()) + "/"
        added = {u.removeprefix("file://").removeprefix(resolved) for u in table.file_uris()}
        log_dir = root / _LOG_DIR
        logs = sorted(log_dir.glob("*.json")) if log_dir.exists() else []
        texts = [c.read_text() for c in logs]
    else:
        added = {u.removeprefix(base) for u in table.file_uris()}
        files, read = _store_files(str(table_uri), storage_options)
        texts = [
            read(f).decode() for f in files if f.startswith(_LOG_DIR + "/") and f.endswith(".json")
        ]
    for text in texts:
        for line in text.splitlines():
            add = json.loads(line).get("add") if line.strip() else None
            if add:
                added.add(unquote(add["path"]))
    data = data_files_delta(table_uri, storage_options=storage_options)
    left = sorted(f for f in data - added if not _engine_file(f, added))
    own = (STAGING_DIR, SPARK_STAGING_DIR, CHANGES_DIR)
    if _is_local(table_uri):
        for d in own:
            if (root / d).exists():
                left += [f"{d}/{n}" for n in sorted(os.listdir(root / d))]
    else:
        left += [f for f in files if any(f.startswith(d + "/") for d in own)]
    return left


def assert_nothing_left_delta(table_uri: str | Path, *, storage_options: Options = None) -> None:
    """No staged file of the sink is left in the table."""
    left = staged_delta(table_uri, storage_options=storage_options)
    assert not left, f"{len(left)} staged file(s) left in {table_uri}: {left[:10]}"


def _readable_delta(table_uri: str | Path, storage_options: Options = None) -> Any:
    """The table through deltalake, refusing a table deltalake cannot read
    faithfully: with column mapping, deltalake 1.6 reads every column as null
    (it looks up logical names in the files), so any check would be wrong."""
    from deltalake import DeltaTable

    dt = DeltaTable(str(table_uri), storage_options=dict(storage_options or {}) or None)
    mode = (dt.metadata().configuration or {}).get("delta.columnMapping.mode")
    if mode not in (None, "none"):
        raise AssertionError(
            f"Delta table {table_uri} uses column mapping ({mode}), which deltalake reads as "
            "nulls: check it with delta-spark instead (spark.read.format('delta'))"
        )
    return dt


def _delta_rows(table_uri: str | Path, storage_options: Options = None) -> list[dict[str, Any]]:
    return list(_readable_delta(table_uri, storage_options).to_pyarrow_table().to_pylist())


def assert_exactly_once_delta(
    table_uri: str | Path,
    expected_keys: Iterable[Any],
    *,
    key: str = "id",
    storage_options: Options = None,
) -> None:
    """Every key of ``expected_keys`` is in column ``key`` of the table exactly
    once, nothing else is, and nothing is left staged. A column-mapped table is
    refused (deltalake reads it as nulls)."""
    dt = _readable_delta(table_uri, storage_options)
    keys = dt.to_pyarrow_table(columns=[key]).column(key).to_pylist()
    _compare(f"Delta table {table_uri}", keys, expected_keys)
    assert_nothing_left_delta(table_uri, storage_options=storage_options)


def assert_final_state_delta(
    table_uri: str | Path,
    expected: Mapping[Any, Mapping[str, Any]],
    *,
    key: str = "id",
    storage_options: Options = None,
) -> None:
    """The table holds exactly the rows of ``expected`` (key -> {column: value}),
    and nothing is left staged."""
    got = _delta_rows(table_uri, storage_options)
    _compare(f"Delta table {table_uri}", [r[key] for r in got], expected)
    _same_rows(f"Delta table {table_uri}", {r[key]: r for r in got}, expected)
    assert_nothing_left_delta(table_uri, storage_options=storage_options)
