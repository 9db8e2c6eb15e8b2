"""Shared fixtures: a real PostgreSQL server, a real SparkSession, input files.

Services:
* PostgreSQL: a private cluster started on a free loopback port for the test
  session (``tests/pgserver.py``), or an existing server when
  ``TWOPHASE_PG_DSN`` is set (a superuser DSN; tests that restart the server
  are then skipped).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.pgserver import PostgresServer

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer | None]:
    if os.environ.get("TWOPHASE_PG_DSN"):
        yield None
        return
    server = PostgresServer()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def pg_admin_dsn(pg_server: PostgresServer | None) -> str:
    return os.environ.get("TWOPHASE_PG_DSN") or pg_server.dsn()  # type: ignore[union-attr]


@pytest.fixture
def pg_dsn(pg_admin_dsn: str) -> Iterator[str]:
    """A fresh database per test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    info = psycopg.conninfo.conninfo_to_dict(pg_admin_dsn)
    info["dbname"] = name
    yield psycopg.conninfo.make_conninfo(**info)
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        for (gid,) in conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = %s", (name,)
        ).fetchall():
            # leave the server clean for later tests (the test already asserted)
            with psycopg.connect(psycopg.conninfo.make_conninfo(**info), autocommit=True) as c:
                c.execute(f"ROLLBACK PREPARED '{gid}'")
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def spark():  # type: ignore[no-untyped-def]
    from tests.sparkutil import make_spark

    session = make_spark("twophase-tests")
    yield session
    session.stop()


def write_input(directory: Path, files: int, rows_per_file: int, start: int = 0) -> int:
    """Write JSON-lines input files of rows {id, name, amount}; return the row count."""
    directory.mkdir(parents=True, exist_ok=True)
    n = start
    for f in range(files):
        lines = []
        for _ in range(rows_per_file):
            lines.append(json.dumps({"id": n, "name": f"name-{n}", "amount": n * 0.5}))
            n += 1
        tmp = directory / f".part-{start}-{f:05d}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.rename(directory / f"part-{start}-{f:05d}.json")
    return n - start
