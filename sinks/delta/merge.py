"""The commit of a keyed Delta sink: a merge planned by the driver, run by Spark.

At a checkpoint the committables of a keyed sink hold change files
(:mod:`sinks.delta.changes`): per batch and task, the winning row of each key,
writes and deletes. The commit applies them to the table copy-on-write:

1. **plan** (driver, :func:`plan`): on the snapshot the commit builds on, the
   files that may hold a changed key: those of the changes' partitions when
   every partition column is a key column, and of those the ones whose
   statistics' range of the first key column (integers and dates, whose
   statistics are exact) meets a change file's range. Files without
   statistics are candidates. Nothing else is read;
2. **rewrite** (executors, :func:`rewrite`): one Spark job reads the change
   files (the last batch's row of each key wins) and the candidate files, keeps
   the candidates' rows whose key is not changed, adds the rows the changes
   write, and stages the result with Spark's Parquet writer
   (:class:`~sinks.delta.spark_stage.SparkStage`: files named after a
   transaction of the sink's scope and the checkpoint's highest batch, with
   their markers, so a sweep finds them after any crash);
3. **commit** (driver, :func:`commit`): one Delta version removes the
   candidates and adds the staged files, with the app transaction
   ``txn(appId, highest batch)`` and ``max_commit_retries=0``. A version that
   another writer committed since the snapshot fails it: the staged files are
   deleted and the whole merge is planned again on the new snapshot (the
   caller retries), never committed twice. A retried commit whose version the
   table already holds is recognised by the app transaction and only cleans up.
   So does a rewrite that fails because another writer removed a candidate
   from the table (compacted, then maybe vacuumed away) or a VACUUM deleted a
   staged file before the commit; any other failure is raised as it is.

The change files are deleted once the version exists (a crash before that
leaves them to the sweep, as committed transactions' leftovers).
Write amplification: every candidate file is rewritten whole; how many are
candidates depends on how keys are laid out (:doc:`/performance`). Tables
whose rewrites need delta-spark (deletion vectors, the change data feed,
column mapping, delta-spark-only features) are merged through its transaction
(:mod:`sinks.delta.spark_rewrite`), which rewrites only the candidates that
hold a changed key.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction, RemoveAction

from sinks import _faults
from sinks.base import Committable, JobScope
from sinks.delta import progress, spark_rewrite, table
from sinks.delta.changes import DELETE_COLUMN, change_schema, range_value
from sinks.delta.layout import Layout, partition_value, quoted
from sinks.delta.spark_stage import SparkStage
from sinks.delta.spark_txn import SparkTxn, data_files
from sinks.delta.storage import TableStorage, marker_path
from sinks.errors import REWRITE_ADVICE, TransactionLostError
from sinks.keys import KeyedWrite
from sinks.naming import TxnName

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("sinks.delta")

_BATCH = "_twophase_batch"
_RANK = "_twophase_rank"


@dataclass(frozen=True)
class Change:
    """One staged change file of a batch."""

    path: str
    batch: int
    size: int
    rows: int
    key_range: tuple[Any, Any] | None
    partitions: list[tuple[str | None, ...]] | None


def changes_of(committables: Sequence[Committable]) -> list[Change]:
    """The change files of ``committables``, in batch order."""
    found = []
    for c in committables:
        batch = TxnName.require(c["txn"]).batch_id
        for ch in c.get("changes", ()):
            kr = ch.get("key_range")
            parts = ch.get("partitions")
            found.append(
                Change(
                    ch["path"],
                    batch,
                    int(ch["size"]),
                    int(ch["rows"]),
                    (kr[0], kr[1]) if kr else None,
                    [tuple(p) for p in parts] if parts is not None else None,
                )
            )
    return sorted(found, key=lambda ch: (ch.batch, ch.path))


@dataclass(frozen=True)
class Candidate:
    """A table file that may hold a changed key: rewritten and removed."""

    path: str
    size: int
    rows: int | None
    partition_values: dict[str, str | None]

    @classmethod
    def of(cls, action: dict[str, Any], partition_by: Sequence[str]) -> Candidate:
        """The file of a row of ``DeltaTable.get_add_actions(flatten=True)``."""
        return cls(
            unquote(str(action["path"])),  # the log's paths are URL-encoded
            int(action["size_bytes"]),
            None if action.get("num_records") is None else int(action["num_records"]),
            {c: partition_value(action.get(f"partition.{c}")) for c in partition_by},
        )


def _exact_range_type(t: pa.DataType) -> bool:
    """Key types whose Delta statistics are exact (strings are cut to a prefix,
    timestamps to milliseconds)."""
    return pa.types.is_integer(t) or pa.types.is_date(t)


def plan(
    dt: DeltaTable, layout: Layout, rules: KeyedWrite, changes: Sequence[Change]
) -> list[Candidate]:
    """The files of ``dt``'s snapshot that may hold a key of ``changes``."""
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    parts = layout.partition_by
    by_partition = bool(parts) and set(parts) <= set(rules.key)
    allowed: set[tuple[str | None, ...]] | None = None
    if by_partition and all(ch.partitions is not None for ch in changes):
        allowed = {p for ch in changes for p in ch.partitions or ()}
    first = rules.key[0]
    ranges: list[tuple[Any, Any]] | None = None
    if (
        first not in parts
        and _exact_range_type(layout.schema.field(first).type)
        and all(ch.key_range is not None for ch in changes)
    ):
        ranges = [ch.key_range for ch in changes if ch.key_range is not None]
    # statistics are keyed by physical names on a column-mapped table (partition
    # values by logical ones, as deltalake gives them)
    stat = layout.mapping.name(first) if layout.mapping is not None else first
    found = []
    for a in actions:
        candidate = Candidate.of(a, parts)
        pv = candidate.partition_values
        if allowed is not None and tuple(pv[c] for c in parts) not in allowed:
            continue
        if ranges is not None:
            low, high = range_value(a.get(f"min.{stat}")), range_value(a.get(f"max.{stat}"))
            if (
                low is not None
                and high is not None
                and not any(lo <= high and low <= hi for lo, hi in ranges)
            ):
                continue
        found.append(candidate)
    return found


def removes(candidates: Sequence[Candidate]) -> list[RemoveAction]:
    now = int(time.time() * 1000)
    return [
        RemoveAction(
            path=c.path,
            data_change=True,
            deletion_timestamp=now,
            size=c.size,
            partition_values=c.partition_values,
        )
        for c in candidates
    ]


def _spark_type(t: pa.DataType) -> Any:
    from pyspark.sql.pandas.types import from_arrow_type

    return from_arrow_type(t, prefer_timestamp_ntz=True)


def _spark_schema(schema: pa.Schema) -> Any:
    from pyspark.sql.types import StructField, StructType

    return StructType([StructField(f.name, _spark_type(f.type), True) for f in schema])


def as_stored(df: DataFrame, layout: Layout) -> DataFrame:
    """``df`` with its string partition columns as Delta stores them: an empty
    string is null (:func:`sinks.delta.layout.partition_value`)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    for c in layout.partition_by:
        if isinstance(df.schema[c].dataType, StringType):
            col = F.col(quoted(c))
            df = df.withColumn(c, F.when(col == F.lit(""), F.lit(None)).otherwise(col))
    return df


def _winners(
    spark: SparkSession,
    storage: TableStorage,
    layout: Layout,
    rules: KeyedWrite,
    changes: Sequence[Change],
) -> DataFrame:
    """The changes of every batch, the last batch's row per key."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    schema = _spark_schema(change_schema(layout))
    frames = []
    for batch in sorted({ch.batch for ch in changes}):
        paths = [storage.path(ch.path) for ch in changes if ch.batch == batch]
        frames.append(spark.read.schema(schema).parquet(*paths).withColumn(_BATCH, F.lit(batch)))
    # change files of an earlier version may hold "" in a partition key column
    df = as_stored(functools.reduce(lambda a, b: a.unionByName(b), frames), layout)
    if len(frames) == 1:
        return df.drop(_BATCH)  # one row per key already (one task per key)
    w = Window.partitionBy(*[F.col(quoted(k)) for k in rules.key]).orderBy(F.col(_BATCH).desc())
    return df.withColumn(_RANK, F.row_number().over(w)).where(F.col(_RANK) == 1).drop(_RANK, _BATCH)


def _targets(
    spark: SparkSession, storage: TableStorage, layout: Layout, candidates: Sequence[Candidate]
) -> DataFrame | None:
    """The candidates' rows, with their partition values, in table order."""
    from pyspark.sql import functions as F

    if not candidates:
        return None
    file_schema = _spark_schema(layout.file_schema)
    groups: dict[tuple[str | None, ...], list[str]] = {}
    for c in candidates:
        key = tuple(c.partition_values[p] for p in layout.partition_by)
        groups.setdefault(key, []).append(storage.path(c.path))
    frames = []
    for values, paths in groups.items():
        df = spark.read.schema(file_schema).parquet(*paths)
        for col, value in zip(layout.partition_by, values, strict=True):
            t = _spark_type(layout.schema.field(col).type)
            df = df.withColumn(col, F.lit(value).cast(t))
        frames.append(df.select(*[F.col(quoted(n)) for n in layout.schema.names]))
    return functools.reduce(lambda a, b: a.unionByName(b), frames)


def rewrite(
    spark: SparkSession,
    storage: TableStorage,
    layout: Layout,
    rules: KeyedWrite,
    candidates: Sequence[Candidate],
    changes: Sequence[Change],
    where: str,
    stage: Callable[[DataFrame], Committable | None],
) -> Committable | None:
    """Stage (through ``stage``) the candidates' rows with ``changes`` applied."""
    from pyspark.sql import functions as F

    winners = _winners(spark, storage, layout, rules, changes)
    upserts = winners.where(~F.col(DELETE_COLUMN)).drop(DELETE_COLUMN)
    targets = _targets(spark, storage, layout, candidates)
    if targets is None:
        result = upserts
    else:
        keys = winners.select(*[F.col(quoted(k)).alias(f"_k{i}") for i, k in enumerate(rules.key)])
        match = functools.reduce(
            lambda a, b: a & b,
            # null-safe: a partition key column's "" is stored (and staged) as null
            [targets[quoted(k)].eqNullSafe(keys[f"_k{i}"]) for i, k in enumerate(rules.key)],
        )
        kept = targets.join(keys, match, "left_anti")
        result = kept.unionByName(upserts)
    log.debug(
        "%s: merging %d change file(s) into %d candidate file(s)",
        where,
        len(changes),
        len(candidates),
    )
    return stage(result)


def _attempt() -> int:
    """A fresh attempt number for a merge's staged files (never reused, also
    across restarts of the driver)."""
    return int.from_bytes(os.urandom(4), "big") >> 1


def commit(
    *,
    dt: DeltaTable,
    txn: SparkTxn | None,
    layout: Layout,
    storage: TableStorage,
    rules: KeyedWrite,
    committables: Sequence[Committable],
    scope: JobScope,
    app: str,
    version: int,
    where: str,
    checked_add: Callable[[Committable, dict[str, Any]], AddAction],
) -> None:
    """Plan, rewrite and commit the merge of ``committables`` on ``dt`` (the
    caller checked ownership and that ``version`` is not committed yet);
    through delta-spark's transaction ``txn`` when the table needs it
    (:mod:`sinks.delta.spark_rewrite`)."""
    from pyspark.sql import SparkSession

    changes = changes_of(committables)
    for ch in changes:
        info = storage.info(ch.path)
        if info is None or info[0] != ch.size:
            raise TransactionLostError(
                f"{where}: change file {ch.path} of batch {ch.batch} is "
                f"{'gone' if info is None else 'changed'} without having been merged; its "
                "changes are not in the table. " + REWRITE_ADVICE
            )
    candidates = plan(dt, layout, rules, changes)
    _faults.hit("driver.merge_planned", batch=version, sink="delta")
    if txn is not None:
        _commit_through_delta_spark(
            txn,
            dt,
            layout,
            storage,
            rules,
            candidates,
            changes,
            _changed(committables),
            app,
            version,
            where,
        )
        discard_changes(storage, committables)
        return
    run = max(TxnName.require(c["txn"]).run for c in committables)
    spark = SparkSession.builder.getOrCreate()
    staged: Committable | None = None
    planned_on = dt.version()
    stager = SparkStage(storage, layout, where)
    try:
        staged = rewrite(
            spark,
            storage,
            layout,
            rules,
            candidates,
            changes,
            where,
            lambda df: stager.stage(df, scope, run, version, _attempt()),
        )
        adds = [checked_add(staged, a) for a in staged["adds"]] if staged else []
    except Exception as e:
        if not _plan_went_stale(dt, candidates, storage, staged, e):
            raise
        _delete_staged(storage, staged)
        raise CommitFailedError(
            f"{where}: another writer committed while the merge read and staged the files it "
            f"planned on version {planned_on} (some are gone: {str(e)[:300]}); planning again"
        ) from e
    rewritten = sum(c.size for c in candidates)
    summary = {
        "changes": _changed(committables),
        "filesRemoved": len(candidates),
        "bytesRewritten": rewritten,
        "filesAdded": len(adds),
    }
    try:
        _faults.hit("driver.merge_staged", batch=version, sink="delta")
        dt.create_write_transaction(
            [*adds, *removes(candidates)],
            mode="append",
            schema=dt.schema(),
            partition_by=list(layout.partition_by) or None,
            commit_properties=CommitProperties(
                app_transactions=[Transaction(app, version, int(time.time() * 1000))],
                custom_metadata={
                    **progress.history_metadata(
                        app,
                        version,
                        adds,
                        removed_files=len(candidates),
                        removed_bytes=rewritten,
                    ),
                    "twophaseMerge": json.dumps(summary, sort_keys=True),
                },
                max_commit_retries=0,  # another writer first: plan again on its version
            ),
        )
        _faults.hit("driver.merge_landed", batch=version, sink="delta")
    except BaseException as e:
        if _did_not_land(e, dt, app, version, where):
            _delete_staged(storage, staged)
        raise
    log.info(
        "%s: merged %d change(s) of %d batch(es) as %s v%d: %d file(s) (%d bytes) rewritten, "
        "%d added",
        where,
        sum(ch.rows for ch in changes),
        len({ch.batch for ch in changes}),
        app,
        version,
        len(candidates),
        rewritten,
        len(adds),
    )
    _faults.hit("driver.mid_commit", batch=version, sink="delta")
    for a in staged["adds"] if staged else ():
        storage.delete(marker_path(a["path"]))
    discard_changes(storage, committables)


def _commit_through_delta_spark(
    txn: SparkTxn,
    dt: DeltaTable,
    layout: Layout,
    storage: TableStorage,
    rules: KeyedWrite,
    candidates: Sequence[Candidate],
    changes: Sequence[Change],
    changed: dict[str, int],
    app: str,
    version: int,
    where: str,
) -> None:
    """The merge read, written and committed by delta-spark's transaction
    (:mod:`sinks.delta.spark_rewrite`): the same plan and the same winners, and
    the same recovery (a stale plan or another writer first: plan again)."""
    spark = txn.spark
    written: list[Any] = []
    try:
        winners = _winners(spark, storage, layout, rules, changes)
        planned = txn.live_files([c.path for c in candidates])
        files = spark_rewrite.touched(txn, rules.key, planned, winners)
        config = dict(dt.metadata().configuration or {})
        rows = spark_rewrite.merged(txn, layout, rules.key, files, winners, config)
        written = txn.write(rows)
    except Exception as e:
        if isinstance(e, CommitFailedError) or not _plan_went_stale(
            dt, candidates, storage, None, e
        ):
            raise
        raise CommitFailedError(
            f"{where}: another writer committed while the merge read the files it planned "
            f"on version {dt.version()} (some are gone: {str(e)[:300]}); planning again"
        ) from e
    summary = {
        "changes": dict(changed),
        "filesRemoved": len(files),
        "bytesRewritten": sum(int(f.size()) for f in files),
        "filesAdded": len(data_files(written)),
    }
    try:
        _faults.hit("driver.merge_staged", batch=version, sink="delta")
        txn.commit(
            [],
            [Transaction(app, version, int(time.time() * 1000))],
            epoch=(app, version),
            removed=files,
            written=written,
            tags={"twophaseMerge": json.dumps(summary, sort_keys=True)},
        )
        _faults.hit("driver.merge_landed", batch=version, sink="delta")
    except BaseException as e:
        if _did_not_land(e, dt, app, version, where):
            spark_rewrite.delete_written(storage, written)
        raise
    log.info(
        "%s: merged %d change(s) of %d batch(es) as %s v%d through delta-spark: %d of %d "
        "planned file(s) held a changed key and were rewritten, %d file action(s) written",
        where,
        sum(ch.rows for ch in changes),
        len({ch.batch for ch in changes}),
        app,
        version,
        len(files),
        len(planned),
        len(written),
    )
    _faults.hit("driver.mid_commit", batch=version, sink="delta")


def _changed(committables: Sequence[Committable]) -> dict[str, int]:
    """The change rows per transaction, as the merge's ``commitInfo`` records
    them for ``twophase audit``."""
    return {c["txn"]: int(c.get("rows", 0)) for c in committables}


def _delete_staged(storage: TableStorage, staged: Committable | None) -> None:
    for a in staged["adds"] if staged else ():
        storage.delete(a["path"])
        storage.delete(marker_path(a["path"]))


def _plan_went_stale(
    dt: DeltaTable,
    candidates: Sequence[Candidate],
    storage: TableStorage,
    staged: Committable | None,
    e: Exception,
) -> bool:
    """Whether a rewrite failed because another writer changed what it planned
    on: a planned file is no longer in the table's latest snapshot (compacted,
    then maybe vacuumed away), or a staged file of it is gone (a VACUUM). Any
    other failure is the rewrite's own and is raised as it is."""
    if (
        isinstance(e, TransactionLostError)
        and staged is not None
        and any(storage.info(a["path"]) is None for a in staged["adds"])
    ):
        return True
    try:
        dt.update_incremental()
        live = table.committed_paths(dt)
    except Exception:
        return False
    return any(c.path not in live for c in candidates)


def _did_not_land(e: BaseException, dt: DeltaTable, app: str, version: int, where: str) -> bool:
    """Whether the merge's version is certainly not in the table, so that its
    staged files may go. Only a commit Delta refused (a conflict, a protocol
    refusal; not a store error, whose write may still land) whose table, read
    again, holds no version of the app at ``version``. An error after the
    version landed (a post-commit hook, an interrupt), or a write in doubt,
    keeps them: deleting them would leave a committed version pointing at
    missing files, and their markers let the sweep delete them only if no
    version references them."""
    if not isinstance(e, CommitFailedError) or "object store" in str(e).lower():
        return False
    try:
        dt.update_incremental()  # to the latest version
        done = dt.transaction_version(app)
    except Exception:
        log.warning(
            "%s: cannot tell whether %s v%d landed; its files are kept", where, app, version
        )
        return False
    return done is None or done < version


def discard_changes(storage: TableStorage, committables: Sequence[Committable]) -> None:
    """Delete the change files of ``committables`` and their markers."""
    for c in committables:
        for ch in c.get("changes", ()):
            storage.delete(ch["path"])
            storage.delete(marker_path(ch["path"]))
