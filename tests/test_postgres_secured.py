"""PostgreSQL secured as production runs it: TLS checked by the client
(``sslmode=verify-full``), a role with a password and exactly the least grants.

The suite's server serves TLS (``lifecycle/testing/postgres_tls.py``); the
role here may connect only over TLS with its password (``pg_hba``), and holds
exactly the privileges of :func:`sinks.postgres.access.required` and
:func:`lifecycle.state.pg_access.required` (granted by their ``setup_sql``),
in a database where PUBLIC's defaults (CONNECT, USAGE on ``public``, SELECT on
``pg_prepared_xacts``) are revoked. The list is derived from both sides:

* each privilege of it is needed: without it the sink's preflight, or the
  ledger's opening, fails naming it and its ``GRANT``, and only it; what the
  job creates (the marker tables, the ledger's tables, their schemas) needs
  CREATE where it goes instead, named the same way;
* it is enough: every path of the sink (an append, an upsert with deletes, a
  replace: writes, commits, classification, sweeps, audits, retirement) and
  every change of the ledger runs as the role in-process; and a job killed
  by the kit's ``crash_test`` ends with every row once, nothing prepared, and
  the password in no log, state file, Spark checkpoint, ledger row or
  ``twophase status`` / ``audit`` output.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from lifecycle.ledger import read_ledger
from lifecycle.state import pg_access
from lifecycle.state.pg_ledger import PostgresLedger
from lifecycle.testing import crash_test
from lifecycle.testing.plugin import fresh_database
from lifecycle.testing.postgres_server import PostgresServer
from lifecycle.testing.postgres_tls import create_role
from lifecycle.testing.verify import assert_exactly_once_postgres, prepared_postgres
from sinks import PostgresSink, PreflightError
from sinks.audit import CheckpointEvidence, Verdict
from sinks.base import JobScope, Outcome, WriteContext
from sinks.errors import ConfigError
from sinks.postgres import access
from sinks.postgres.grants import Grant, quote
from tests.conftest import write_input
from tests.procs import ROOT, twophase
from tests.tiers import SLOW

PASSWORD_ENV = "TWOPHASE_TEST_PG_PASSWORD"
JOB = ROOT / "tests" / "jobs" / "pg_job.py"
KINDS = {"database": "DATABASE", "schema": "SCHEMA", "table": "TABLE"}
ORDERS = "CREATE TABLE orders (id bigint PRIMARY KEY, name text, amount float8)"
SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64())])
A = "0123456789ab"  # an incarnation


class Secured:
    """A fresh database, and a role that may connect to it only over TLS,
    with its password, holding nothing until :meth:`grant`."""

    def __init__(self, server: PostgresServer, admin_dsn: str) -> None:
        self.admin = admin_dsn  # a superuser, on the database
        self.db = str(conninfo_to_dict(admin_dsn)["dbname"])
        self.role = f"writer_{uuid.uuid4().hex[:8]}"
        self.password = f"pw-{uuid.uuid4().hex}"
        create_role(server.dsn(), self.role, self.password)
        self.dsn = server.tls_dsn(self.role, self.db)  # the password goes separately
        self.run(
            f"REVOKE ALL ON DATABASE {quote(self.db)} FROM PUBLIC",
            "REVOKE ALL ON SCHEMA public FROM PUBLIC",
            "REVOKE ALL ON pg_catalog.pg_prepared_xacts FROM PUBLIC",
        )

    def run(self, *statements: str) -> None:
        with psycopg.connect(self.admin, autocommit=True) as c:
            for s in statements:
                c.execute(s)  # type: ignore[call-overload]

    def grant(self, *grants: Grant) -> None:
        self.run(*(g.statement(self.role) for g in grants))

    def revoke(self, g: Grant) -> None:
        self.run(f"REVOKE {g.privilege} ON {KINDS[g.kind]} {g.object} FROM {quote(self.role)}")

    def sink(self, table: str = "orders", **kw: Any) -> PostgresSink:
        return PostgresSink(make_conninfo(self.dsn, password=self.password), table, **kw)

    def ledger_uri(self, password: bool = True) -> str:
        secret = f"&password={self.password}" if password else ""
        return f"{self.dsn}{secret}&schema=tp_ledger"


@pytest.fixture
def secured(pg_server: PostgresServer | None, pg_admin_dsn: str) -> Iterator[Secured]:
    if pg_server is None or pg_server.tls is None:
        pytest.skip("needs the kit's own server (its TLS and pg_hba)")
    with fresh_database(pg_admin_dsn) as dsn:
        s = Secured(pg_server, dsn)
        yield s
    with psycopg.connect(pg_admin_dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(s.role)))


def _message(call: Any, error: type[Exception]) -> str | None:
    try:
        call()
    except error as e:
        return str(e)
    return None


def _preflight(sink: PostgresSink, schema: pa.Schema = SCHEMA) -> None:
    try:
        sink.preflight(schema)
    finally:
        sink.close()


def _open_ledger(s: Secured) -> None:
    PostgresLedger(s.ledger_uri(), "j").close()


# -- each privilege is needed, and named when missing --------------------------------------


def test_each_listed_privilege_is_needed_and_its_absence_is_named(secured: Secured) -> None:
    """An upsert with deletes (its list holds every privilege a sink's target
    may need) and the ledger: all granted, preflight passes; each revoked in
    turn, preflight names it, its GRANT, and nothing else."""
    s = secured
    s.run("CREATE TABLE customers (id bigint PRIMARY KEY, name text, amount float8)")
    schema = SCHEMA.append(pa.field("deleted", pa.bool_()))

    def sink() -> PostgresSink:
        return s.sink("customers", key=["id"], delete_when="deleted")

    settings = sink().settings()
    s.run(*access.setup_sql(settings, s.role), *pg_access.setup_sql(s.ledger_uri(), s.role))
    checks = [
        (access.required(settings), lambda: _preflight(sink(), schema), PreflightError),
        (pg_access.required("tp_ledger", s.db), lambda: _open_ledger(s), ConfigError),
    ]
    for needs, call, error in checks:
        assert _message(call, error) is None  # the whole list: passes
        assert len({(g.privilege, g.kind, g.name) for g in needs}) == len(needs)
        for g in needs:
            s.revoke(g)
            try:
                message = _message(call, error)
            finally:
                s.grant(g)
            assert message is not None, f"passed without {g}"
            assert f"{g}: " in message and g.statement(s.role) in message, message
            assert message.count("\n  - ") == 1, message  # only the missing one


def test_what_the_job_creates_needs_create_where_it_goes(secured: Secured) -> None:
    """Without the admin's tables: the marker schema and the ledger's schema
    need CREATE on the database; once they exist, their tables need CREATE on
    them; with it, the job creates them (owning them, it needs nothing more)."""
    s = secured
    s.run(ORDERS)
    sink_needs = access.required(s.sink().settings())
    s.grant(*[g for g in sink_needs if "orders" in g.name or g.kind == "database"])
    s.grant(Grant("USAGE", "schema", ("public",), ""))
    s.grant(Grant("SELECT", "table", ("pg_catalog", "pg_prepared_xacts"), ""))
    on_db = Grant("CREATE", "database", (s.db,), "")
    for call, error, schema in [
        (lambda: _preflight(s.sink()), PreflightError, "twophase"),
        (lambda: _open_ledger(s), ConfigError, "tp_ledger"),
    ]:
        message = _message(call, error)
        assert message is not None and message.count("\n  - ") == 1, message
        assert on_db.statement(s.role) in message and f"creates the schema {schema}" in message
        s.run(f"CREATE SCHEMA {schema}", f"GRANT USAGE ON SCHEMA {schema} TO {quote(s.role)}")
        message = _message(call, error)
        on_schema = Grant("CREATE", "schema", (schema,), "")
        assert message is not None and message.count("\n  - ") == 1, message
        assert on_schema.statement(s.role) in message, message
        s.grant(on_schema)
        assert _message(call, error) is None  # created now
        assert _message(call, error) is None  # and found
    _sink_paths(s.sink())


def test_the_docs_give_what_setup_sql_gives() -> None:
    """The SQL of docs/sinks/postgres.md is the function's, for its example."""
    page = (ROOT / "docs" / "sinks" / "postgres.md").read_text()
    block = page.split("For an append to `orders`:\n\n```sql\n", 1)[1].split("```", 1)[0]
    dsn = "postgresql://orders_writer@db.example:5432/shop?sslmode=verify-full"
    settings = PostgresSink(dsn, "orders").settings()
    assert block.splitlines() == access.setup_sql(settings, "orders_writer")


# -- the list is enough ------------------------------------------------------------------


def _batch(ids: list[int], schema: pa.Schema = SCHEMA, **extra: list[Any]) -> pa.RecordBatch:
    columns = [ids, [f"n{i}" for i in ids], [i * 0.5 for i in ids], *extra.values()]
    return pa.record_batch(columns, schema=schema)


def _sink_paths(sink: PostgresSink, schema: pa.Schema = SCHEMA) -> None:
    """What a job does with ``sink`` on the driver and its executors, in-process:
    preflight, claim, tasks (one retried; with a ``deleted`` column one that
    deletes), classification, commit, progress, pressure, listing, sweep,
    abort, audit, retirement."""
    committer = sink.committer()
    sink.preflight(schema)
    scope = JobScope("job", "load", sink.sink_id, A)
    committer.claim(scope)
    attempts = iter(range(1, 100))

    def task(batch: int, part: int, ids: list[int], deletes: bool = False) -> dict[str, Any]:
        ctx = WriteContext(scope, 1, batch, part, next(attempts))
        writer = sink.open_writer(ctx, schema)
        flags = {"deleted": [deletes] * len(ids)} if "deleted" in schema.names else {}
        writer.write(_batch(ids, schema, **flags))
        done = writer.prepare()
        writer.close()
        assert done is not None
        return done

    task(0, 0, [0, 1])  # a first attempt, replaced by the next one of its partition
    first = [task(0, 0, [0, 1]), task(0, 1, [2], deletes=True)]
    assert set(committer.classify(first).values()) == {Outcome.PREPARED}
    sink.checkpoint_pressure(first)  # counts the server's prepared transactions
    committer.commit(first)
    committer.forget(first)
    orphan = task(1, 0, [3])
    assert [t.txn for t in committer.lingering("job", "load")] == [orphan["txn"]]
    assert committer.sweep(scope, lambda n: True) == [orphan["txn"]]
    committer.abort([task(1, 0, [3])])
    evidence = [CheckpointEvidence(1, 0.0, [committer.evidence(c) for c in first])]
    assert {f.verdict for f in committer.audit(scope, evidence)} == {Verdict.OK}
    committer.retire_evidence(scope, before_batch=1)
    sink.close()


def test_an_append_needs_only_the_listed_privileges(secured: Secured) -> None:
    secured.run(ORDERS)
    sink = secured.sink()
    secured.run(*access.setup_sql(sink.settings(), secured.role))
    _sink_paths(sink)


def test_an_upsert_with_deletes_needs_only_the_listed_privileges(secured: Secured) -> None:
    secured.run(ORDERS)
    sink = secured.sink(key=["id"], order_by="amount", delete_when="deleted")
    secured.run(*access.setup_sql(sink.settings(), secured.role))
    _sink_paths(sink, SCHEMA.append(pa.field("deleted", pa.bool_())))


def test_a_replace_needs_only_the_listed_privileges(secured: Secured) -> None:
    secured.run(ORDERS)
    sink = secured.sink(replace_where="amount >= 0")
    secured.run(*access.setup_sql(sink.settings(), secured.role))
    sink.preflight(SCHEMA)
    committer = sink.committer()
    scope = JobScope("job", "load", sink.sink_id, A)
    committer.claim(scope)
    staged = []
    for part, ids in enumerate([[0, 1], [2]]):
        writer = sink.open_writer(WriteContext(scope, 1, 0, part, part), SCHEMA)
        writer.write(_batch(ids))
        staged.append(writer.prepare())
        writer.close()
    assert set(committer.classify(staged).values()) == {Outcome.PREPARED}  # type: ignore[arg-type]
    committer.abort(staged[1:])  # type: ignore[arg-type]
    assert committer.sweep(scope, lambda n: False) == []
    committer.commit(staged[:1])  # type: ignore[arg-type]
    with psycopg.connect(secured.admin) as c:
        assert c.execute("SELECT id FROM orders ORDER BY id").fetchall() == [(0,), (1,)]
    sink.close()


def test_every_change_of_the_ledger_needs_only_the_listed_privileges(secured: Secured) -> None:
    s = secured
    s.run(*pg_access.setup_sql(s.ledger_uri(), s.role))
    c = [{"txn": "t0", "rows": 1}]
    led = PostgresLedger(s.ledger_uri(), "j", history=1, digest_window=1)
    try:
        led.begin_run()
        led.record_sinks({"p/s": {"kind": "postgres"}})
        led.record_sinks({"p/s": {"kind": "postgres", "v": 2}})
        for b in range(4):
            led.record_batch("p", b, {"s": c}, f"d{b}")
        led.record_batch("p", 3, {"s": c}, "d3-again")
        led.drop_batches("p", [3])
        led.record_spark_completed("p", 2)
        for cut in (0, 2):  # the second trims the history and the digests
            led.complete(led.decide("periodic", {"p": cut}, []), {"p/s": 1}, {"p/s": c})
        led.record_batch("p", 3, {"s": c}, "d3")
        led.record_owed("p", {3: {"s": 1}})
        led.record_repaying("p", 3, {"s": c})
        led.record_repaid("p", 3, {"s": 1})
        cp = led.decide("final", {"p": 3}, ["p"])
        led.record_abandoned(cp.id, ["t0"], "a test")
        led.complete(cp, {"p/s": 1})
    finally:
        led.close()
    PostgresLedger(s.ledger_uri(), "j", history=5, digest_window=5).close()  # new limits
    doc = read_ledger(location=s.ledger_uri() + "&job=j")
    assert doc is not None and doc["finished"] == ["p"] and doc["totals"] == {"p/s": 4}


# -- a job killed over TLS, with exactly the least grants -------------------------------


def _crash(s: Secured, tmp_path: Path, key: str | None, files: int, **kw: Any) -> None:
    """``tests/jobs/pg_job.py`` as the role, its sink and its ledger over TLS,
    under ``crash_test(**kw)``, two input files a batch; then every row once,
    nothing prepared, the operator's commands as the role, and no password
    anywhere."""
    s.run(ORDERS)
    sink = s.sink(key=[key] if key else None)
    s.run(*access.setup_sql(sink.settings(), s.role), *pg_access.setup_sql(s.ledger_uri(), s.role))
    n = write_input(tmp_path / "in", files=files, rows_per_file=100)
    state = tmp_path / "state"
    args = ["--dsn", s.dsn, "--state", str(state), "--input", str(tmp_path / "in")]
    args += ["--ledger", s.ledger_uri(password=False), "--password-env", PASSWORD_ENV]
    args += ["--files-per-batch", "2", *(["--key", key] if key else [])]
    log = tmp_path / "crash.log"
    report = crash_test(
        JOB,
        args=args,
        env={PASSWORD_ENV: s.password},
        log=log,
        verify=lambda: assert_exactly_once_postgres(s.admin, "orders", range(n), job="crash"),
        **kw,
    )
    print(report)
    assert report.kills >= 1, report
    assert prepared_postgres(s.admin) == []

    # the operator's commands, as the role, with the password in the environment
    env = {"PYTHONPATH": str(ROOT), "PGPASSWORD": s.password}
    outputs = []
    for command in (["status", str(state)], ["audit", str(state), "--all", "--json"]):
        done = twophase(*command, env=env, timeout=180)
        outputs.append(done.stdout + done.stderr)
        assert done.returncode == 0, f"twophase {command[0]}:\n{outputs[-1]}"
    checks = json.loads(outputs[1])["checks"]
    verdicts = {f["verdict"] for c in checks for f in c["findings"] if f["txn"] != "-"}
    assert verdicts == {"ok"}, outputs[1]

    secret = s.password
    files = [p for p in state.rglob("*") if p.is_file()]
    assert any("offsets" in p.parts for p in files)  # the Spark checkpoint is in there
    leaks = [str(p) for p in files if secret.encode() in p.read_bytes()]
    assert not leaks, f"the password is in {leaks}"
    assert secret not in log.read_text(errors="replace")
    assert not any(secret in o for o in outputs)
    ledger = read_ledger(location=s.ledger_uri() + "&job=crash")
    assert ledger is not None and secret not in json.dumps(ledger)  # the ledger's rows


def test_a_killed_job_over_tls_with_exactly_the_least_grants_is_exact_and_keeps_its_secret(
    secured: Secured, tmp_path: Path
) -> None:
    """An append and the ledger as the role, over ``sslmode=verify-full``: a
    kill at a random instant of the start, one in the middle of the first
    checkpoint's commit, then a run to the end."""
    _crash(
        secured,
        tmp_path,
        key=None,
        files=4,
        kills=2,
        seed=5,
        fault_points=["driver.mid_commit"],
        min_delay=3.0,
        max_delay=8.0,
    )


@SLOW  # about 150 s; the default run kills the append, and every upsert path runs in-process
def test_a_killed_upsert_over_tls_with_exactly_the_least_grants_is_exact(
    secured: Secured, tmp_path: Path
) -> None:
    """An upsert (staging tables, ON CONFLICT) under four kills: two at random
    instants, one before a checkpoint's commit, one after a batch's record."""
    _crash(
        secured,
        tmp_path,
        key="id",
        files=8,
        kills=4,
        seed=17,
        fault_points=["driver.before_commit", "driver.after_record"],
        min_delay=5.0,
        max_delay=20.0,
    )


def test_the_role_cannot_connect_without_tls(secured: Secured) -> None:
    """What makes the job's runs above TLS ones: the role is refused without it."""
    plain = make_conninfo(secured.dsn, sslmode="disable", password=secured.password)
    with pytest.raises(psycopg.OperationalError, match="no encryption"):
        psycopg.connect(plain)
