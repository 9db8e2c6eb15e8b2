"""Deletes in PostgreSQL keyed writes (``delete_when``), no Spark but the last test.

The hostile cases: a delete of a key that an earlier batch inserted and that
still awaits its checkpoint (prepared, invisible), deletes that agree or clash
with writes of one key, a null where the sink must tell a delete from a write,
and a change feed through Spark checked against the dictionary model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from lifecycle import Job
from sinks import ConfigError, DuplicateKeyError, NullKeyError, PostgresSink, PreflightError
from sinks.base import Committable, JobScope, WriteContext
from sinks.errors import LockWaitError
from tests.changefeed import SCHEMA as FEED
from tests.changefeed import write_feed
from tests.pgcheck import job_prepared

JOB = "deletes"


def _table(dsn: str, ddl: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(ddl)


def _rows(dsn: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as c:
        return c.execute(query).fetchall()


def _batch(**cols: Any) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(cols)


def _scope(sink: PostgresSink) -> JobScope:
    return JobScope(JOB, "p", sink.sink_id, "0123456789ab")


def _prepare(
    sink: PostgresSink, batches: Sequence[pa.RecordBatch], batch_id: int
) -> Committable | None:
    """One batch's single task: write every record batch, prepare."""
    w = sink.open_writer(
        WriteContext(_scope(sink), 1, batch_id, 0, batch_id * 10), batches[0].schema
    )
    failed = True
    try:
        for b in batches:
            w.write(b)
        c = w.prepare()
        failed = False
    finally:
        w.close(failed=failed)
    return c


def _write(sink: PostgresSink, batches: Sequence[pa.RecordBatch], batch_id: int = 0) -> None:
    sink.preflight(batches[0].schema)
    sink.committer().claim(_scope(sink))
    c = _prepare(sink, batches, batch_id)
    assert c is not None
    sink.committer().commit([c])


def test_deletes_by_a_boolean_column(pg_dsn: str) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, name text)")
    sink = PostgresSink(pg_dsn, "t", key=["id"], delete_when="gone")
    _write(sink, [_batch(id=[1, 2, 3], name=["a", "b", "c"], gone=[False, False, False])])
    # a delete, an update, a delete of a key the table never had (no error)
    _write(sink, [_batch(id=[2, 3, 9], name=[None, "c2", "x"], gone=[True, False, True])], 1)
    assert _rows(pg_dsn, "SELECT id, name FROM t ORDER BY id") == [(1, "a"), (3, "c2")]
    assert job_prepared(pg_dsn, JOB) == []


def test_deletes_by_a_value_with_order_by(pg_dsn: str) -> None:
    """A change feed: the greatest ``seq`` of a key wins, a delete included."""
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, seq bigint, name text)")
    _table(pg_dsn, "INSERT INTO t VALUES (1, 0, 'old'), (2, 0, 'old')")
    sink = PostgresSink(pg_dsn, "t", key=["id"], order_by="seq", delete_when=("op", "D"))
    feed = _batch(
        id=[1, 1, 1, 2, 2, 3, 3, 4],
        seq=[1, 3, 2, 5, 4, 1, 2, 7],
        op=["U", "D", "U", "U", "D", "I", "D", "D"],
        name=["a1", None, "a2", "b5", None, "c1", None, None],
    )
    _write(sink, [feed.slice(0, 3), feed.slice(3)])
    # 1: deleted at seq 3; 2: the update at 5 outlives the delete at 4; 3: inserted
    # and deleted in one batch; 4: a delete of nothing
    assert _rows(pg_dsn, "SELECT id, seq, name FROM t ORDER BY id") == [(2, 5, "b5")]


def test_deletes_agree_and_a_delete_clashes_with_a_write(pg_dsn: str) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, seq bigint, name text)")
    _table(pg_dsn, "INSERT INTO t VALUES (1, 0, 'a'), (2, 0, 'b')")
    unordered = PostgresSink(pg_dsn, "t", key=["id"], delete_when=("op", "D"))
    with pytest.raises(DuplicateKeyError, match=r"\(id=1\).*order_by="):
        _write(unordered, [_batch(id=[1, 1], seq=[1, 2], op=["D", "U"], name=[None, "x"])])
    ordered = PostgresSink(pg_dsn, "t", key=["id"], order_by="seq", delete_when=("op", "D"))
    with pytest.raises(DuplicateKeyError, match=r"\(id=2\).*tied at their greatest 'seq'"):
        _write(ordered, [_batch(id=[2, 2], seq=[4, 4], op=["D", "U"], name=[None, "y"])], 1)
    assert _rows(pg_dsn, "SELECT id, name FROM t ORDER BY id") == [(1, "a"), (2, "b")]
    # two deletes of one key agree whatever else they hold, tied or not
    _write(unordered, [_batch(id=[1, 1], seq=[1, 2], op=["D", "D"], name=["p", "q"])], 2)
    _write(ordered, [_batch(id=[2, 2], seq=[4, 4], op=["D", "D"], name=["p", "q"])], 3)
    assert _rows(pg_dsn, "SELECT count(*) FROM t") == [(0,)]
    assert job_prepared(pg_dsn, JOB) == []


def test_a_null_delete_flag_fails_the_batch(pg_dsn: str) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, name text)")
    _table(pg_dsn, "INSERT INTO t VALUES (1, 'a')")
    sink = PostgresSink(pg_dsn, "t", key=["id"], delete_when=("op", "D"))
    with pytest.raises(NullKeyError, match=r"null in delete_when column 'op'"):
        _write(sink, [_batch(id=[1, 2], op=["D", None], name=[None, "b"])])
    assert _rows(pg_dsn, "SELECT id, name FROM t") == [(1, "a")]


def test_delete_configuration_is_checked(pg_dsn: str) -> None:
    with pytest.raises(ConfigError, match="needs key"):
        PostgresSink(pg_dsn, "t", delete_when="gone")
    with pytest.raises(ConfigError, match="also a key"):
        PostgresSink(pg_dsn, "t", key=["id"], delete_when="id")
    with pytest.raises(ConfigError, match="neither a boolean column"):
        PostgresSink(pg_dsn, "t", key=["id"], delete_when=42)  # type: ignore[arg-type]
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, name text)")
    schema = pa.schema([("id", pa.int64()), ("name", pa.string()), ("op", pa.string())])
    with pytest.raises(PreflightError, match="not boolean"):
        PostgresSink(pg_dsn, "t", key=["id"], delete_when="op").preflight(schema)
    with pytest.raises(PreflightError, match="cannot be compared"):
        PostgresSink(pg_dsn, "t", key=["id"], delete_when=("id_", 1)).preflight(
            pa.schema([("id", pa.int64()), ("name", pa.string()), ("id_", pa.date32())])
        )
    with pytest.raises(PreflightError, match="delete_when column 'gone'"):
        PostgresSink(pg_dsn, "t", key=["id"], delete_when="gone").preflight(schema)


def _commit_later(sink: PostgresSink, c: Committable, after: float) -> threading.Thread:
    def commit() -> None:
        time.sleep(after)
        sink.committer().commit([c])

    t = threading.Thread(target=commit)
    t.start()
    return t


def test_a_delete_waits_for_the_earlier_batch_that_inserted_its_key(pg_dsn: str) -> None:
    """The issue's case: batch 0 inserts key 5 and is prepared (its checkpoint
    has not come); batch 1 deletes key 5. A plain DELETE would not see the
    uncommitted row, delete nothing, and key 5 would appear when batch 0
    commits. The delete waits for batch 0's commit instead."""
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, name text)")
    sink = PostgresSink(pg_dsn, "t", key=["id"], delete_when="gone")
    first = _batch(id=[5, 6], name=["five", "six"], gone=[False, False])
    sink.preflight(first.schema)
    sink.committer().claim(_scope(sink))
    c0 = _prepare(sink, [first], 0)
    assert c0 is not None
    committer = _commit_later(sink, c0, after=1.5)
    started = time.monotonic()
    c1 = _prepare(sink, [_batch(id=[5], name=[None], gone=[True])], 1)
    waited = time.monotonic() - started
    committer.join()
    assert c1 is not None
    sink.committer().commit([c1])
    assert _rows(pg_dsn, "SELECT id, name FROM t ORDER BY id") == [(6, "six")]
    assert waited >= 1.4, f"the delete did not wait for batch 0 ({waited:.2f}s)"
    assert job_prepared(pg_dsn, JOB) == []


def test_a_delete_waits_no_longer_than_lock_timeout(pg_dsn: str) -> None:
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, name text)")
    sink = PostgresSink(pg_dsn, "t", key=["id"], delete_when="gone", lock_timeout=1)
    first = _batch(id=[5], name=["five"], gone=[False])
    sink.preflight(first.schema)
    sink.committer().claim(_scope(sink))
    c0 = _prepare(sink, [first], 0)
    assert c0 is not None
    with pytest.raises(LockWaitError, match=r"deletes keys and waited .*b0\.p0"):
        _prepare(sink, [_batch(id=[5], name=[None], gone=[True])], 1)
    # a batch of writes only does not wait for anything it does not share
    c2 = _prepare(sink, [_batch(id=[7], name=["seven"], gone=[False])], 2)
    assert c2 is not None
    sink.committer().commit([c0, c2])
    assert _rows(pg_dsn, "SELECT id FROM t ORDER BY id") == [(5,), (7,)]
    assert job_prepared(pg_dsn, JOB) == []


# -- through Spark ------------------------------------------------------------------------


def test_a_change_feed_through_spark_equals_the_dictionary_model(spark, pg_dsn, tmp_path):  # type: ignore[no-untyped-def]
    """Five batches (one file each) of inserts, updates and deletes of
    overlapping keys, checkpointed every batch."""
    _table(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, seq bigint, name text)")
    model = write_feed(tmp_path / "in", files=5, rows_per_file=60, keys=25, seed=7)
    df = spark.readStream.schema(FEED).option("maxFilesPerTrigger", 1).json(str(tmp_path / "in"))
    sink = PostgresSink(pg_dsn, "t", key=["id"], order_by="seq", delete_when=("op", "D"))
    job = Job(spark, "cdc", tmp_path / "state", checkpoint_interval=0)
    job.add_pipeline("feed", df, [sink], bounded=True)
    job.run()
    got = {r[0]: {"id": r[0], "seq": r[1], "name": r[2]} for r in _rows(pg_dsn, "SELECT * FROM t")}
    assert got == model
    assert job_prepared(pg_dsn, "cdc") == []
