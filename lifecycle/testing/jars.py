"""The JVM artifacts the project uses, pinned in one list, fetched with Maven
into a cache outside the repository, and found again by the tests and the kit.

The wheel ships no jar. What needs one:

* ``delta``: delta-spark's jars (``io.delta:delta-spark_<spark>_2.13`` and
  ``delta-storage``), for a Spark session that reads and writes Delta tables
  with the engine Delta users run (tests that read the sink's tables back with
  it, tables made with delta-spark's DML);
* ``spark-kafka``: Spark's Kafka source and sink
  (``spark-sql-kafka-0-10_2.13``) for the pyspark in use;
* ``kafka-broker``: the Apache Kafka broker (``kafka_2.13`` with its runtime
  dependencies), run by Java in KRaft mode;
* ``kafka-tools``: Apache Kafka's command-line tools (``kafka-tools``), for
  the lag ``kafka-consumer-groups.sh --describe`` shows
  (``ConsumerGroupCommand``);
* ``jdbc``: the PostgreSQL JDBC driver (the benchmarks' JDBC baselines).
* ``hdfs``: Hadoop's minicluster (``hadoop-client-minicluster``, with the
  shaded Hadoop client it runs on, and ``slf4j-simple`` for its log), a
  NameNode and a DataNode in one JVM outside Spark (:mod:`lifecycle.testing.hdfs`).
* ``s3proxy``: S3Proxy (``org.gaul:s3proxy`` with its runtime dependencies), an
  S3 server run by Java outside Spark (:mod:`lifecycle.testing.s3proxy`);
* ``s3a``: Hadoop's S3A for Spark (``hadoop-aws`` of the Hadoop release the
  installed pyspark ships, :func:`hadoop_version`, with the AWS SDK bundle it
  declares: about 690 MB), for sessions that read or write ``s3a://``.

Versions follow the installed pyspark where the artifact is built per Spark
line (:func:`artifacts`). The cache is ``$TWOPHASE_JARS`` or
``~/.cache/twophase/jars``: one directory per set and version list, filled by
``mvn dependency:copy-dependencies`` (Maven's own settings and repository
cache apply, so a second machine behind the same mirror works, and a filled
set is used offline: no Maven call at all). Fetch every set::

    python -m lifecycle.testing.jars fetch         # or: fetch delta spark-kafka
    python -m lifecycle.testing.jars path delta    # prints the jars, comma-separated

``scripts/_venv.sh`` runs the fetch, so the README's two commands and
``.ci/run`` have the jars without a step of their own.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

DELTA_VERSION = "4.4.0"
"""delta-spark, Maven and PyPI alike (4.4.1 is on PyPI but not on Maven Central)"""
DELTA_SPARK_LINES = ("4.0", "4.1", "4.2")
"""the Spark lines delta-spark :data:`DELTA_VERSION` is built for (its PyPI
package accepts pyspark 4.0.1 to 4.2.0; Maven has ``delta-spark_<line>_2.13``
for these lines only)"""
KAFKA_VERSION = "4.2.0"
"""the Apache Kafka broker the suite runs (``docker-compose.yml`` has the same)"""
HADOOP_MINICLUSTER_VERSION = "3.5.0"
"""HDFS of the tests (Hadoop's minicluster, :mod:`lifecycle.testing.hdfs`): the
Hadoop release whose client pyspark 4.2.0 ships (``hadoop-client-api-3.5.0``)"""
SLF4J_SIMPLE_VERSION = "1.7.36"
"""the log binding of the minicluster's JVM (the slf4j-api 1.7.36 it depends on)"""
POSTGRES_JDBC_VERSION = "42.7.4"
S3PROXY_VERSION = "2.9.0"
"""S3Proxy, the S3 server of the tests and the kit (:mod:`lifecycle.testing.s3proxy`):
2.9.0 is the first to honour ``If-None-Match``/``If-Match`` on PUT (2.6.0 ignores
them and overwrites), on which delta-rs's commits and the sink's markers rely"""

JARS_ENV = "TWOPHASE_JARS"
"""where the cache is (a directory); default ``~/.cache/twophase/jars``"""


class JarsMissingError(RuntimeError):
    """A set of jars is not in the cache; the message says how to fetch it."""


@dataclass(frozen=True)
class Artifact:
    """One Maven coordinate, fetched with its runtime dependencies unless
    ``transitive`` is false."""

    group: str
    name: str
    version: str
    transitive: bool = True

    def __str__(self) -> str:
        return f"{self.group}:{self.name}:{self.version}"


def spark_version() -> str:
    """The installed pyspark's version (``4.2.0``)."""
    import pyspark

    return str(pyspark.__version__)


def spark_line(version: str | None = None) -> str:
    """The Spark line (``4.2``) that delta-spark's artifact names carry."""
    return ".".join((version or spark_version()).split(".")[:2])


def hadoop_version() -> str | None:
    """The Hadoop client version the installed pyspark ships (``3.5.0`` for
    pyspark 4.2.0), read from its ``hadoop-client-api`` jar: ``hadoop-aws``
    must match it exactly (S3A is built against one Hadoop release). None
    for a pyspark without jars (``pyspark-client``): no ``s3a`` set then."""
    import pyspark

    found = sorted((Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"))
    m = re.match(r"^hadoop-client-api-(.+)\.jar$", found[-1].name) if found else None
    return m.group(1) if m else None


def _s3a() -> dict[str, list[Artifact]]:
    """The ``s3a`` set (``hadoop-aws`` of :func:`hadoop_version`), when pyspark
    ships a Hadoop client."""
    hadoop = hadoop_version()
    return {"s3a": [Artifact("org.apache.hadoop", "hadoop-aws", hadoop)]} if hadoop else {}


def artifacts(spark: str | None = None) -> dict[str, list[Artifact]]:
    """Every set of jars, for pyspark ``spark`` (default: the installed one)."""
    spark = spark or spark_version()
    return {
        "delta": [
            Artifact("io.delta", f"delta-spark_{spark_line(spark)}_2.13", DELTA_VERSION),
            Artifact("io.delta", "delta-storage", DELTA_VERSION),
        ],
        "spark-kafka": [Artifact("org.apache.spark", "spark-sql-kafka-0-10_2.13", spark)],
        "kafka-broker": [Artifact("org.apache.kafka", "kafka_2.13", KAFKA_VERSION)],
        "kafka-tools": [Artifact("org.apache.kafka", "kafka-tools", KAFKA_VERSION)],
        "jdbc": [Artifact("org.postgresql", "postgresql", POSTGRES_JDBC_VERSION, False)],
        "hdfs": [
            Artifact("org.apache.hadoop", "hadoop-client-minicluster", HADOOP_MINICLUSTER_VERSION),
            Artifact("org.slf4j", "slf4j-simple", SLF4J_SIMPLE_VERSION, False),
        ],
        "s3proxy": [Artifact("org.gaul", "s3proxy", S3PROXY_VERSION)],
        **_s3a(),
    }


SPARK_HOSTED = frozenset({"delta", "spark-kafka", "s3a"})
"""sets that run inside Spark: a dependency Spark ships itself is left out,
so that Spark's own version stays the one on the classpath"""


def _artifact_name(jar: str) -> str:
    """``kafka-clients`` of ``kafka-clients-3.9.2.jar``."""
    m = re.match(r"^(.+?)-\d.*\.jar$", jar)
    return m.group(1) if m else jar


def _spark_jar_names() -> set[str]:
    import pyspark

    return {_artifact_name(p.name) for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}


def cache_root() -> Path:
    """The cache directory (``$TWOPHASE_JARS``, else ``~/.cache/twophase/jars``)."""
    env = os.environ.get(JARS_ENV)
    return Path(env) if env else Path.home() / ".cache" / "twophase" / "jars"


def _set_dir(name: str, arts: list[Artifact]) -> Path:
    digest = hashlib.sha256("\n".join(map(str, arts)).encode()).hexdigest()[:10]
    return cache_root() / f"{name}-{digest}"


def jars(name: str, spark: str | None = None) -> list[Path]:
    """The jar files of set ``name``; :class:`JarsMissingError` when the set was
    never fetched (or its artifacts do not exist for this pyspark)."""
    arts = artifacts(spark)[name]
    d = _set_dir(name, arts)
    if not (d / ".complete").exists():
        raise JarsMissingError(
            f"the {name} jars ({', '.join(map(str, arts))}) are not in {d.parent}: fetch them "
            f"with `python -m lifecycle.testing.jars fetch {name}` (needs Maven and its "
            f"repository), or set {JARS_ENV} to a cache that has them"
        )
    return sorted(d.glob("*.jar"))


def available(name: str) -> bool:
    """Whether set ``name`` is in the cache."""
    try:
        return bool(jars(name))
    except (JarsMissingError, KeyError):
        return False


def classpath(name: str) -> str:
    """The jars of set ``name`` joined for ``spark.jars`` (commas)."""
    return ",".join(str(p) for p in jars(name))


REQUIRE_ENV = "TWOPHASE_REQUIRE_JARS"
"""set (``.ci/run`` does): a test whose jars are missing fails instead of skipping"""


def not_built_for_this_spark(name: str, spark: str | None = None) -> str | None:
    """Why set ``name`` cannot exist for pyspark ``spark`` (default: the
    installed one), or None: delta-spark is built for :data:`DELTA_SPARK_LINES`,
    and ``s3a`` matches the Hadoop client pyspark ships (:func:`hadoop_version`)."""
    spark = spark or spark_version()
    if name == "delta" and spark_line(spark) not in DELTA_SPARK_LINES:
        return (
            f"delta-spark {DELTA_VERSION} is built for Spark {', '.join(DELTA_SPARK_LINES)}, "
            f"not for the pyspark {spark} in use: the tests that read or write with "
            "delta-spark run on the suite's pyspark (the newest delta-spark accepts), and "
            "DeltaSink commits through deltalake here (tables with features only delta-spark "
            "commits are refused, saying so)"
        )
    if name == "s3a" and hadoop_version() is None:
        return "the installed pyspark ships no Hadoop client (hadoop-client-api) for S3A to match"
    return None


def require(name: str) -> list[Path]:
    """For a test: the jars of set ``name``, or skip the test saying how to fetch
    them (fail instead when ``$TWOPHASE_REQUIRE_JARS`` is set, as in CI)."""
    import pytest

    unbuilt = not_built_for_this_spark(name)
    if unbuilt is not None:
        pytest.skip(unbuilt)  # nothing to fetch: CI's newest-pyspark smoke run skips too
    try:
        return jars(name)
    except JarsMissingError as e:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(str(e), pytrace=False)
        pytest.skip(str(e))
        raise  # unreachable: skip raises


DELTA_SQL_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}
"""what a Spark session needs besides delta-spark's jars for Delta's SQL (DELETE, MERGE...)"""


def _pom(arts: list[Artifact]) -> str:
    deps = []
    for a in arts:
        excl = (
            "<exclusions><exclusion><groupId>*</groupId><artifactId>*</artifactId>"
            "</exclusion></exclusions>"
            if not a.transitive
            else ""
        )
        deps.append(
            f"<dependency><groupId>{escape(a.group)}</groupId>"
            f"<artifactId>{escape(a.name)}</artifactId><version>{escape(a.version)}</version>"
            f"{excl}</dependency>"
        )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0">'
        "<modelVersion>4.0.0</modelVersion><groupId>twophase</groupId>"
        "<artifactId>jars</artifactId><version>0</version><packaging>pom</packaging>"
        f"<dependencies>{''.join(deps)}</dependencies></project>"
    )


def fetch(name: str, spark: str | None = None, *, quiet: bool = False) -> list[Path]:
    """Fetch set ``name`` into the cache (nothing when it is there already)."""
    arts = artifacts(spark)[name]
    d = _set_dir(name, arts)
    if (d / ".complete").exists():
        return sorted(d.glob("*.jar"))
    mvn = shutil.which("mvn")
    if mvn is None:
        raise JarsMissingError(
            f"the {name} jars are not cached and Maven (mvn) is not installed to fetch them"
        )
    d.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d.parent) as tmp:
        out = Path(tmp) / "jars"
        (Path(tmp) / "pom.xml").write_text(_pom(arts))
        cmd = [
            mvn,
            "-B",
            "-q",
            "dependency:copy-dependencies",
            f"-DoutputDirectory={out}",
            "-DincludeScope=runtime",
        ]
        if not quiet:
            print(f"fetching the {name} jars: {', '.join(map(str, arts))}", file=sys.stderr)
        done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if done.returncode != 0:
            raise JarsMissingError(
                f"mvn could not fetch the {name} jars ({', '.join(map(str, arts))}):\n"
                + (done.stdout + done.stderr)[-3000:]
            )
        if name in SPARK_HOSTED:
            shipped = _spark_jar_names()
            for jar in out.glob("*.jar"):
                if _artifact_name(jar.name) in shipped:
                    jar.unlink()
        (out / ".complete").write_text("\n".join(map(str, arts)) + "\n")
        if d.exists():
            shutil.rmtree(d)
        out.rename(d)
    return sorted(d.glob("*.jar"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lifecycle.testing.jars", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="fetch sets of jars into the cache")
    f.add_argument("sets", nargs="*", help="default: every set")
    g = sub.add_parser("path", help="print a set's jars, comma-separated")
    g.add_argument("set")
    args = p.parse_args(argv)
    try:
        if args.cmd == "fetch":
            for name in args.sets or list(artifacts()):
                unbuilt = not_built_for_this_spark(name)
                if unbuilt is not None:
                    print(f"{name}: not fetched: {unbuilt}")
                    continue
                n = len(fetch(name))
                print(f"{name}: {n} jar(s) in {_set_dir(name, artifacts()[name])}")
        else:
            print(classpath(args.set))
    except (JarsMissingError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
