"""The commit of a keyed Delta sink: a merge planned by the driver, run by Spark.

At a checkpoint the committables of a keyed sink hold change files
(:mod:`sinks.delta.changes`): per batch and task, the winning row of each key,
writes and deletes. The commit applies them to the table copy-on-write:

1. **plan** (driver, :func:`~sinks.delta.merge_plan.plan`): on the snapshot
   the commit builds on, the files that may hold a changed key, found from the
   log and the files' statistics alone;
2. **rewrite** (executors, :func:`~sinks.delta.merge_rewrite.rewrite`): one
   Spark job reads the change files (the last batch's row of each key wins)
   and the candidate files, keeps the candidates' rows whose key is not
   changed, adds the rows the changes write, and stages the result with
   Spark's Parquet writer (:class:`~sinks.delta.spark_stage.SparkStage`: files
   named after a transaction of the sink's scope and the checkpoint's highest
   batch, with their markers, so a sweep finds them after any crash); on an
   object store the tasks read and stage with the sink's own store and writer
   (:mod:`sinks.delta.task_io`), with no Hadoop file system and no rename;
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
hold a changed key; on a table with deletion vectors it rewrites none: the
changed rows are marked deleted in vectors and only they are written
(merge-on-read, :mod:`sinks.delta.spark_dv`), the files staged under a
transaction of the sink's scope named after the merge's highest batch
(:mod:`sinks.delta.spark_staged`), which the version's ``commitInfo`` names.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction

from sinks import _faults
from sinks.base import Committable, JobScope
from sinks.delta import progress, spark_dv, spark_rewrite, table
from sinks.delta.layout import Layout
from sinks.delta.merge_plan import Candidate, Change, changes_of, plan, removes
from sinks.delta.merge_rewrite import rewrite, winning_changes
from sinks.delta.spark_stage import SparkStage
from sinks.delta.spark_staged import MERGE_TAG, Staged
from sinks.delta.spark_txn import SparkTxn, data_files
from sinks.delta.storage import TableStorage, marker_path
from sinks.delta.task_io import TaskStage
from sinks.errors import REWRITE_ADVICE, TransactionLostError
from sinks.keys import KeyedWrite
from sinks.naming import TxnName

log = logging.getLogger("sinks.delta")


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
    run = max(TxnName.require(c["txn"]).run for c in committables)
    if txn is not None:
        marks = Staged(storage, str(_merge_name(scope, run, version)))
        _commit_through_delta_spark(
            txn,
            dt,
            layout,
            storage,
            rules,
            candidates,
            changes,
            _changed(committables),
            (app, version, marks),
            where,
        )
        discard_changes(storage, committables)
        return
    spark = SparkSession.builder.getOrCreate()
    staged: Committable | None = None
    planned_on = dt.version()
    stager = (
        SparkStage(storage, layout, where)
        if storage.root is not None
        else TaskStage(storage, layout, where)
    )
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
    epoch: tuple[str, int, Staged],
    where: str,
) -> None:
    """The merge read, written and committed by delta-spark's transaction
    (:mod:`sinks.delta.spark_rewrite`; on a table with deletion vectors, on
    read: :mod:`sinks.delta.spark_dv`, its files marked by ``epoch``'s
    :class:`~sinks.delta.spark_staged.Staged`): the same plan and the same
    winners, and the same recovery (a stale plan or another writer first: plan
    again)."""
    app, version, staged = epoch
    spark = txn.spark
    written: list[Any] = []
    marked: list[Any] = []
    config = dict(dt.metadata().configuration or {})
    on_read = spark_dv.enabled(config)
    try:
        winners = winning_changes(spark, storage, layout, rules, changes)
        planned = txn.live_files([c.path for c in candidates])
        if on_read and planned:
            found = spark_rewrite.changed_on_read(txn, rules.key, planned, winners)
            try:
                rows = spark_rewrite.merged(txn, layout, rules.key, [], winners, config, found)
                written = txn.write(rows)
                staged.record(written)
                marked, files = spark_dv.mark_deleted(txn, found, staged)
            finally:
                found.release()
        else:
            files = spark_rewrite.touched(txn, rules.key, planned, winners)
            rows = spark_rewrite.merged(txn, layout, rules.key, files, winners, config)
            written = txn.write(rows)
            if on_read:
                staged.record(written)
    except Exception as e:
        staged.discard()  # nothing committed: what was marked goes
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
        "filesWithNewVectors": len(data_files(marked)),
        "staged": staged.name,
    }
    try:
        _faults.hit("driver.merge_staged", batch=version, sink="delta")
        txn.commit(
            [],
            [Transaction(app, version, int(time.time() * 1000))],
            epoch=(app, version),
            removed=files,
            written=written,
            marked=marked,
            tags={MERGE_TAG: json.dumps(summary, sort_keys=True)},
        )
        _faults.hit("driver.merge_landed", batch=version, sink="delta")
    except BaseException as e:
        if _did_not_land(e, dt, app, version, where):
            spark_rewrite.delete_written(storage, written)
            staged.discard()
        raise
    staged.done()
    log.info(
        "%s: merged %d change(s) of %d batch(es) as %s v%d through delta-spark: %d of %d "
        "planned file(s) held a changed key and were %s, %d file action(s) written",
        where,
        sum(ch.rows for ch in changes),
        len({ch.batch for ch in changes}),
        app,
        version,
        len(files) + len(data_files(marked)),
        len(planned),
        "marked (deletion vectors)" if on_read else "rewritten",
        len(written),
    )
    _faults.hit("driver.mid_commit", batch=version, sink="delta")


def _merge_name(scope: JobScope, run: int, version: int) -> TxnName:
    """A fresh transaction name of ``scope`` for a merge of batches up to
    ``version``: its staged files and markers are named after it."""
    return TxnName(
        job=scope.job,
        pipeline=scope.pipeline,
        sink_id=scope.sink_id,
        run=run,
        batch_id=version,
        partition=0,
        attempt=_attempt(),
        incarnation=scope.incarnation,
    )


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
