"""Shared fixtures: a real PostgreSQL server, a real SparkSession, input files.

Services:
* PostgreSQL: a private cluster started on a free loopback port for the test
  session (``tests/pgserver.py``), or an existing server when
  ``TWOPHASE_PG_DSN`` is set (a superuser DSN; tests that restart the server
  are then skipped).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from lifecycle._exit import leave
from tests.ledgers import LedgerBackend, pg_uri
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


@contextlib.contextmanager
def fresh_database(admin_dsn: str) -> Iterator[str]:
    """A new, empty database on the server of ``admin_dsn``; dropped afterwards,
    with any transaction still prepared in it rolled back."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    info = psycopg.conninfo.conninfo_to_dict(admin_dsn)
    info["dbname"] = name
    yield psycopg.conninfo.make_conninfo(**info)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for (gid,) in conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = %s", (name,)
        ).fetchall():
            # leave the server clean for later tests (the test already asserted)
            with psycopg.connect(psycopg.conninfo.make_conninfo(**info), autocommit=True) as c:
                c.execute(f"ROLLBACK PREPARED '{gid}'")
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_dsn(pg_admin_dsn: str) -> Iterator[str]:
    """A fresh database per test."""
    with fresh_database(pg_admin_dsn) as dsn:
        yield dsn


@pytest.fixture(scope="module")
def pg_module_dsn(pg_admin_dsn: str) -> Iterator[str]:
    """One fresh database for a whole test module, for tests that each create
    tables of their own names (property tests run many examples)."""
    with fresh_database(pg_admin_dsn) as dsn:
        yield dsn


@pytest.fixture(params=["file", "postgres"])
def ledger_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LedgerBackend]:
    """Each ledger backend in turn: the file ledger in ``tmp_path/state``, then the
    PostgreSQL ledger in a fresh database (``pg_dsn``), found through the same
    state_dir. Both run by default; ``-k file`` or ``-k postgres`` picks one."""
    location = None
    if request.param == "postgres":
        location = pg_uri(request.getfixturevalue("pg_dsn"))
    backend = LedgerBackend(request.param, tmp_path / "state", location)
    try:
        yield backend
    finally:
        backend.close_all()


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


# -- Kafka ---------------------------------------------------------------------------------
# A Kafka-protocol broker for the Spark-level Kafka tests: tansu on a free loopback
# port for the test session (``tests/kafkabroker.py``), or an existing cluster when
# ``TWOPHASE_KAFKA_BOOTSTRAP`` is set (e.g. Apache Kafka from docker-compose.yml).
# Every test writes to fresh topics, so a shared cluster needs no cleaning.


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``host:port`` of the test session's Kafka broker."""
    given = os.environ.get("TWOPHASE_KAFKA_BOOTSTRAP")
    if given:
        yield given
        return
    from tests.kafkabroker import KafkaBroker

    broker = KafkaBroker()
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.cleanup()


def wait_for_topic(bootstrap: str, topic: str, partitions: int, timeout: float = 30.0) -> None:
    """Wait until every partition of a new topic has a leader (Apache Kafka
    creates topics asynchronously; tansu at once)."""
    from sinks.kafka.wire import KafkaWire

    deadline = time.monotonic() + timeout
    with KafkaWire(bootstrap) as wire:
        while True:
            leaders: dict[int, int] | None = None
            with contextlib.suppress(Exception):  # LEADER_NOT_AVAILABLE while created
                leaders = wire.partition_leaders(topic)
            if leaders and len(leaders) == partitions and min(leaders.values()) >= 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"topic {topic} has no leaders after {timeout}s: {leaders}")
            time.sleep(0.1)


@pytest.fixture
def kafka_topic(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    """``kafka_topic(partitions=3)`` creates a fresh topic and returns its name."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)

    def make(partitions: int = 3) -> str:
        name = f"t-{uuid.uuid4().hex[:12]}"
        admin.create_topics([NewTopic(name, partitions, 1)])
        wait_for_topic(kafka_bootstrap, name, partitions)
        return name

    try:
        yield make
    finally:
        admin.close()


# -- leaving ----------------------------------------------------------------------------

_session_status = 0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _session_status
    _session_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the test process with pytest's status and nothing after: tests read
    Delta tables with ``DeltaTable.to_pyarrow_table()``, after which the
    interpreter can abort as it finalizes (delta-rs#2184, about one process in
    twenty), turning a passing run into exit status 134 (see lifecycle/_exit.py)."""
    leave(_session_status)
