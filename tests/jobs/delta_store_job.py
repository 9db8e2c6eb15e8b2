"""A bounded job from JSON files into a ``DeltaSink`` on a shared store, then
the table read back by delta-spark, all in one driver process.

* ``--table s3://bucket/path`` on an S3 server (the tests' S3Proxy, with
  ``--endpoint`` and its keys): delta-spark reads it through Hadoop's S3A
  (``s3a://``), so the session has S3A's jars (``hadoop-aws`` and the AWS SDK
  bundle, on the driver's classpath) and settings for the server;
* ``--table hdfs://host:port/path`` (the tests' MiniHdfs): deltalake writes
  it through its own HDFS client, delta-spark reads it through the HDFS
  client pyspark bundles.

Prints ``READ {json}`` (what delta-spark read: the latest rows and the rows of
the versions asked for with ``versionAsOf``; the seconds each part took;
nothing with ``--no-read-back``), then the ``RESULT`` line of
:func:`tests.jobs._driver.finish`. Exit 0 only when the job committed. A
``--state`` URI (``s3a://...``, ``hdfs://...``) puts the job's state on the
store too, with the ledger in the local ``--ledger`` directory. ``--keyed``: a
keyed sink (merge by ``id``; a row with a negative ``amount`` deletes its key).
``--delta-spark-sql`` runs a statement through delta-spark before the job
(``{table}`` stands for the table's ``s3a://`` or ``hdfs://`` URI), as another
engine writing the table; ``--other-writers`` is the sink's ``other_writers``.
``--changes-from V`` also reads the change feed from version ``V`` and the
rows' row tracking.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lifecycle import Job
from lifecycle.testing import jars
from lifecycle.testing.s3proxy import s3a_conf
from sinks import DeltaSink
from tests.jobs._driver import finish, start_driver
from tests.sparkutil import INPUT_SCHEMA


def read_back(
    spark: Any, uri: str, versions: list[int], changes_from: int | None = None
) -> dict[str, Any]:
    """What delta-spark reads of the table at ``uri`` (``s3a://``, ``hdfs://``):
    the latest rows, those of ``versions``, and with ``changes_from`` the
    change feed from that version (``[id, change type, version, name, amount]``) and
    each row's row id and row commit version (``[id, row id, version]``)."""

    def rows(df: Any) -> list[list[Any]]:
        return sorted([r["id"], r["name"], r["amount"]] for r in df.collect())

    def read(**options: int) -> list[list[Any]]:
        return rows(spark.read.format("delta").options(**options).load(uri))

    found: dict[str, Any] = {
        "latest": read(),
        "versions": {str(v): read(versionAsOf=v) for v in versions},
    }
    if changes_from is not None:
        feed = (
            spark.read.format("delta")
            .option("readChangeFeed", "true")
            .option("startingVersion", changes_from)
            .load(uri)
        )
        found["changes"] = sorted(
            [r["id"], r["_change_type"], r["_commit_version"], r["name"], r["amount"]]
            for r in feed.collect()
        )
        tracked = spark.read.format("delta").load(uri)
        found["row_ids"] = sorted(
            [r[0], r[1], r[2]]
            for r in tracked.select(
                "id", "_metadata.row_id", "_metadata.row_commit_version"
            ).collect()
        )
    return found


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--ledger")
    ap.add_argument("--table", required=True, help="s3://bucket/path or hdfs://host:port/path")
    ap.add_argument("--endpoint", help="the S3 server's (s3:// tables)")
    ap.add_argument("--access-key")
    ap.add_argument("--secret-key")
    ap.add_argument("--region", default="us-east-1")
    ap.add_argument("--versions", default="0,1,2", help="versions to read back")
    ap.add_argument(
        "--changes-from", type=int, help="read the change feed from this version, and row ids"
    )
    ap.add_argument("--no-read-back", action="store_true", help="no delta-spark read, no S3A")
    ap.add_argument(
        "--keyed", action="store_true", help="merge by id; a negative amount deletes the key"
    )
    ap.add_argument("--partition-by", help="a column to partition the table by")
    ap.add_argument("--replace-where", help="replace the slice this predicate names")
    ap.add_argument("--sink-id", default="orders")
    ap.add_argument("--delta-spark-sql", action="append", default=[], help="run before the job")
    ap.add_argument("--other-writers", default="check")
    ap.add_argument("--conf", action="append", default=[], help="a Spark setting, KEY=VALUE")
    args = ap.parse_args()
    began = time.monotonic()
    s3 = args.table.startswith("s3://")
    conf = {}
    s3a = args.state.startswith("s3a://") or args.delta_spark_sql or not args.no_read_back
    if s3 and s3a:
        conf = s3a_conf(args.endpoint, args.access_key, args.secret_key, args.region)
        # the AWS SDK bundle is ~690 MB: on the driver's classpath it is read in
        # place (local mode runs the executors in the driver's JVM)
        conf["spark.driver.extraClassPath"] = os.pathsep.join(str(p) for p in jars.jars("s3a"))
    # C1 only: delta-spark's first read in a fresh JVM is mostly JIT work; this
    # halves the driver's CPU time (58 s -> 33 s here) for a run this short
    conf["spark.driver.extraJavaOptions"] = "-XX:TieredStopAtLevel=1"
    conf.update(kv.split("=", 1) for kv in args.conf)
    spark = start_driver("s3delta", jvm_packages=True, conf=conf)
    spark_up = time.monotonic()
    options = (
        {
            "AWS_ENDPOINT_URL": args.endpoint,
            "AWS_ACCESS_KEY_ID": args.access_key,
            "AWS_SECRET_ACCESS_KEY": args.secret_key,
            "AWS_REGION": args.region,
            "AWS_ALLOW_HTTP": "true",
        }
        if s3
        else {}
    )
    uri = "s3a://" + args.table.removeprefix("s3://") if s3 else args.table
    for statement in args.delta_spark_sql:
        spark.sql(statement.replace("{table}", f"delta.`{uri}`"))
    df = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(args.input)
    extra = {"ledger": args.ledger} if args.ledger else {}
    job = Job(spark, "s3delta", args.state, checkpoint_interval=0, **extra)
    keyed: dict[str, Any] = {}
    if args.keyed:
        from pyspark.sql import functions as F

        df = df.withColumn("deleted", F.col("amount") < 0)
        keyed = {"key": ["id"], "delete_when": "deleted"}
    sink = DeltaSink(
        args.table,
        storage_options=options,
        sink_id=args.sink_id,
        partition_by=args.partition_by,
        replace_where=args.replace_where,
        other_writers=args.other_writers,
        **keyed,
    )
    job.add_pipeline("load", df, [sink], bounded=True)
    result = job.run()
    ran = time.monotonic()
    if args.no_read_back:
        return finish(spark, result)
    versions = [int(v) for v in args.versions.split(",") if v]
    read = read_back(spark, uri, versions, args.changes_from)
    read["seconds"] = {
        "session": round(spark_up - began, 1),
        "job": round(ran - spark_up, 1),
        "read": round(time.monotonic() - ran, 1),
    }
    print("READ " + json.dumps(read), flush=True)
    return finish(spark, result)


if __name__ == "__main__":
    sys.exit(main())
