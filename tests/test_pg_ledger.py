"""The PostgreSQL ledger's own behaviour, against a real server (``pg_dsn``):
the advisory lock and the fencing token, transactions killed before COMMIT,
the rows a change writes, several jobs in one database, and how a state_dir
and ``twophase`` find the ledger. What it answers (the same as the file
ledger) is tested in ``test_ledger.py`` and ``test_recovery_rules.py``."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lifecycle.cli import main as twophase
from lifecycle.ledger import (
    LOCATION_FILE,
    FileLedger,
    LedgerLockedError,
    LedgerLostError,
    PostgresLedger,
    check_location,
    is_locked,
    open_ledger,
    read_ledger,
)
from lifecycle.state.pg_ledger import read_pg_ledger
from lifecycle.state.pg_location import PgLocation
from sinks.errors import ConfigError
from tests.ledgers import lock_holder, pg_uri, terminate


def _c(name: str, rows: int = 1) -> dict[str, object]:
    return {"txn": name, "rows": rows}


@pytest.fixture
def uri(pg_dsn: str) -> str:
    return pg_uri(pg_dsn)


def _doc(uri: str, job: str = "j") -> dict[str, Any]:
    doc = read_ledger(location=f"{uri}?job={job}")
    assert doc is not None
    return doc


# -- the lock and the fencing token ---------------------------------------------------


def test_a_ledger_taken_over_refuses_every_write(pg_dsn: str, uri: str) -> None:
    a = PostgresLedger(uri, "j")
    a.begin_run()
    a.record_batch("p", 0, {"s": [_c("a0")]})
    holder = lock_holder(pg_dsn, uri)
    assert holder is not None
    terminate(pg_dsn, holder)  # A's lock session ends (A does not know)
    b = PostgresLedger(uri, "j")  # the lock is free: B takes it, the token moves on
    try:
        assert lock_holder(pg_dsn, uri) not in (None, holder)
        before = _doc(uri)
        assert before["pending"] == {"p": {"0": {"s": [_c("a0")]}}} and before["run"] == 1
        with pytest.raises(LedgerLostError, match="taken over by another driver"):
            a.record_batch("p", 1, {"s": [_c("a1")]})
        with pytest.raises(LedgerLostError, match="taken over by another driver"):
            a.complete(a.decide("periodic", {"p": 0}, []), {"p/s": 1})
        assert _doc(uri) == before  # nothing A tried was written
        b.record_batch("p", 1, {"s": [_c("b1")]})  # B goes on
        assert b.pending_batch_ids("p") == [0, 1] and b.decided() is None
    finally:
        a.close()
        b.close()
    assert PostgresLedger(uri, "j").pending_batch("p", 1) == {"s": [_c("b1")]}


def test_a_lost_lock_session_stops_writes(pg_dsn: str, uri: str) -> None:
    a = PostgresLedger(uri, "j")
    a.record_batch("p", 0, {"s": [_c("a0")]})
    holder = lock_holder(pg_dsn, uri)
    assert holder is not None
    terminate(pg_dsn, holder)
    before = _doc(uri)
    with pytest.raises(LedgerLostError, match=r"session holding the lock .* ended"):
        a.record_batch("p", 1, {"s": [_c("a1")]})
    assert _doc(uri) == before
    assert not is_locked(location=f"{uri}?job=j")  # the failed check took no lock
    with pytest.raises(LedgerLostError):
        a.begin_run()
    a.close()
    again = PostgresLedger(uri, "j")
    assert again.pending_batch_ids("p") == [0]
    again.close()


def test_a_lost_write_session_is_replaced(pg_dsn: str, uri: str) -> None:
    """The session changes are written on (not the lock's) is ended between two
    changes, as an idle timeout or a proxy would end it: the next change opens a
    new one (the fence checks it still holds the ledger) and goes through."""
    led = PostgresLedger(uri, "j")
    led.record_batch("p", 0, {"s": [_c("a0")]})
    with psycopg.connect(pg_dsn) as conn:
        (writer,) = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND "
            "application_name = 'twophase ledger writes'"
        ).fetchone() or (None,)
    assert writer is not None
    terminate(pg_dsn, writer)
    led.record_batch("p", 1, {"s": [_c("a1")]})
    assert _doc(uri)["pending"]["p"].keys() == {"0", "1"}
    led.close()


def _open_at_once(uri: str, n: int) -> list[PostgresLedger | Exception]:
    """``n`` threads open the ledger of job ``j`` at the same instant."""
    barrier = threading.Barrier(n)
    got: list[PostgresLedger | Exception] = []

    def opener() -> None:
        barrier.wait()
        try:
            got.append(PostgresLedger(uri, "j"))
        except Exception as e:
            got.append(e)

    threads = [threading.Thread(target=opener) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_two_opens_at_once_exactly_one_gets_the_lock(uri: str) -> None:
    for _round in range(5):  # the first on an empty database: both create the tables
        got = _open_at_once(uri, 2)
        opened = [g for g in got if isinstance(g, PostgresLedger)]
        refused = [g for g in got if isinstance(g, LedgerLockedError)]
        assert (len(opened), len(refused)) == (1, 1), got
        opened[0].begin_run()
        opened[0].close()
    assert _doc(uri)["run"] == 5


def test_a_closed_ledger_releases_its_lock_before_close_returns(
    pg_dsn: str, uri: str, tmp_path: Path
) -> None:
    """A backend drops a closed session's advisory lock only as it exits, after the
    client has gone: a ledger opened right after a close once found the lock still
    taken (LedgerLockedError). ``close`` releases it first; another session, asking
    at once, finds it free every time."""
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        for _round in range(40):
            led = open_ledger(f"{uri}?job=j", tmp_path, "j")
            assert isinstance(led, PostgresLedger)
            key = led._key
            led.close()
            row = other.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
            assert row is not None and row[0], f"round {_round}: the lock was still held"
            other.execute("SELECT pg_advisory_unlock(%s)", (key,))


# -- a transaction killed before COMMIT ------------------------------------------------


def _writer_waiting(pg_dsn: str) -> int | None:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND "
            "application_name = 'twophase ledger writes' AND wait_event_type = 'Lock'"
        ).fetchone()
    return row[0] if row else None


@pytest.mark.parametrize("change", ["complete", "record_batch"])
def test_a_change_killed_before_commit_changes_nothing(pg_dsn: str, uri: str, change: str) -> None:
    """The change's transaction wrote some rows, then waits for a row another
    session holds (the totals of its sink; the batch it replaces) and its backend
    is terminated: the database keeps the state before the change, whole."""
    led = PostgresLedger(uri, "j")
    led.record_batch("p", 0, {"s": [_c("t0")]}, "d0")
    led.complete(led.decide("periodic", {"p": 0}, []), {"p/s": 1})
    led.record_batch("p", 1, {"s": [_c("t1")]}, "d1")
    led.record_batch("p", 2, {"s": [_c("t2")]}, "d2")
    cp = led.decide("final", {"p": 1}, ["p"])
    before = _doc(uri)
    blocker = psycopg.connect(pg_dsn)  # a transaction holding the row
    if change == "complete":
        blocker.execute("SELECT * FROM twophase_ledger.totals FOR UPDATE")
    else:
        blocker.execute("SELECT * FROM twophase_ledger.pending WHERE batch_id = 2 FOR UPDATE")
    outcome: list[BaseException | None] = []

    def write() -> None:
        try:
            if change == "complete":
                led.complete(cp, {"p/s": 1})
            else:
                led.record_batch("p", 2, {"s": [_c("t2-again")]}, "d2-again")
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=write)
    thread.start()
    deadline = time.monotonic() + 30
    while (pid := _writer_waiting(pg_dsn)) is None:
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.05)
    terminate(pg_dsn, pid)
    thread.join(30)
    blocker.rollback()
    blocker.close()
    assert outcome and isinstance(outcome[0], psycopg.OperationalError), outcome
    assert _doc(uri) == before
    with pytest.raises(RuntimeError, match="must be reopened"):
        led.record_spark_completed("p", 9)  # its memory may be ahead: no more changes
    led.close()
    again = PostgresLedger(uri, "j")
    assert again.decided() == cp and again.pending_batch("p", 2) == {"s": [_c("t2")]}
    again.complete(cp, {"p/s": 1})  # the change made again: the new state
    assert again.pending_batch_ids("p") == [2] and again.finished() == {"p"}
    assert again.totals() == {"p/s": 2} and again.committed_digest("p", 1) == "d1"
    again.close()


# -- what a change writes -----------------------------------------------------------------


def _row_versions(pg_dsn: str, table: str, key: str) -> dict[Any, str]:
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(f"SELECT {key}, xmin::text FROM twophase_ledger.{table}").fetchall()
    return dict(rows)


def test_a_change_writes_only_its_own_rows(pg_dsn: str, uri: str) -> None:
    """Invariant 10: no document is rewritten; a change touches its rows."""
    led = PostgresLedger(uri, "j")
    for b in range(300):
        led.record_batch("p", b, {"s": [_c(f"t{b}.{i}") for i in range(20)]}, f"d{b}")
    led.complete(led.decide("periodic", {"p": 0}, []), {"p/s": 20})
    pending = _row_versions(pg_dsn, "pending", "batch_id")
    job = _row_versions(pg_dsn, "ledgers", "job")
    history = _row_versions(pg_dsn, "checkpoints", "id")
    led.record_batch("p", 300, {"s": [_c("one")]})
    after = _row_versions(pg_dsn, "pending", "batch_id")
    assert {b for b in after if after[b] != pending.get(b)} == {300}
    assert _row_versions(pg_dsn, "ledgers", "job") == job  # locked, not rewritten
    led.complete(led.decide("periodic", {"p": 2}, []), {"p/s": 40})
    left = _row_versions(pg_dsn, "pending", "batch_id")
    assert set(left) == set(range(3, 301)) and all(left[b] == after[b] for b in left)
    checkpoints = _row_versions(pg_dsn, "checkpoints", "id")
    assert checkpoints[1] == history[1] and set(checkpoints) == {1, 2}
    led.close()


def test_sink_settings_are_rows_and_an_older_schema_gets_their_table(pg_dsn: str, uri: str) -> None:
    """The sinks' settings are a row per sink of the job, replaced as a whole; a
    schema created before the ``sinks`` table existed gets it at the next open."""
    settings = {"p/a": {"kind": "postgres", "dsn": "host=h"}, "p/b": {"kind": "delta"}}
    led = PostgresLedger(uri, "j")
    other = PostgresLedger(uri, "k")
    other.record_sinks({"q/c": {"kind": "kafka"}})
    assert led.record_sinks(settings) is True
    assert _row_versions(pg_dsn, "sinks", "label").keys() == {"p/a", "p/b", "q/c"}
    assert led.record_sinks({"p/b": {"kind": "delta"}}) is True
    assert _row_versions(pg_dsn, "sinks", "label").keys() == {"p/b", "q/c"}
    led.close()
    other.close()
    assert _doc(uri, "k")["sinks"] == {"q/c": {"kind": "kafka"}}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE twophase_ledger.sinks")  # as a schema of the version before
    led = PostgresLedger(uri, "j")
    assert led.sinks_settings() == {}  # recorded again by the job's next start
    assert led.record_sinks(settings) is True
    led.close()
    assert _doc(uri)["sinks"] == settings
    led = PostgresLedger(uri, "j")
    assert led.sinks_settings() == settings
    led.close()


# -- jobs, states and where the ledger is found ---------------------------------------


def test_jobs_share_a_database_one_ledger_each(uri: str) -> None:
    a, b = PostgresLedger(uri, "a"), PostgresLedger(uri, "b")
    a.record_batch("p", 0, {"s": [_c("a0")]})
    b.record_batch("p", 7, {"s": [_c("b7")]})
    b.complete(b.decide("final", {"p": 7}, ["p"]), {"p/s": 1})
    assert a.incarnation != b.incarnation
    assert _doc(uri, "a")["pending"] == {"p": {"0": {"s": [_c("a0")]}}}
    assert _doc(uri, "b")["pending"] == {} and _doc(uri, "b")["finished"] == ["p"]
    with pytest.raises(ConfigError, match=r"jobs \['a', 'b'\]: name one with \?job=NAME"):
        read_ledger(location=uri)
    assert is_locked(location=f"{uri}?job=a") and is_locked(location=f"{uri}?job=b")
    with pytest.raises(LedgerLockedError):
        PostgresLedger(f"{uri}?job=a", "a")
    with pytest.raises(ConfigError, match="names job 'a', not 'b'"):
        PostgresLedger(f"{uri}?job=a", "b")
    a.close()
    assert not is_locked(location=f"{uri}?job=a") and is_locked(location=f"{uri}?job=b")
    b.close()


def test_a_second_state_of_a_job_needs_another_schema(uri: str, tmp_path: Path) -> None:
    first = open_ledger(uri, tmp_path / "s1", "j")
    first.begin_run()
    incarnation = first.incarnation
    first.close()
    with pytest.raises(
        ConfigError,
        match=r"another schema \(\?schema=NAME .*DELETE FROM twophase_ledger.ledgers "
        r"WHERE job = 'j'",
    ):
        open_ledger(uri, tmp_path / "s2", "j")
    assert not (tmp_path / "s2" / LOCATION_FILE).exists()
    second = open_ledger(f"{uri}?schema=second", tmp_path / "s2", "j")
    assert second.incarnation != incarnation
    second.close()
    again = open_ledger(uri, tmp_path / "s1", "j")  # the first state resumes
    assert again.incarnation == incarnation and again.run == 1
    again.close()
    with psycopg.connect(uri) as conn:
        conn.execute("DELETE FROM twophase_ledger.ledgers WHERE job = 'j'")  # drop it
    third = open_ledger(uri, tmp_path / "s3", "j")
    assert third.incarnation not in (incarnation, second.incarnation) and third.run == 0
    third.close()


def test_a_state_dir_keeps_its_kind_of_ledger(uri: str, tmp_path: Path) -> None:
    FileLedger(tmp_path / "local" / "ledger", "j").close()
    with pytest.raises(ConfigError, match="holds a local ledger"):
        open_ledger(uri, tmp_path / "local", "j")
    open_ledger(uri, tmp_path / "remote", "j").close()
    with pytest.raises(ConfigError, match=r"is in PostgreSQL \(postgresql://"):
        open_ledger(None, tmp_path / "remote", "j")
    for bad in ("mysql://h/db", "host=h dbname=d password=x", f"{uri}?schema=no-dash"):
        with pytest.raises(ConfigError) as refused:
            check_location(bad)
        assert "password=x" not in str(refused.value)
    assert check_location(None) is None and check_location(uri) == uri


def test_twophase_finds_the_ledger_without_its_password(
    uri: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = uri.replace("postgresql://postgres@", "postgresql://postgres:s3cret@")
    state = tmp_path / "state"
    led = open_ledger(secret, state, "orders")
    led.begin_run()
    led.record_batch("load", 0, {"s": [_c("t0", 5)]})
    recorded = (state / LOCATION_FILE).read_text()
    assert "s3cret" not in recorded and "job=orders" in recorded
    assert recorded.startswith("postgresql://postgres@") and "schema=twophase_ledger" in recorded
    assert is_locked(state)
    assert twophase(["status", str(state)]) == 0
    assert "job orders" in capsys.readouterr().out
    assert twophase(["status", "--raw", "--ledger", uri]) == 0  # the schema's only job
    assert json.loads(capsys.readouterr().out) == read_ledger(state)
    assert twophase(["start-over", str(state), "--from", led.incarnation]) == 2
    assert "another ledger schema" in capsys.readouterr().err
    led.close()
    assert not is_locked(state)
    assert twophase(["stop", str(state), "--timeout", "1"]) == 2  # nothing running
    assert twophase(["status", "--ledger", f"{uri}?schema=nothing"]) == 2
    assert "no ledger in" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("uri", "shown", "libpq"),
    [
        (
            "postgresql://u:s3cret@h1:5432,h2/db?sslmode=require&schema=led&job=j",
            "postgresql://u@h1:5432,h2/db?schema=led&job=j&sslmode=require",
            {"user": "u", "password": "s3cret", "host": "h1,h2", "dbname": "db"},
        ),
        (
            "postgres:///db?host=/run/postgresql&sslpassword=k3y",
            "postgres:///db?schema=twophase_ledger&host=%2Frun%2Fpostgresql",
            {"host": "/run/postgresql", "dbname": "db", "sslpassword": "k3y"},
        ),
        (
            "postgresql://h/d%20b?password=pw&application_name=a%26b",
            "postgresql://h/d%20b?schema=twophase_ledger&application_name=a%26b",
            {"host": "h", "dbname": "d b", "password": "pw", "application_name": "a&b"},
        ),
    ],
)
def test_a_ledger_uri_is_shown_without_its_secrets(
    uri: str, shown: str, libpq: dict[str, str]
) -> None:
    where = PgLocation.parse(uri)
    assert where.display() == shown
    assert PgLocation.parse(where.display()).display() == shown  # what is stored reads back
    got = psycopg.conninfo.conninfo_to_dict(where.conninfo())
    assert {k: got.get(k) for k in libpq} == libpq
    assert "schema" not in got and "job" not in got


def test_a_schema_of_an_earlier_version_gets_the_evidence_column_or_goes_on_without(
    pg_dsn: str, uri: str, tmp_path: Path
) -> None:
    """The checkpoints of a schema made before audit evidence existed have no
    ``evidence`` column: read-only commands read it as it is, and a job adds the
    column, or, when a reader holds the table, goes on without evidence after
    waiting 2 s, never forever."""
    led = PostgresLedger(uri, "j")
    led.begin_run()
    led.record_batch("p", 0, {"s": [_c("a", 3)]})
    cp = led.decide("periodic", {"p": 0}, [])
    led.complete(cp, {"p/s": 3}, {"p/s": [{"txn": "a", "rows": 3}]})
    led.close()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("ALTER TABLE twophase_ledger.checkpoints DROP COLUMN evidence")
    old = read_pg_ledger(uri)  # the CLI's read: no migration, no error
    assert old is not None and old["history"][0]["evidence"] == {}

    with psycopg.connect(pg_dsn) as reader:  # holds the table: the ALTER must not wait
        reader.execute("SELECT count(*) FROM twophase_ledger.checkpoints")
        began = time.monotonic()
        led = PostgresLedger(uri, "j")
        waited = time.monotonic() - began
        assert waited < 10, waited
        led.record_batch("p", 1, {"s": [_c("b", 2)]})
        cp = led.decide("periodic", {"p": 1}, [])
        led.complete(cp, {"p/s": 2}, {"p/s": [{"txn": "b", "rows": 2}]})
        led.close()
        reader.rollback()
    doc = read_pg_ledger(uri)
    assert doc is not None and [h["evidence"] for h in doc["history"]] == [{}, {}]

    led = PostgresLedger(uri, "j")  # nobody holds it now: the column is added
    led.record_batch("p", 2, {"s": [_c("c", 1)]})
    cp = led.decide("periodic", {"p": 2}, [])
    led.complete(cp, {"p/s": 1}, {"p/s": [{"txn": "c", "rows": 1}]})
    led.close()
    doc = read_pg_ledger(uri)
    assert doc is not None and doc["history"][-1]["evidence"] == {"p/s": [{"txn": "c", "rows": 1}]}
