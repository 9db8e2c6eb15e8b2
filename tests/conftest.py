"""Shared fixtures: a real PostgreSQL server, a Kafka broker, a real SparkSession,
input files.

The services are the test kit's (``lifecycle.testing.plugin``, loaded by its
``pytest11`` entry point: the project's tests are its first user):
* PostgreSQL: a private cluster started on a free loopback port for the test
  session, or an existing server when ``TWOPHASE_PG_DSN`` is set (a superuser
  DSN; tests that restart the server are then skipped);
* Kafka: Apache Kafka (KRaft, from the fetched jars) on free loopback ports for
  the test session; tansu with ``TWOPHASE_TEST_KAFKA=tansu`` (or when the jars
  are missing outside CI); or ``TWOPHASE_KAFKA_BOOTSTRAP``.
The names the tests use (``pg_dsn``, ``kafka_bootstrap``, ``kafka_topic``) are
the kit's fixtures under the names the tests grew up with.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lifecycle._exit import leave
from lifecycle.testing.plugin import PostgresService, fresh_database
from lifecycle.testing.postgres_server import PostgresServer
from tests.ledgers import LedgerBackend, pg_uri

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


@pytest.fixture(scope="session")
def pg_server(twophase_postgres: PostgresService) -> PostgresServer | None:
    """The embedded server of the test kit (None for ``TWOPHASE_PG_DSN``)."""
    server: PostgresServer | None = twophase_postgres.server
    return server


@pytest.fixture(scope="session")
def pg_admin_dsn(twophase_postgres: PostgresService) -> str:
    return twophase_postgres.dsn


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


@pytest.fixture(params=["file", "postgres", "store"])
def ledger_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LedgerBackend]:
    """Each ledger backend in turn: the file ledger in ``tmp_path/state``, the
    PostgreSQL ledger in a fresh database (``pg_dsn``), found through the same
    state_dir, then the store ledger in ``tmp_path/state``. All run by default;
    ``-k file``, ``-k postgres`` or ``-k store`` picks one."""
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

    session = make_spark("twophase-tests", jvm_packages=True)
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
# The broker of the Kafka tests: Apache Kafka for the test session
# (``lifecycle/testing/apache_kafka.py``), tansu with TWOPHASE_TEST_KAFKA=tansu
# (``lifecycle/testing/kafka_broker.py``), or an existing cluster when
# ``TWOPHASE_KAFKA_BOOTSTRAP`` is set (e.g. the one of docker-compose.yml).
# Every test writes to fresh topics, so a shared cluster needs no cleaning.


@pytest.fixture(scope="session")
def kafka_bootstrap(twophase_kafka: str) -> str:
    """``host:port`` of the test session's Kafka broker."""
    return twophase_kafka


@pytest.fixture
def kafka_topic(twophase_kafka_topic: Callable[..., str]) -> Callable[..., str]:
    """``kafka_topic(partitions=3)`` creates a fresh topic and returns its name."""
    return twophase_kafka_topic


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
