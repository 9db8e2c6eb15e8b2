"""The operator's commands (``twophase lingering / recover / abandon``) and the
sink settings they rebuild the sinks from, against real PostgreSQL, the tansu
Kafka broker and Delta tables on local disk, without Spark.

A job's crashed state is made the way a job makes it, without Spark: the real
sinks are preflighted and claimed through a coordinator, executor writers
write and prepare, the ledger records each batch, and Spark's commit log is
written as Spark writes it (``commits/N``). Then the ledger is closed (the
driver is gone) and the commands run as ``twophase`` would run them.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from lifecycle import cli
from lifecycle.coordinator import Coordinator
from lifecycle.errors import CheckpointCommitError
from lifecycle.job_sinks import PipelineSinks
from lifecycle.ledger import FileLedger, Ledger, open_ledger, read_ledger, stored_location
from lifecycle.operations import Operator, lingering
from lifecycle.spark_log import SparkCommitLog
from lifecycle.state.store import LocalStore
from lifecycle.state.store_ledger import StoreLedger, read_store_ledger
from sinks import DeltaSink, KafkaSink, PostgresSink, from_settings
from sinks.base import Committable, JobScope, Sink, WriteContext
from sinks.errors import ConfigError, TransactionLostError
from sinks.kafka.log import read_topic
from sinks.settings import env_name
from tests import deltacheck
from tests.kafkacheck import assert_exactly_once as kafka_exactly_once
from tests.kafkacheck import assert_nothing_open, open_txns
from tests.ledgers import pg_uri
from tests.pgcheck import assert_exactly_once as pg_exactly_once
from tests.pgcheck import job_prepared, rollback_prepared
from tests.procs import twophase

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64())])
PIPELINE = "load"
OTHER = "0123456789ab"  # another incarnation of the same job (a second copy of it)
PG_PASSWORD = "pg-Secret-7f3a"
STORE_SECRET = "store-Secret-91c2"
SASL_PASSWORD = "sasl-Secret-5d0e"


def rows(start: int, n: int) -> pa.RecordBatch:
    ids = list(range(start, start + n))
    return pa.record_batch(
        [pa.array(ids), pa.array([f"name-{i}" for i in ids]), pa.array([i * 0.5 for i in ids])],
        schema=SCHEMA,
    )


def with_password(dsn: str, password: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, password=password)


@dataclass
class State:
    """A job's state_dir and its three sinks, as a crashed driver left them."""

    dir: Path
    job: str
    sinks: dict[str, Sink]
    ledger: Ledger
    coord: Coordinator
    delta_uri: str

    @property
    def incarnation(self) -> str:
        return self.ledger.incarnation

    def write(
        self,
        batch: int,
        *,
        partitions: int = 2,
        first: int = 0,
        incarnation: str | None = None,
        attempt: int | None = None,
    ) -> dict[str, list[Committable]]:
        """Executor tasks write and prepare partitions ``first ..`` of ``batch``
        in every sink (5 rows per partition, ids from ``batch * 10``); nothing
        is registered."""
        out: dict[str, list[Committable]] = {}
        for sid, sink in self.sinks.items():
            for p in range(first, first + partitions):
                scope = JobScope(self.job, PIPELINE, sid, incarnation or self.incarnation)
                at = attempt if attempt is not None else batch * 100 + p
                w = sink.open_writer(WriteContext(scope, self.ledger.run, batch, p, at), SCHEMA)
                w.write(rows(batch * 10 + p * 5, 5))
                c = w.prepare()
                w.close()
                assert c is not None
                out.setdefault(sid, []).append(c)
        return out

    def register(self, batch: int) -> dict[str, list[Committable]]:
        """Write ``batch`` and record it in the ledger (the batch handler's work)."""
        cs = self.write(batch)
        self.coord.register(PIPELINE, batch, cs)
        return cs

    def spark_completed(self, upto: int) -> None:
        """Spark's commit log says batches 0..upto completed."""
        loc = self.dir / "pipelines" / PIPELINE / "spark"
        (loc / "commits").mkdir(parents=True, exist_ok=True)
        (loc / "metadata").write_text("{}")
        for b in range(upto + 1):
            (loc / "commits" / str(b)).write_text("v1\n{}")

    def crash(self) -> None:
        """The driver is gone: the ledger's lock is released, connections dropped."""
        self.ledger.close()
        for s in self.sinks.values():
            s.close()


@pytest.fixture
def make_state(
    pg_dsn: str, kafka_bootstrap: str, kafka_topic: Callable[[int], str], tmp_path: Path
) -> Iterator[Callable[..., State]]:
    made: list[State] = []

    def make(ledger: str | None = None) -> State:
        """A new state; ``ledger``: the job's ``ledger=`` (None: the file ledger in
        the state_dir; a PostgreSQL URI; a directory for the file ledger), or
        ``"store"``: the store ledger a URI state_dir keeps in itself."""
        job = f"op{uuid.uuid4().hex[:8]}"  # the Kafka registry topic is shared
        state_dir = tmp_path / "state"
        delta_uri = str(tmp_path / "delta" / "orders")
        sinks: dict[str, Sink] = {
            "pg": PostgresSink(
                with_password(pg_dsn, PG_PASSWORD), "orders", create_table=True, sink_id="pg"
            ),
            "kafka": KafkaSink(kafka_bootstrap, kafka_topic(2), sink_id="kafka"),
            "delta": DeltaSink(
                delta_uri, sink_id="delta", storage_options={"aws_secret_access_key": STORE_SECRET}
            ),
        }
        for s in sinks.values():
            s.preflight(SCHEMA)
        if ledger == "store":
            led: Ledger = StoreLedger(LocalStore(state_dir), job)
        else:
            led = open_ledger(ledger, state_dir, job)
        led.begin_run()
        led.record_sinks({f"{PIPELINE}/{sid}": s.settings() for sid, s in sinks.items()})
        log = SparkCommitLog(state_dir / "pipelines" / PIPELINE / "spark")
        coord = Coordinator(job, led, [PipelineSinks(PIPELINE, sinks, log)])
        coord.claim_sinks()
        state = State(state_dir, job, sinks, led, coord, delta_uri)
        made.append(state)
        return state

    yield make
    for state in made:
        state.crash()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def kafka_ids(bootstrap: str, topic: str) -> list[int]:
    return sorted(json.loads(r.value)["id"] for r in read_topic(bootstrap, topic).committed)


def pg_ids(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as c:
        return [r[0] for r in c.execute("SELECT id FROM orders ORDER BY id").fetchall()]


# -- settings ---------------------------------------------------------------------------------


def test_settings_round_trip_per_sink(
    pg_dsn: str, kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pg = PostgresSink(
        with_password(pg_dsn, PG_PASSWORD),
        "orders.v1",
        schema="sales",
        key=["id"],
        lock_timeout=30,
        sink_id="pg-1",
    )
    kafka = KafkaSink(
        [kafka_bootstrap],
        "orders",
        key="id",
        headers=["name"],
        transactional_id_prefix="team-a.",
        sink_id="kafka-1",
        producer_config={
            "linger_ms": 20,
            "sasl_mechanism": "PLAIN",
            "sasl_plain_username": "app",
            "sasl_plain_password": SASL_PASSWORD,
        },
    )
    delta = DeltaSink(
        str(tmp_path / "t"),
        partition_by=["name"],
        sink_id="delta-1",
        storage_options={
            "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
            "aws_secret_access_key": STORE_SECRET,
            "AWS_REGION": "eu-west-1",
        },
    )
    for sink in (pg, kafka, delta):
        s = sink.settings()
        assert s["kind"] == sink.kind and s["sink_id"] == sink.sink_id
        for secret in (PG_PASSWORD, SASL_PASSWORD, STORE_SECRET, "AKIAEXAMPLE"):
            assert secret not in repr(s)
    assert kafka.settings()["redacted"] == ["sasl_plain_password"]
    assert delta.settings()["storage_options"] == {"AWS_REGION": "eu-west-1"}

    # secrets from the environment (the default) ...
    monkeypatch.setenv("PGPASSWORD", "from-env")
    monkeypatch.setenv(env_name("kafka-1", "sasl_plain_password"), SASL_PASSWORD)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", STORE_SECRET)  # the object store's usual one
    monkeypatch.setenv("TWOPHASE_DELTA_1_AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    rebuilt = [from_settings(s.settings()) for s in (pg, kafka, delta)]
    for sink, again in zip((pg, kafka, delta), rebuilt, strict=True):
        assert type(again) is type(sink)
        assert again.settings() == sink.settings()
        assert (again.sink_id, again.describe()) == (sink.sink_id, sink.describe())
    pg2, kafka2, delta2 = rebuilt
    assert isinstance(pg2, PostgresSink) and isinstance(kafka2, KafkaSink)
    assert isinstance(delta2, DeltaSink)
    assert psycopg.conninfo.conninfo_to_dict(pg2.dsn)["password"] == "from-env"
    assert (pg2.schema, pg2.table, pg2.key, pg2.lock_timeout) == ("sales", "orders.v1", ["id"], 30)
    assert kafka2.producer_config["sasl_plain_password"] == SASL_PASSWORD
    assert kafka2.id_prefix == "team-a." and kafka2.headers == ["name"]
    assert delta2.storage_options == {
        "AWS_REGION": "eu-west-1",
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
        "aws_secret_access_key": STORE_SECRET,
    }

    # ... or from a mapping; the per-sink variable wins over the shared one
    secrets = {"TWOPHASE_PG_1_PASSWORD": "per-sink", "PGPASSWORD": "shared"}
    again = from_settings(pg.settings(), secrets)
    assert isinstance(again, PostgresSink)
    assert psycopg.conninfo.conninfo_to_dict(again.dsn)["password"] == "per-sink"
    with pytest.raises(ConfigError, match="TWOPHASE_KAFKA_1_SASL_PLAIN_PASSWORD or "):
        from_settings(kafka.settings(), {})
    odd = KafkaSink(kafka_bootstrap, "t", producer_config={"ssl_context": object()})
    assert odd.settings()["omitted"] == ["ssl_context"]  # not a JSON value: left out, named
    assert "ssl_context" not in from_settings(odd.settings(), {}).producer_config  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="cannot be rebuilt"):
        from_settings({"kind": "recording", "sink_id": "s"}, {})

    # a rebuilt sink reaches its target: the PostgreSQL one (trust auth) and Delta
    real = from_settings(PostgresSink(pg_dsn, "o", sink_id="pg", create_table=True).settings())
    real.preflight(SCHEMA)  # connects (PGPASSWORD is ignored by a trusting server), creates
    assert real.committer().progress(JobScope("j", "p", "pg", OTHER)).owner is None
    delta.preflight(pa.schema([("id", pa.int64()), ("name", pa.string())]))
    assert delta2.committer().progress(JobScope("j", "p", "delta-1", OTHER)).owner is None


def test_the_ledger_holds_no_secret(
    make_state: Callable[..., State], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sinks built with a password in the DSN, a secret storage option and a SASL
    password: the ledger's files (journal, and the snapshot after a compaction)
    hold none of them, yet `twophase` reaches the sinks with the environment's."""
    state = make_state()
    kafka = KafkaSink(
        "127.0.0.1:1",
        "t",
        sink_id="sasl",
        producer_config={"sasl_mechanism": "PLAIN", "sasl_plain_password": SASL_PASSWORD},
    )
    recorded = {f"{PIPELINE}/{sid}": s.settings() for sid, s in state.sinks.items()}
    state.ledger.record_sinks({**recorded, "other/sasl": kafka.settings()})
    state.register(0)
    state.crash()

    def files() -> bytes:
        return b"".join(p.read_bytes() for p in sorted(state.dir.rglob("*")) if p.is_file())

    secrets = (PG_PASSWORD, STORE_SECRET, SASL_PASSWORD)
    for secret in secrets:
        assert secret.encode() not in files()
    doc = read_ledger(state.dir)
    assert doc is not None and doc["sinks"]["other/sasl"]["redacted"] == ["sasl_plain_password"]
    assert doc["sinks"][f"{PIPELINE}/pg"]["dsn"] == state.sinks["pg"].settings()["dsn"]
    led = FileLedger(state.dir / "ledger", state.job, compact_bytes=1)
    assert led.record_sinks(recorded)  # the job's sinks again: "other/sasl" is gone
    for b in range(100):  # until the journal outgrows the snapshot: a compaction
        led.record_spark_completed(PIPELINE, b)
        if led.generation:
            break
    assert led.generation > 0 and led.sinks_settings() == recorded
    led.close()
    for secret in secrets:
        assert secret.encode() not in files()
    # the secrets the job was given are not needed to list its work: the PostgreSQL
    # server trusts loopback, and the Delta option comes from the environment
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", STORE_SECRET)
    _, found = lingering(state.dir)
    assert {f.label for f in found} == {f"{PIPELINE}/{s}" for s in ("pg", "kafka", "delta")}


# -- lingering --------------------------------------------------------------------------------


def test_lingering_lists_each_sinks_work_with_the_ledger_view(
    make_state: Callable[..., State], capsys: pytest.CaptureFixture[str]
) -> None:
    state = make_state()
    decided = state.register(0)
    state.spark_completed(0)
    cp = state.ledger.decide("periodic", {PIPELINE: 0}, [])  # crash before the commit
    pending = state.register(1)
    orphan = state.write(2, partitions=1)  # prepared, never registered
    foreign = state.write(0, partitions=1, incarnation=OTHER, attempt=999)
    state.crash()

    doc, found = lingering(state.dir)
    assert doc["job"] == state.job
    views = {(f.label.split("/")[1], f.txn.txn): (f.ours, f.view, f.txn.state) for f in found}
    expected_state = {"pg": "prepared", "kafka": "open", "delta": "staged"}
    want: dict[tuple[str, str], tuple[bool, str]] = {}
    for sid in ("pg", "kafka", "delta"):
        for c in decided[sid]:
            want[(sid, c["txn"])] = (True, f"part of decided checkpoint {cp.id} (batch 0)")
        for c in pending[sid]:
            want[(sid, c["txn"])] = (True, "owned by pending batch 1")
        for c in orphan[sid]:
            want[(sid, c["txn"])] = (True, "unowned: an orphan the next start aborts")
        for c in foreign[sid]:
            want[(sid, c["txn"])] = (False, f"another incarnation's ({OTHER})")
    assert set(views) == set(want)
    for key, (ours, view) in want.items():
        got_ours, got_view, got_state = views[key]
        assert got_ours is ours and got_view.startswith(view), (key, got_view)
        assert got_state == expected_state[key[0]], key

    code, out, _ = run_cli(capsys, "lingering", str(state.dir))
    assert code == 1
    assert f"incarnation {state.incarnation} (this state)" in out
    for sid in ("pg", "kafka", "delta"):
        assert f"{PIPELINE}/{sid}  (" in out
    for _sid, txn in want:
        assert txn in out
    assert f"{len(want)} lingering: {len(want) - 3} of this incarnation, 3 of others" in out
    assert "prepared at " in out and "staged file(s)" in out and "announced on registry" in out


def test_lingering_and_recover_with_the_ledger_in_postgresql(
    make_state: Callable[..., State],
    pg_dsn: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job whose ledger is in PostgreSQL: `twophase lingering --ledger URI`
    needs no STATE_DIR, and finds the same through STATE_DIR/ledger.location;
    `twophase recover --ledger URI` holds that ledger and settles the state."""
    uri = pg_uri(pg_dsn)
    state = make_state(uri)
    assert not (state.dir / "ledger").exists() and stored_location(state.dir) is not None
    decided = state.register(0)
    state.spark_completed(0)
    cp = state.ledger.decide("periodic", {PIPELINE: 0}, [])  # crash before the commit
    pending = state.register(1)  # Spark never completed batch 1
    state.crash()
    txns = {c["txn"] for cs in (*decided.values(), *pending.values()) for c in cs}

    code, out, err = run_cli(capsys, "lingering", "--ledger", uri)
    assert code == 1, err
    assert f"job {state.job}  incarnation {state.incarnation} (this state)" in out
    assert all(t in out for t in txns)
    assert f"part of decided checkpoint {cp.id} (batch 0)" in out
    assert "owned by pending batch 1" in out
    assert f"{len(txns)} lingering: {len(txns)} of this incarnation, 0 of others" in out
    assert run_cli(capsys, "lingering", str(state.dir))[1] == out  # via ledger.location
    code, _, err = run_cli(capsys, "lingering", str(tmp_path / "elsewhere"))
    assert code == 2 and "no ledger in" in err
    code, _, err = run_cli(capsys, "lingering")
    assert code == 2 and "needs a STATE_DIR or --ledger URI" in err

    held = open_ledger(uri, state.dir, state.job)  # a job holds the ledger
    code, _, err = run_cli(capsys, "recover", str(state.dir), "--ledger", uri)
    assert code == 2 and "in use by another process" in err
    held.close()
    code, out, err = run_cli(capsys, "recover", str(state.dir), "--ledger", uri)
    assert code == 0, err
    assert f"checkpoint {cp.id} (periodic) committed (finished before the stop)" in out
    assert f"aborted   {PIPELINE}/pg: 2 transaction(s)" in out  # batch 1
    pg_exactly_once(pg_dsn, "orders", 10)
    doc = read_ledger(location=uri)
    assert doc is not None and doc["pending"] == {} and doc["decided"] is None
    assert set(doc["sinks"]) == {f"{PIPELINE}/{s}" for s in ("pg", "kafka", "delta")}
    code, out, _ = run_cli(capsys, "lingering", "--ledger", uri)
    assert (code, out.splitlines()[-1]) == (0, "nothing lingering")


@pytest.mark.parametrize("kind", ["dir", "postgres", "store"])
def test_operations_on_a_uri_state_dir(
    make_state: Callable[..., State], pg_dsn: str, tmp_path: Path, kind: str
) -> None:
    """STATE_DIR given as a ``file://`` URI: the commands read its files
    (``ledger.location``, Spark's commit log) through Hadoop, in a JVM of their
    own. The ledger is a file ledger in a directory of its own (``--ledger
    DIR``; the URI records nothing of it), in PostgreSQL (found through the
    URI's ``ledger.location``, or named by ``--ledger URI``), or the URI's own
    store ledger (found in it)."""
    ledger_dir = tmp_path / "ledger-host"
    made = {"dir": str(ledger_dir), "postgres": pg_uri(pg_dsn), "store": "store"}
    state = make_state(made[kind])
    assert (state.dir / "ledger").exists() == (kind == "store")
    done = state.register(0)
    state.spark_completed(0)  # read through Hadoop by recover
    undone = state.register(1)  # Spark never completed batch 1
    state.crash()
    txns = {c["txn"] for cs in (*done.values(), *undone.values()) for c in cs}
    uri = state.dir.as_uri()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    ledger: list[str] = []
    if kind == "dir":
        ledger = ["--ledger", str(ledger_dir)]
        bare = twophase("lingering", uri, cwd=cwd)
        assert bare.returncode == 2 and "--ledger" in bare.stderr, bare.stderr
    elif kind == "postgres":
        ledger = ["--ledger", pg_uri(pg_dsn)]
        via_record = twophase("status", uri, cwd=cwd)  # through ledger.location
        # exit 3: not running, with pending work for the next start
        assert via_record.returncode == 3, via_record.stderr
        assert f"job {state.job}  incarnation {state.incarnation}" in via_record.stdout

    found = twophase("lingering", uri, *ledger, cwd=cwd)
    assert found.returncode == 1, found.stderr
    assert all(t in found.stdout for t in txns)
    assert f"{len(txns)} lingering: {len(txns)} of this incarnation" in found.stdout
    refused = twophase("abandon", uri, "--checkpoint", "1", "--yes", *ledger, cwd=cwd)
    assert refused.returncode == 1 and "checkpoint 1 is not the decided one" in refused.stderr
    recovered = twophase("recover", uri, *([] if kind == "postgres" else ledger), cwd=cwd)
    assert recovered.returncode == 0, recovered.stderr
    assert f"committed {PIPELINE}/pg: 2 transaction(s)" in recovered.stdout  # batch 0
    assert f"aborted   {PIPELINE}/pg: 2 transaction(s)" in recovered.stdout  # batch 1
    pg_exactly_once(pg_dsn, "orders", 10)
    assert job_prepared(pg_dsn, state.job) == []
    deltacheck.assert_exactly_once(state.delta_uri, 10)
    deltacheck.assert_nothing_staged(state.delta_uri)
    if kind == "store":
        doc = read_store_ledger(LocalStore(state.dir))
    else:
        where = str(ledger_dir) if kind == "dir" else f"{pg_uri(pg_dsn)}?job={state.job}"
        doc = read_ledger(location=where)
    assert doc is not None and doc["pending"] == {} and doc["decided"] is None
    assert doc["totals"] == {f"{PIPELINE}/{s}": 10 for s in ("pg", "kafka", "delta")}
    assert os.listdir(cwd) == []  # no URI taken for a local path
    kept = {"dir": [], "postgres": ["ledger.location"], "store": ["ledger"]}[kind]
    assert sorted(os.listdir(state.dir)) == [*kept, "pipelines"]


# -- recover ----------------------------------------------------------------------------------


def test_recover_settles_a_crashed_state_without_running_the_job(
    make_state: Callable[..., State],
    pg_dsn: str,
    kafka_bootstrap: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Checkpoint 1 (batch 0) decided and committed to Kafka only; batch 1
    completed by Spark, batch 2 not; an orphan of batch 1. `twophase recover`
    commits batches 0 and 1 exactly once everywhere and leaves nothing behind."""
    state = make_state()
    b0 = state.register(0)
    state.spark_completed(0)
    cp = state.ledger.decide("periodic", {PIPELINE: 0}, [])
    state.sinks["kafka"].committer().commit(b0["kafka"])  # then the driver died
    state.register(1)
    state.spark_completed(1)
    b2 = state.register(2)
    # a task of batch 1 whose result never reached the driver (another partition:
    # a new attempt of a partition supersedes the earlier ones in PostgreSQL)
    orphan = state.write(1, partitions=1, first=7, attempt=777)
    topic = state.sinks["kafka"].topic  # type: ignore[attr-defined]
    state.crash()

    held = FileLedger(state.dir / "ledger", state.job)  # a job holds the ledger
    code, _, err = run_cli(capsys, "recover", str(state.dir))
    assert code == 2 and "in use by another process" in err
    held.close()

    code, out, err = run_cli(capsys, "recover", str(state.dir))
    assert code == 0, err
    assert f"checkpoint {cp.id} (periodic) committed (finished before the stop)" in out
    assert "(recovery) committed" in out
    for sid in ("pg", "kafka", "delta"):
        assert f"committed {PIPELINE}/{sid}" in out
        assert f"aborted   {PIPELINE}/{sid}: 2 transaction(s)" in out  # batch 2
        assert f"swept     {PIPELINE}/{sid}: 1 transaction(s): {orphan[sid][0]['txn']}" in out
        assert b2[sid][0]["txn"] in out
    assert "recovered: nothing pending, no checkpoint decided" in out

    pg_exactly_once(pg_dsn, "orders", 20)
    assert job_prepared(pg_dsn, state.job) == []
    kafka_exactly_once(kafka_bootstrap, topic, 20, keyed=False)
    assert_nothing_open(kafka_bootstrap, topic, state.job)
    deltacheck.assert_exactly_once(state.delta_uri, 20)
    deltacheck.assert_nothing_staged(state.delta_uri)
    doc = read_ledger(state.dir)
    assert doc is not None and doc["pending"] == {} and doc["decided"] is None
    assert [c["kind"] for c in doc["history"]] == ["periodic", "recovery"]
    assert doc["totals"] == {f"{PIPELINE}/{s}": 20 for s in ("pg", "kafka", "delta")}

    code, out, _ = run_cli(capsys, "lingering", str(state.dir))
    assert (code, out.splitlines()[-1]) == (0, "nothing lingering")
    code, out, _ = run_cli(capsys, "recover", str(state.dir))
    assert code == 0 and "nothing to recover" in out


# -- abandon ----------------------------------------------------------------------------------


def test_abandon_a_lost_transaction_lets_the_rest_of_the_checkpoint_commit(
    make_state: Callable[..., State],
    pg_dsn: str,
    kafka_bootstrap: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = make_state()
    b0 = state.register(0)
    state.spark_completed(0)
    cp = state.ledger.decide("periodic", {PIPELINE: 0}, [])  # crash before the commit
    topic = state.sinks["kafka"].topic  # type: ignore[attr-defined]
    state.crash()
    lost = sorted(c["txn"] for c in b0["pg"])

    code, _, err = run_cli(capsys, "abandon", str(state.dir), "--checkpoint", "1", "--yes")
    assert code == 1 and "nothing in checkpoint 1 is lost" in err  # nothing lost yet

    rollback_prepared(pg_dsn, state.job)  # someone else's hand
    before = read_ledger(state.dir)
    code, _, err = run_cli(capsys, "abandon", str(state.dir), "--checkpoint", "2", "--yes")
    assert code == 1 and "checkpoint 2 is not the decided one" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    code, out, _ = run_cli(capsys, "abandon", str(state.dir), "--checkpoint", str(cp.id))
    assert code == 1 and "not abandoned: nothing changed" in out
    assert f"abandon 2 transaction(s) of checkpoint {cp.id}? [y/N]" in out
    for txn in lost:
        assert f"{PIPELINE}/pg  {txn}  5 row(s)" in out
    assert "abandoning loses 10 row(s)" in out
    assert f"{PIPELINE}/kafka: 2 prepared (10 row(s))" in out
    assert f"{PIPELINE}/pg: 2 lost (10 row(s))" in out
    assert read_ledger(state.dir) == before  # nothing changed
    assert kafka_ids(kafka_bootstrap, topic) == []
    assert deltacheck.read_rows(state.delta_uri).num_rows == 0

    with Operator(state.dir) as op, pytest.raises(CheckpointCommitError) as failed:
        op.recover()  # what every start of the job does first
    assert isinstance(failed.value.__cause__, TransactionLostError)
    code, _, err = run_cli(capsys, "recover", str(state.dir))
    assert code == 1 and "gone without having been committed" in err
    assert f"twophase abandon {state.dir} --checkpoint {cp.id}" in err
    # the decision is final: the other sinks committed their part, the checkpoint
    # cannot complete
    assert kafka_ids(kafka_bootstrap, topic) == list(range(10))
    doc = read_ledger(state.dir)
    assert doc is not None and doc["decided"]["id"] == cp.id and doc["abandoned"] == []

    code, out, err = run_cli(capsys, "abandon", str(state.dir), "--checkpoint", str(cp.id), "--yes")
    assert code == 0, err
    assert f"{PIPELINE}/kafka: 2 committed (10 row(s))" in out
    assert "abandoned: recorded in the ledger's history" in out
    code, out, err = run_cli(capsys, "recover", str(state.dir))
    assert code == 0, err
    assert f"skipped   {PIPELINE}/pg: 2 transaction(s)" in out

    kafka_exactly_once(kafka_bootstrap, topic, 10, keyed=False)
    assert open_txns(kafka_bootstrap, state.job, settle=5) == []
    deltacheck.assert_exactly_once(state.delta_uri, 10)
    deltacheck.assert_nothing_staged(state.delta_uri)
    assert pg_ids(pg_dsn) == [] and job_prepared(pg_dsn, state.job) == []
    doc = read_ledger(state.dir)
    assert doc is not None and doc["decided"] is None and doc["pending"] == {}
    assert [(a["checkpoint"], sorted(a["txns"])) for a in doc["abandoned"]] == [(cp.id, lost)]
    assert "10 row(s) not written (load/pg: 10)" in doc["abandoned"][0]["note"]
    assert doc["history"][-1]["id"] == cp.id
    assert doc["history"][-1]["rows"] == {
        f"{PIPELINE}/kafka": 10,
        f"{PIPELINE}/delta": 10,
        f"{PIPELINE}/pg": 0,
    }
    code, out, _ = run_cli(capsys, "status", str(state.dir))
    assert "abandoned (an operator gave these transactions up):" in out
    assert all(txn in out for txn in lost)
    code, _, err = run_cli(capsys, "abandon", str(state.dir), "--checkpoint", str(cp.id), "--yes")
    assert code == 1 and "no checkpoint is being committed" in err
