"""``twophase audit``: the ledger's evidence checked against each sink's own records,
after a real run, then after tampering with each sink's evidence: a PostgreSQL
marker row changed or deleted, a Delta version's commit rewritten or cleaned up,
a Kafka transaction the broker aborted. Also the evidence window: older
checkpoints are reported beyond it, and PostgreSQL keeps the markers of the
window only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from lifecycle import Job
from lifecycle.audit import audit, format_report
from lifecycle.cli import main as twophase
from lifecycle.ledger import read_ledger
from lifecycle.operations import rebuild_sinks
from sinks import DeltaSink, KafkaSink, PostgresSink
from sinks.audit import CheckpointEvidence, Verdict
from sinks.base import JobScope
from tests.conftest import write_input
from tests.test_kafka_unit import SCHEMA as SCHEMA_ARROW
from tests.test_kafka_unit import ctx, rows, write_task
from tests.test_lifecycle import create_tables

SCHEMA = "id long, name string, amount double"


def _run(spark: Any, state: Path, sinks: list[Any], src_dir: Path, **job: Any) -> None:
    j = Job(spark, "audited", state, checkpoint_interval=0, progress="off", **job)
    src = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(src_dir))
    j.add_pipeline("load", src, sinks, bounded=True)
    assert j.run(handle_signals=False).committed


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = twophase(["audit", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_audit_after_a_run_then_with_each_sink_tampered(  # type: ignore[no-untyped-def]
    spark, pg_dsn, kafka_bootstrap, kafka_topic, tmp_path, capsys
):
    create_tables(pg_dsn, "out")
    topic = kafka_topic(2)
    delta = tmp_path / "delta"
    n = write_input(tmp_path / "in", 4, 30)
    state = tmp_path / "state"
    _run(
        spark,
        state,
        [
            PostgresSink(pg_dsn, "out", sink_id="pg"),
            KafkaSink(kafka_bootstrap, topic, key="id", sink_id="kafka"),
            DeltaSink(str(delta), sink_id="delta"),
        ],
        tmp_path / "in",
    )
    code, out = _cli(capsys, str(state), "--all")
    assert code == 0, out
    doc = read_ledger(state)
    assert doc is not None
    checkpoints = [cp for cp in doc["history"] if cp.get("evidence")]
    assert len(checkpoints) >= 2, doc["history"]
    assert "mismatch" not in out.lower() and "ok" in out
    report = json.loads(_cli(capsys, str(state), "--all", "--json")[1])
    assert report["schema"] == "twophase.audit/1" and report["ok"] is True
    verdicts = {(c["sink"], c["verdict"]) for c in report["checks"]}
    assert verdicts == {("load/pg", "ok"), ("load/kafka", "ok"), ("load/delta", "ok")}
    assert sum(c["rows"] for c in report["checks"] if c["sink"] == "load/pg") == n

    # PostgreSQL: a marker row that says other numbers, then one that is gone
    gid = checkpoints[0]["evidence"]["load/pg"][0]["txn"]
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        markers = c.execute("SELECT count(*) FROM twophase.committed_txns").fetchone()
        assert markers is not None and markers[0] > 0
        c.execute("UPDATE twophase.committed_txns SET rows = rows + 1 WHERE gid = %s", (gid,))
    code, out = _cli(capsys, str(state), "--all")
    assert code == 1 and f"MISMATCH checkpoint #{checkpoints[0]['id']} load/pg {gid}" in out, out
    assert "the marker says batch" in out
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("DELETE FROM twophase.committed_txns WHERE gid = %s", (gid,))
    code, out = _cli(capsys, str(state), "--all")
    assert code == 1 and "no commit-marker row" in out, out

    # Delta: a version's commit rewritten without one of its files
    last = checkpoints[-1]
    dtxn = last["evidence"]["load/delta"][0]
    commits = sorted((delta / "_delta_log").glob("*.json"))
    name = dtxn["files"][0].split("/")[-1]
    target = next(f for f in commits if name in f.read_text())
    lines = target.read_text().splitlines()
    target.write_text("\n".join(ln for ln in lines if name not in ln) + "\n")
    code, out = _cli(capsys, str(state), "--all")
    assert code == 1 and f"load/delta {dtxn['txn']}" in out and "does not add" in out, out


def test_a_kafka_transaction_the_broker_aborted_is_a_mismatch(
    kafka_bootstrap: str, kafka_topic: Any
) -> None:
    """Evidence of transactions written by the real writer: one committed, one
    aborted by the broker (EndTxn abort), one whose row count the ledger would
    have wrong. Only the first is ``ok``."""
    topic = kafka_topic(2)
    sink = KafkaSink(kafka_bootstrap, topic, key="id", sink_id="k")
    sink.preflight(SCHEMA_ARROW)
    scope = JobScope("kaudit", "p", "k", "inc0000001")
    try:
        done = write_task(sink, ctx("kaudit", 0, batch=0), [rows(0, 20)])
        lost = write_task(sink, ctx("kaudit", 1, batch=0), [rows(20, 10)])
        assert done is not None and lost is not None
        sink.committer().commit([done])
        sink.committer().abort([lost])
        wrong = {**done, "rows": done["rows"] + 1}
        evidence = [sink.committer().evidence(c) for c in (done, lost, wrong)]
        found = sink.committer().audit(scope, [CheckpointEvidence(1, 0.0, evidence)])
    finally:
        sink.close()
    verdicts = [(f.txn, f.verdict) for f in found]
    assert verdicts == [
        (done["txn"], Verdict.OK),
        (lost["txn"], Verdict.MISMATCH),
        (done["txn"], Verdict.MISMATCH),
    ], found
    assert "ABORT marker" in found[1].detail
    assert "the ledger says 21" in found[2].detail


def test_kafka_records_deleted_by_delete_records_are_expired_not_a_mismatch(
    twophase_apache_kafka: Any,
) -> None:
    """Apache Kafka's DeleteRecords (what retention does by time) removes the
    first transaction's records: its evidence is ``expired``, the second one's
    still ``ok``, and the report passes."""
    from kafka import KafkaAdminClient, TopicPartition

    from tests.test_apache_kafka import _topic

    bootstrap = twophase_apache_kafka.bootstrap
    topic = _topic(bootstrap, partitions=1)
    sink = KafkaSink(bootstrap, topic, key="id", sink_id="k")
    sink.preflight(SCHEMA_ARROW)
    scope = JobScope("kexpire", "p", "k", "inc0000001")
    try:
        old = write_task(sink, ctx("kexpire", 0, batch=0), [rows(0, 20)])
        assert old is not None
        sink.committer().commit([old])
        new = write_task(sink, ctx("kexpire", 0, batch=1), [rows(20, 10)])
        assert new is not None
        sink.committer().commit([new])
        first_new = min(first for first, _ in new["partitions"].values())
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        try:
            admin.delete_records({TopicPartition(topic, 0): first_new})
        finally:
            admin.close()
        evidence = [
            CheckpointEvidence(i + 1, 0.0, [sink.committer().evidence(c)])
            for i, c in enumerate([old, new])
        ]
        found = sink.committer().audit(scope, evidence)
    finally:
        sink.close()
    assert [(f.txn, f.verdict) for f in found] == [
        (old["txn"], Verdict.EXPIRED),
        (new["txn"], Verdict.OK),
    ], found


def test_the_evidence_window_and_expired_delta_versions(  # type: ignore[no-untyped-def]
    spark, pg_dsn, tmp_path, capsys
):
    """``audit_checkpoints=3``: the ledger keeps three checkpoints' evidence, the
    PostgreSQL sink the markers of those only; a Delta log cleaned up below a
    checkpoint makes its older versions ``expired``, not a mismatch."""
    create_tables(pg_dsn, "out")
    delta = tmp_path / "delta"
    write_input(tmp_path / "in", 5, 10)
    state = tmp_path / "state"
    _run(
        spark,
        state,
        [PostgresSink(pg_dsn, "out", sink_id="pg"), DeltaSink(str(delta), sink_id="delta")],
        tmp_path / "in",
        audit_checkpoints=3,
    )
    doc = read_ledger(state)
    assert doc is not None
    assert len(doc["history"]) == 3 and doc["history"][0]["id"] > 1
    kept = {c["txn"] for cp in doc["history"] for c in cp["evidence"].get("load/pg", [])}
    with psycopg.connect(pg_dsn) as c:
        markers = {r[0] for r in c.execute("SELECT gid FROM twophase.committed_txns")}
    assert markers == kept  # the markers of the checkpoints beyond the window are gone
    code, out = _cli(capsys, str(state))
    assert code == 0 and "older one(s) beyond the window" in out, out
    # an operator's command on the ledger keeps the job's window (it does not trim it)
    assert twophase(["recover", str(state)]) == 0
    capsys.readouterr()
    again = read_ledger(state)
    assert again is not None and again["limits"]["history"] == 3 and len(again["history"]) == 3

    # Delta log cleanup: a checkpoint of the table, then every commit file before it
    dt = DeltaTable(str(delta))
    dt.create_checkpoint()
    newest = dt.version()
    for f in (delta / "_delta_log").glob("*.json"):
        if int(f.stem) < newest:
            f.unlink()
    sinks = rebuild_sinks(doc["sinks"])
    report = audit(doc, sinks, last=None)
    text = format_report(report)
    by_sink = {(c.checkpoint, c.sink): c.verdict for c in report.checks}
    first, second = (cp["id"] for cp in doc["history"] if "load/delta" in cp["evidence"])
    assert by_sink[(first, "load/delta")] is Verdict.EXPIRED, text
    assert by_sink[(second, "load/delta")] is Verdict.OK, text
    assert report.ok, text  # expired is not a mismatch


def test_checkpoints_without_evidence_say_so() -> None:
    doc = {
        "job": "j",
        "incarnation": "i",
        "next_checkpoint": 3,
        "history": [
            {"id": 2, "kind": "periodic", "committed_at": 1.0, "rows": {"p/s": 5}},
        ],
        "sinks": {},
    }
    report = audit(doc, {}, last=None)
    assert report.ok and report.older == 1
    assert [c.verdict for c in report.checks] == [Verdict.UNVERIFIABLE]
    assert "kept none" in format_report(report)
