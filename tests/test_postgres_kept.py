"""The driver's kept PostgreSQL connections (:mod:`sinks.postgres.kept`): reused
only when returned idle, renamed for their new user, never handed out in
doubt, and a connection the server dropped meanwhile costs a commit a retry,
not its data."""

from __future__ import annotations

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from sinks import PostgresSink
from sinks.base import JobScope, WriteContext
from sinks.postgres.kept import KeptConnections


def _pid(conn: psycopg.Connection) -> int:
    return conn.info.backend_pid


def _connect(dsn: str):  # type: ignore[no-untyped-def]
    def connect(name: str) -> psycopg.Connection:
        return psycopg.connect(dsn, autocommit=True, application_name=name)

    return connect


def test_an_idle_connection_is_reused_under_its_new_users_name(pg_dsn: str) -> None:
    kept = KeptConnections(_connect(pg_dsn), most=2)
    with kept.connection("twophase-commit") as conn:
        first = _pid(conn)
    with kept.connection("twophase-recover") as conn:
        assert _pid(conn) == first
        name = conn.execute("SELECT current_setting('application_name')").fetchone()
        assert name == ("twophase-recover",)
    kept.close()
    with psycopg.connect(pg_dsn) as admin:
        alive = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (first,))
        assert alive.fetchone() == (0,), "close() left the kept connection open"


def test_a_connection_in_doubt_is_closed_not_kept(pg_dsn: str) -> None:
    kept = KeptConnections(_connect(pg_dsn), most=2)
    with pytest.raises(RuntimeError), kept.connection("a") as conn:
        failed = _pid(conn)
        raise RuntimeError("its user failed")
    with kept.connection("b") as conn:
        assert _pid(conn) != failed
        conn.execute("BEGIN")  # returned with a transaction open
        open_txn = _pid(conn)
    with kept.connection("c") as conn:
        assert _pid(conn) not in (failed, open_txn)
    kept.close()


def test_at_most_most_connections_wait_idle(pg_dsn: str) -> None:
    kept = KeptConnections(_connect(pg_dsn), most=1)
    with kept.connection("a") as a, kept.connection("b") as b:
        pids = {_pid(a), _pid(b)}
    with kept.connection("c") as c, kept.connection("d") as d:
        again = {_pid(c), _pid(d)}
    assert len(pids & again) == 1  # one kept, the other closed
    kept.close()


def test_a_commit_goes_through_after_the_server_dropped_the_kept_connections(
    pg_dsn: str,
) -> None:
    """The server ends every idle connection the committer kept (a restart, an
    idle timeout) between two checkpoints: the next commit fails its first
    statement on one, drops the others with it, and commits on new ones within
    a commit_timeout that one retry per dead connection would exceed."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE kept (id bigint PRIMARY KEY)")
    sink = PostgresSink(pg_dsn, "kept", commit_timeout=2, commit_connections=4)
    schema = pa.schema([("id", pa.int64())])
    sink.preflight(schema)
    committer = sink.committer()
    scope = JobScope("kept", "load", sink.sink_id, "0123456789ab")
    committer.claim(scope)

    def prepare(batch: int, partition: int) -> dict[str, object]:
        ctx = WriteContext(scope, 0, batch, partition, batch * 100 + partition, 0)
        writer = sink.open_writer(ctx, schema)
        row = batch * 100 + partition
        writer.write(pa.record_batch([pa.array([row], pa.int64())], schema=schema))
        committable = writer.prepare()
        writer.close(failed=False)
        assert committable is not None
        return committable

    # 16 transactions: four parts (PER_CONNECTION=4 each), four connections kept
    committer.commit([prepare(0, p) for p in range(16)])
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        ended = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name LIKE 'twophase-%%' AND pid <> pg_backend_pid()"
        ).fetchone()
        assert ended is not None and ended[0] >= 3, f"{ended} kept connections to drop"
    committer.commit([prepare(1, p) for p in range(16)])
    with psycopg.connect(pg_dsn) as c:
        ids = c.execute(sql.SQL("SELECT id FROM kept ORDER BY id")).fetchall()
    assert ids == [(b * 100 + p,) for b in (0, 1) for p in range(16)]
    sink.close()


def test_a_connection_in_use_at_close_is_not_kept(pg_dsn: str) -> None:
    """A commit thread given up on returns its connection after the sink's
    close: it is closed, not kept for the life of the process."""
    kept = KeptConnections(_connect(pg_dsn), most=2)
    with kept.connection("late") as conn:
        late = _pid(conn)
        kept.close()
    with kept.connection("after") as conn:
        assert _pid(conn) != late
    kept.close()
