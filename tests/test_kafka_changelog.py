"""Keyed writes to Kafka (``order_by`` / ``delete_when``): a changelog topic.

After each checkpoint the topic read as a compacted table (the last committed
record per key, a tombstone removing the key) must equal the dictionary model,
decided from the raw log's control markers (:mod:`lifecycle.testing.verify`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from lifecycle import Job
from lifecycle.testing import verify
from sinks import DuplicateKeyError, KafkaSink, NullKeyError, PostgresSink
from sinks.base import JobScope, WriteContext
from tests.changefeed import SCHEMA as FEED
from tests.changefeed import write_feed
from tests.pgcheck import job_prepared


def _table_of(bootstrap: str, topic: str, job: str) -> dict[int, Any]:
    """The topic as a compacted table: key -> the last committed value (JSON
    decoded, or the bytes), tombstones removing keys."""
    log = verify.assert_nothing_left_kafka(bootstrap, topic, job)
    table: dict[int, Any] = {}
    for r in sorted(log.committed, key=lambda r: (r.partition, r.offset)):
        assert r.key is not None
        k = int(r.key)
        if r.value is None:
            table.pop(k, None)
        else:
            table[k] = json.loads(r.value) if r.value[:1] == b"{" else r.value
    return table


def test_a_change_feed_in_kafka_and_postgres_equals_the_model(  # type: ignore[no-untyped-def]
    spark, kafka_bootstrap, kafka_topic, pg_dsn, tmp_path
):
    """One feed of inserts, updates and deletes of overlapping keys, written to
    a changelog topic (JSON values) and a PostgreSQL table in one job."""
    model = write_feed(tmp_path / "in", files=5, rows_per_file=80, keys=30, seed=11)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, seq bigint, name text)")
    topic = kafka_topic(3)
    name = f"kcl{uuid.uuid4().hex[:8]}"
    rules: dict[str, Any] = {"order_by": "seq", "delete_when": ("op", "D")}
    kafka = KafkaSink(kafka_bootstrap, topic, key="id", headers=["op"], **rules)
    pg = PostgresSink(pg_dsn, "t", key=["id"], **rules)
    df = spark.readStream.schema(FEED).option("maxFilesPerTrigger", 1).json(str(tmp_path / "in"))
    job = Job(spark, name, tmp_path / "state", checkpoint_interval=0)
    job.add_pipeline("feed", df, [kafka, pg], bounded=True)
    job.run()
    assert _table_of(kafka_bootstrap, topic, name) == model
    with psycopg.connect(pg_dsn) as c:
        rows = c.execute("SELECT id, seq, name FROM t").fetchall()
    assert {r[0]: {"id": r[0], "seq": r[1], "name": r[2]} for r in rows} == model
    assert job_prepared(pg_dsn, name) == []
    # one record per key and batch (the batch's winner), its op as a header
    log = verify.read_settled(kafka_bootstrap, topic)
    per_batch = [(r.key, r.producer_id, r.producer_epoch) for r in log.committed]
    assert len(per_batch) == len(set(per_batch))
    ops = {dict(r.headers)["op"] for r in log.committed}
    assert ops <= {b"I", b"U", b"D"} and b"D" in ops
    assert any(r.value is None and dict(r.headers)["op"] == b"D" for r in log.committed)


def _writer(sink: KafkaSink, batch_id: int = 0):  # type: ignore[no-untyped-def]
    scope = JobScope(f"kw{uuid.uuid4().hex[:6]}", "p", sink.sink_id, "0123456789ab")
    return sink.open_writer(WriteContext(scope, 1, batch_id, 0, 1), pa.schema([]))


def test_tombstones_with_a_value_column(kafka_bootstrap, kafka_topic):  # type: ignore[no-untyped-def]
    """``value=`` mode: a delete is the key and a null value, whatever the
    value column holds; batches come sorted by key, as Spark sorts them."""
    topic = kafka_topic(1)
    sink = KafkaSink(kafka_bootstrap, topic, key="id", value="body", delete_when="gone")
    batch = pa.RecordBatch.from_pydict(
        {"id": [1, 2, 3], "body": ["a", "b", "c"], "gone": [False, True, False]}
    )
    sink.preflight(batch.schema)
    w = _writer(sink)
    w.write(batch)
    c = w.prepare()
    w.close()
    sink.committer().commit([c])
    log = verify.read_settled(kafka_bootstrap, topic)
    assert [(r.key, r.value) for r in log.committed] == [(b"1", b"a"), (b"2", None), (b"3", b"c")]


def test_a_delete_with_a_null_key_is_an_error(kafka_bootstrap, kafka_topic):  # type: ignore[no-untyped-def]
    topic = kafka_topic(1)
    sink = KafkaSink(kafka_bootstrap, topic, key="id", delete_when=("op", "D"))
    w = _writer(sink)
    with pytest.raises(NullKeyError, match=r"null in key column 'id'"):
        w.write(pa.RecordBatch.from_pydict({"id": [None, 1], "op": ["D", "I"]}))
    w.close(failed=True)
    assert verify.read_settled(kafka_bootstrap, topic).committed == []


def test_different_rows_of_one_key_need_order_by(kafka_bootstrap, kafka_topic):  # type: ignore[no-untyped-def]
    topic = kafka_topic(1)
    sink = KafkaSink(kafka_bootstrap, topic, key="id", delete_when="gone")
    w = _writer(sink)
    with pytest.raises(DuplicateKeyError, match=r"\(id=4\).*order_by="):
        w.write(pa.RecordBatch.from_pydict({"id": [4, 4], "gone": [False, True]}))
        w.prepare()
    w.close(failed=True)
    assert verify.read_settled(kafka_bootstrap, topic).committed == []
