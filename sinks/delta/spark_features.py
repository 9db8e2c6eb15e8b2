"""Which Delta tables a sink commits to through delta-spark, and whether the driver can.

delta-rs refuses any commit to a table whose protocol lists a writer feature it
does not implement; tables made by delta-spark often list such features
(:data:`DELTA_SPARK_FEATURES`). Rewrites (a keyed merge, a replace) of tables
with deletion vectors, the change data feed or column mapping
(:data:`REWRITE_FEATURES`) need delta-spark too. The commits to those tables
go through delta-spark's own transaction (:mod:`sinks.delta.spark_txn`), which
needs a local or shared-filesystem table and a driver whose Spark session has
delta-spark's jars (:func:`session`, :func:`available`). Preflight refuses a
table that needs what the job lacks (:func:`sinks.delta.table.check_writable`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltalake import DeltaTable

from sinks.delta.column_mapping import MODE_KEY
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


def available(root: str | None) -> bool:
    """Whether commits to the table at ``root`` can go through delta-spark."""
    return root is not None and session() is not None
