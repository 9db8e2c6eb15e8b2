"""Which Delta tables a sink commits to through delta-spark, and whether the driver can.

delta-rs refuses any commit to a table whose protocol lists a writer feature it
does not implement; tables made by delta-spark often list such features
(:data:`DELTA_SPARK_FEATURES`). Rewrites (a keyed merge, a replace) of tables
with deletion vectors, the change data feed or column mapping
(:data:`REWRITE_FEATURES`) need delta-spark too. The commits to those tables
go through delta-spark's own transaction (:mod:`sinks.delta.spark_txn`), which
needs a driver whose Spark session has delta-spark's jars (:func:`session`)
and a table that session reaches (:func:`route`). Preflight refuses a table
that needs what the job lacks (:func:`sinks.delta.table.check_writable`).

**Where delta-spark reaches a table** (:func:`route`):

* a local or shared-filesystem table by its ``file:`` URI;
* ``hdfs://`` by the same URI, through the HDFS client pyspark bundles.
  delta-spark commits there by a rename that never overwrites
  (``HDFSLogStore``), as atomic as deltalake's commit;
* ``s3://``, ``s3a://`` as ``s3a://`` (Hadoop's S3A, configured in the
  session's ``spark.hadoop.fs.s3a.*``). delta-spark commits to S3 with
  ``S3SingleDriverLogStore``, which checks that a version is free and then
  writes it without a condition (Hadoop 3.5's S3A adds ``If-None-Match`` only
  when asked through ``createFile``, which delta-spark does not do): a writer
  committing the same version between the check and the write loses its
  commit. So on S3 the sink commits through delta-spark only when the job
  says that nothing else commits to the table while it runs,
  ``DeltaSink(..., other_writers="none")``, and refuses otherwise;
* other stores (GCS, Azure) are not tested here and are refused.

A table reached by a URI is checked to be the table deltalake reads (the same
table id, :func:`sinks.delta.spark_txn.check_reaches`): a session whose S3A
points at another endpoint or bucket is refused before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deltalake import DeltaTable

from sinks.delta import s3_writers
from sinks.delta.column_mapping import MODE_KEY
from sinks.delta.storage import local_root
from sinks.errors import CommitRefusedError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DELTA_SPARK_FEATURES = frozenset(
    {
        "rowTracking",
        "inCommitTimestamp",
        "clustering",
        "domainMetadata",
        "typeWidening",
        "typeWidening-preview",
        "v2Checkpoint",
    }
)
"""writer features delta-rs refuses to commit to and delta-spark's own commit
honours for the files this sink adds"""

_DELTA_LOG_CLASS = "org.apache.spark.sql.delta.DeltaLog"


class DeltaSparkMissingError(CommitRefusedError):
    """The table needs delta-spark's commit and the driver's session lacks it."""


CHANGE_DATA_FEED = "delta.enableChangeDataFeed"
ROW_TRACKING = "delta.enableRowTracking"


def property_on(config: dict[str, str], key: str) -> bool:
    """Whether the boolean table property ``key`` is true in ``config`` (the
    table's properties; Delta reads them case-insensitively, false when unset)."""
    return str(config.get(key, "false")).lower() == "true"


REWRITE_FEATURES = ("deletionVectors", "changeDataFeed", "columnMapping")
"""features of a table whose rewrites (a keyed merge, a replace) go through
delta-spark, which reads and removes files by them and writes what they need
(:mod:`sinks.delta.spark_rewrite`); delta-rs commits appends to such tables"""


def needed(dt: DeltaTable, *, rewrites: bool = False) -> list[str]:
    """The table's features for which commits go through delta-spark: the
    writer features delta-rs cannot write, and with ``rewrites`` (the commits
    remove files) those of :data:`REWRITE_FEATURES` the table uses."""
    proto = dt.protocol()
    features = set(proto.writer_features or ()) | set(proto.reader_features or ())
    found = features & DELTA_SPARK_FEATURES
    if rewrites:
        config = dt.metadata().configuration or {}
        if "deletionVectors" in features:
            found.add("deletionVectors")
        if property_on(config, CHANGE_DATA_FEED):
            found.add("changeDataFeed")
        if config.get(MODE_KEY) not in (None, "none"):
            found.add("columnMapping")
    return sorted(found)


def session() -> SparkSession | None:
    """The driver's Spark session if its JVM has delta-spark, else ``None``
    (never starts one)."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession() or SparkSession._instantiatedSession
    if spark is None:
        return None
    jvm = spark._jvm
    if jvm is None:
        return None
    try:
        jvm.py4j.reflection.ReflectionUtil.classForName(_DELTA_LOG_CLASS)
    except Exception:
        return None
    return spark


def missing_advice() -> str:
    """How to give a job's session delta-spark (for error messages), for the
    installed pyspark's Spark line."""
    import pyspark

    spark_line = ".".join(pyspark.__version__.split(".")[:2])
    return (
        "start the job's Spark session with delta-spark (spark.jars or --packages "
        f"io.delta:delta-spark_{spark_line}_2.13 with io.delta:delta-storage, and "
        "spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension)"
    )


_SAME_URI = ("hdfs://",)


@dataclass(frozen=True)
class SparkRoute:
    """How the driver's delta-spark reaches a table (:func:`route`)."""

    uri: str | None
    """what ``DeltaLog.forTable`` opens; ``None`` when the sink may not commit
    to the table through delta-spark"""
    refused: str = ""
    """why not (``uri`` is ``None``), worded as what it needs"""

    def blocked(self) -> str | None:
        """What the sink lacks to commit through delta-spark now (worded as
        what it needs), ``None`` when it can."""
        if self.uri is None:
            return self.refused
        if session() is None:
            return "a job whose Spark session has delta-spark: " + missing_advice()
        return None


def route(table_uri: str, other_writers: str = "check") -> SparkRoute:
    """How delta-spark reaches the table at ``table_uri`` (a local path or a
    URI, as :class:`~sinks.delta.sink.DeltaSink` keeps it), given the sink's
    ``other_writers`` (module doc)."""
    root = local_root(table_uri)
    if root is not None:
        return SparkRoute(Path(root).resolve().as_uri())  # never fs.defaultFS
    if table_uri.lower().startswith(_SAME_URI):
        return SparkRoute(table_uri.rstrip("/"))
    if s3_writers.needs_check(table_uri):
        if other_writers != "none":
            return SparkRoute(
                None,
                "other_writers='none' on S3 (delta-spark commits to S3 without a "
                "conditional PUT: S3SingleDriverLogStore checks that a version is free, "
                "then writes it, so a writer that commits the same version in between "
                "loses its commit). Pass DeltaSink(..., other_writers='none') if nothing "
                "else commits to the table while this job runs",
            )
        return SparkRoute("s3a://" + table_uri.split("://", 1)[1].rstrip("/"))
    scheme = table_uri.split("://", 1)[0]
    return SparkRoute(
        None,
        f"a local, shared-filesystem, HDFS or S3 table (delta-spark's commit to "
        f"{scheme}:// is not tested with this sink)",
    )
