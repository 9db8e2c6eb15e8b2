"""``docker-compose.yml`` names the versions the suite runs natively.

The compose file is for users (there is no Docker engine on the build
machines): its Apache Kafka must be the broker the suite runs
(:data:`lifecycle.testing.jars.KAFKA_VERSION`), its Spark images the Spark of
the installed pyspark, and its PostgreSQL the major of the server the suite
starts (``initdb`` of :func:`lifecycle.testing.postgres_server.find_pg_bindir`).
A drift of any of them fails here, naming the line to change.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from lifecycle.testing import jars
from lifecycle.testing.postgres_server import find_pg_bindir

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"


def _services() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text())["services"])


def _tag(service: str) -> str:
    image = str(_services()[service]["image"])
    return image.rsplit(":", 1)[1]


def test_kafka_is_the_broker_the_suite_runs() -> None:
    assert _tag("kafka") == jars.KAFKA_VERSION, (
        f"docker-compose.yml runs apache/kafka:{_tag('kafka')}, the suite Kafka "
        f"{jars.KAFKA_VERSION} (lifecycle/testing/jars.py KAFKA_VERSION)"
    )


def test_spark_images_are_the_spark_of_the_installed_pyspark() -> None:
    want = f"{jars.spark_version()}-python3"
    for service in ("spark-master", "spark-worker"):
        assert _tag(service) == want, f"{service}: apache/spark:{_tag(service)}, not {want}"
    # the worker image of the comment users copy, too
    named = set(re.findall(r"apache/spark:(\S+)", COMPOSE.read_text()))
    assert named == {want}, f"docker-compose.yml names apache/spark:{sorted(named)}, not {want}"


def test_postgresql_is_the_major_the_suite_runs() -> None:
    out = subprocess.run(
        [str(find_pg_bindir() / "initdb"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    found = re.search(r"(\d+)(?:\.\d+)?", out)
    assert found is not None, out
    major = found.group(1)
    assert _tag("postgres").split(".")[0] == major, (
        f"docker-compose.yml runs postgres:{_tag('postgres')}; the suite's server is "
        f"PostgreSQL {major} ({out.strip()})"
    )
    kit = (Path(__file__).resolve().parents[1] / "lifecycle/testing/plugin.py").read_text()
    assert f'PostgresContainer("postgres:{major}"' in kit, "the kit's container runs another major"


def test_prometheus_is_the_version_the_suite_runs() -> None:
    """The compose service runs the Prometheus of tests/test_prometheus.py
    (major and minor), with the shipped rules and example configuration."""
    from lifecycle.testing.prometheus import binary

    out = subprocess.run([binary(), "--version"], capture_output=True, text=True, check=True)
    found = re.search(r"version (\d+\.\d+)", out.stdout + out.stderr)
    assert found is not None, out.stdout + out.stderr
    tag = _tag("prometheus")
    assert tag.lstrip("v").startswith(found.group(1) + "."), (
        f"docker-compose.yml runs prom/prometheus:{tag}; the suite runs {found.group(0)}"
    )
    mounted = " ".join(_services()["prometheus"]["volumes"])
    assert "integration/prometheus/twophase-rules.yml" in mounted
    assert "integration/prometheus/prometheus.yml" in mounted
