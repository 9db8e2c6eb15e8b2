"""From ``foreachBatch`` with delta-spark's idempotent writes to DeltaSink on
the same table (:mod:`lifecycle.adopt`).

The old query writes each batch with ``txnAppId``/``txnVersion`` and stops
inside its last batch, after the write landed or before it; the job adopts
its Spark checkpoint and goes on with DeltaSink. Every input row is in the
table once: no batch written twice, none skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from lifecycle import AdoptionRefusedError, Job, adopt_checkpoint
from lifecycle.testing import jars
from sinks import DeltaSink
from tests import deltacheck
from tests.tiers import params

SCHEMA = "id long, v string"
APP = "orders-stream"


def _add_input(src: Path, first: int, files: int, rows: int = 5) -> None:
    src.mkdir(exist_ok=True)
    for f in range(files):
        n = first + f
        path = src / f"part-{n:03d}.json"
        path.write_text(
            "".join(json.dumps({"id": n * rows + i, "v": f"r{n}"}) + "\n" for i in range(rows))
        )
        os.utime(path, (1_700_000_000 + n, 1_700_000_000 + n))


def _old_query(spark, src: Path, table: Path, checkpoint: Path, stop_in: int, landed: bool):  # type: ignore[no-untyped-def]
    """The user's job before: foreachBatch, delta-spark's idempotent append.
    It dies inside batch ``stop_in``, after its write (``landed``) or before."""

    def write(df: Any, batch_id: int) -> None:
        if batch_id == stop_in and not landed:
            raise RuntimeError("the old job dies before batch's write")
        (
            df.write.format("delta")
            .option("txnAppId", APP)
            .option("txnVersion", batch_id)
            .mode("append")
            .save(str(table))
        )
        if batch_id == stop_in:
            raise RuntimeError("the old job dies after the batch's write")

    query = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(src))
        .writeStream.option("checkpointLocation", str(checkpoint))
        .foreachBatch(write)
        .start()
    )
    with pytest.raises(Exception, match="the old job dies"):
        query.awaitTermination()


@pytest.mark.parametrize("landed", params(["landed", "not landed"], keep=["landed"]))
def test_a_foreach_batch_job_with_idempotent_writes_moves_to_delta_sink(spark, tmp_path, landed):  # type: ignore[no-untyped-def]
    """Batches 0 and 1 are written and recorded; batch 2 dies after its write
    landed (the table holds txnVersion 2, Spark has no commits/2: adopting
    records it) or before (Spark replays it through DeltaSink). The job then
    reads two more files. Every id once; delta-spark reads every version."""
    jars.require("delta")
    src, table, old = tmp_path / "in", tmp_path / "t", tmp_path / "old-checkpoint"
    _add_input(src, 0, 3)
    _old_query(spark, src, table, old, stop_in=2, landed=landed == "landed")
    state = tmp_path / "state"
    with pytest.raises(AdoptionRefusedError, match="give delta_table and txn_app_id"):
        adopt_checkpoint(state, "orders", old)
    with pytest.raises(AdoptionRefusedError, match="is this the table and app id"):
        adopt_checkpoint(state, "orders", old, delta_table=table, txn_app_id="a typo")
    adopted = adopt_checkpoint(state, "orders", old, delta_table=table, txn_app_id=APP)
    assert adopted.last_batch == 2
    assert (adopted.recorded, adopted.replays) == (landed == "landed", landed != "landed")
    with pytest.raises(AdoptionRefusedError, match="already has a Spark checkpoint"):
        adopt_checkpoint(state, "orders", old, delta_table=table, txn_app_id=APP)

    _add_input(src, 3, 2)
    job = Job(spark, "orders", state, checkpoint_interval=0)
    df = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(src))
    job.add_pipeline("orders", df, [DeltaSink(table)], bounded=True)
    job.run()
    deltacheck.assert_exactly_once(table, 25)
    deltacheck.assert_delta_spark_reads_every_version(spark, table)
