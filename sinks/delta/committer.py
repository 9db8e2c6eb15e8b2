"""The driver side of the Delta sink: commit, abort, classify and sweep staged
work (what Flink calls the sink's committer).

The driver commits every staged file of one ``commit`` call (one checkpoint of
one pipeline) as ONE Delta version, through deltalake's
``create_write_transaction``, carrying an application transaction
``txn(appId, version)``:

* ``appId`` is ``tp2.<job>.<pipeline>.<sink_id>.i<incarnation>`` (the scope of
  the transaction names, :func:`sinks.delta.progress.progress_app`);
* ``version`` is the highest Spark batch id among the committables. Spark batch
  ids of a pipeline only grow (a batch with a commit-log entry is never
  replayed, one without is replayed with the same id), and each commit call
  holds every pending batch up to the checkpoint's cut, so successive commits of
  a sink carry increasing versions: the scheme of delta-spark's own streaming
  sink (``txn(queryId, batchId)``), and it needs nothing from the coordinator.

Before committing, on the snapshot the commit is built on: another incarnation
owning the scope refuses the commit
(:class:`~sinks.progress.IncarnationConflictError`); the incarnation's app
version at or above this commit's means the batches are committed already
(this very commit went through before a crash, or Spark replayed batches this
incarnation committed): nothing is committed, and staged files left over are
swept as orphans. The commit itself is made with ``max_commit_retries=0``:
when another writer committed first, the checks run again on the new snapshot.

Appends add the staged files; a keyed sink's commit is a merge
(:mod:`sinks.delta.merge`); a replacing sink's also removes the files of its
slice (:mod:`sinks.delta.replace`).

Before anything is committed every staged file is checked: present (else
:class:`TransactionLostError`), the size and row count recorded at prepare, no
partition columns inside, exactly the table's column types, and partition
values for exactly the table's partition columns (else
:class:`~sinks.delta.layout.DeltaSchemaError`, naming file and column).

Staged files are found through their staging markers (:mod:`sinks.delta.storage`):
``abort_lingering`` lists the marker directory, never the whole table, and the
commit deletes a transaction's markers once its Delta version exists, so a
committed file is never a sweep candidate, even after OPTIMIZE removed it from
the snapshot while time travel still reads it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction

from sinks import _faults
from sinks._retry import retry_transient
from sinks.base import (
    COMMITTED,
    LOST,
    PREPARED,
    ClaimedScopes,
    Committable,
    JobScope,
    LingeringTxn,
    OrphanTest,
)
from sinks.delta import merge, progress, replace, spark_txn, table
from sinks.delta.constraints import RowRules
from sinks.delta.layout import DeltaSchemaError, Layout, check_file_schema
from sinks.delta.storage import (
    DATA_SUFFIX,
    SPARK_STAGING_DIR,
    STAGING_DIR,
    TableStorage,
    marker_path,
    split_stem,
)
from sinks.errors import REWRITE_ADVICE, CommitRefusedError, TransactionLostError
from sinks.keys import KeyedWrite
from sinks.naming import TxnName, scope_prefixes
from sinks.progress import conflict

log = logging.getLogger("sinks.delta")

_TRANSIENT = (CommitFailedError, OSError)

_REFUSALS = (
    "delta table is append-only",
    "unsupported table features",
    "table features must be specified",
)
"""what delta-rs says when it refuses a commit whatever the table's version
(``DeltaTableAppendOnly``, ``UnsupportedTableFeatures``,
``TableFeaturesRequired``); other commit failures are conflicts with another
writer, which a new plan on the new version passes"""


def _refusal(e: CommitFailedError) -> bool:
    text = str(e).lower()
    return any(r in text for r in _REFUSALS)


def app_id(scope: JobScope) -> str:
    """The Delta application id under which a scope's commits are recorded."""
    return progress.progress_app(scope)


@dataclass
class DeltaCommitter:
    """Commits, aborts and sweeps one Delta sink's staged work."""

    where: str
    """the sink, for messages"""
    sink_id: str
    storage: TableStorage
    load: Callable[[], DeltaTable | None]
    claims: ClaimedScopes
    rules: KeyedWrite
    replace_where: str | None
    commit_timeout: float

    def commit(self, committables: Sequence[Committable]) -> None:
        """Commit every staged file of ``committables`` as one Delta version with
        ``txn(app id, highest batch id)``; skip when the table has that version."""
        cs = [c for c in committables if c.get("adds") or c.get("changes")]
        if not cs:
            return
        names = [TxnName.require(c["txn"]) for c in cs]
        scopes = {JobScope(n.job, n.pipeline, n.sink_id, n.incarnation) for n in names}
        if len(scopes) != 1 or next(iter(scopes)).sink_id != self.sink_id:
            raise ValueError(
                f"{self.where} got committables of {sorted(s.key() for s in scopes)}; one commit "
                f"call takes the committables of one pipeline's sink {self.sink_id!r} and "
                "one incarnation"
            )
        scope = scopes.pop()
        version = max(n.batch_id for n in names)
        app = app_id(scope)

        def once() -> None:
            try:
                self._commit_once(cs, scope, version)
            except CommitFailedError as e:
                if not _refusal(e):
                    raise  # another writer first, or the store: plan again
                raise CommitRefusedError(
                    f"{self.where} refused the commit of {app} v{version}: {e} (retrying "
                    "cannot pass this)"
                ) from e

        retry_transient(
            once,
            what=f"commit of {len(cs)} staged transaction(s) as {app} v{version} to {self.where}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )

    def _commit_once(self, cs: list[Committable], scope: JobScope, version: int) -> None:
        where = self.where
        app = app_id(scope)
        dt = self.load()
        if dt is None:
            raise TransactionLostError(
                f"{where} does not exist any more; the staged files of {len(cs)} "
                "transaction(s) cannot be committed"
            )
        owner = self.claims.owner(scope.job, scope.pipeline, scope.sink_id, scope.incarnation)
        rewrites = self.rules.keyed or self.replace_where is not None
        txn = spark_txn.open_if_needed(dt, self.storage.root, where, rewrites=rewrites)
        snapshot = txn if txn is not None else dt  # what the checks read is what commits
        found = progress.read(snapshot, scope)
        if found.owner is not None and owner is not None and found.owner != owner:
            raise conflict(where, scope.key(), found, owner, at_commit=True)
        done = snapshot.transaction_version(app)
        if done is not None and done >= version:
            log.info(
                "%s: %s holds batches up to %d committed, this commit's are up to %d: "
                "committed already (files of a replay, if any, are deleted)",
                where,
                app,
                done,
                version,
            )
            merge.discard_changes(self.storage, cs)
            # This very commit's files are in the table (kept); a replay's are not.
            committed = table.committed_paths(dt)
            for c in cs:
                for a in c.get("adds", ()):
                    if a["path"] not in committed:
                        self.storage.delete(a["path"])
                    self.storage.delete(marker_path(a["path"]))
            return
        row_rules = table.check_writable(
            dt,
            where,
            removes=rewrites,
            delta_spark=txn is not None,
        )
        row_rules.check_staged(cs, where)
        layout = table.layout_of(dt)
        if self.rules.keyed:
            merge.commit(
                dt=dt,
                txn=txn,
                layout=layout,
                storage=self.storage,
                rules=self.rules,
                committables=cs,
                scope=scope,
                app=app,
                version=version,
                where=where,
                checked_add=lambda c, a: self.checked_add(c, a, layout),
            )
            return
        adds = [self.checked_add(c, a, layout) for c in cs for a in c["adds"]]
        gone = (
            replace.removes(dt, layout, self.replace_where)
            if self.replace_where is not None
            else []
        )
        record = Transaction(app, version, int(time.time() * 1000))
        if txn is not None:
            removed = txn.live_files([r.path for r in gone]) if rewrites else []
            txn.commit(adds, [record], epoch=(app, version), removed=removed)
        else:
            dt.create_write_transaction(
                [*adds, *gone],
                mode="append",
                schema=dt.schema(),
                partition_by=list(layout.partition_by) or None,
                commit_properties=CommitProperties(
                    app_transactions=[record],
                    custom_metadata=progress.history_metadata(
                        app,
                        version,
                        adds,
                        removed_files=len(gone),
                        removed_bytes=sum(int(r.size or 0) for r in gone),
                    ),
                    max_commit_retries=0,  # compare-and-set: the checks above held
                ),
            )
        log.debug(
            "%s: committed %d file(s) of %d transaction(s) as %s v%d",
            where,
            len(adds),
            len(cs),
            app,
            version,
        )
        _faults.hit("driver.mid_commit", batch=version, sink="delta")
        for c in cs:
            for a in c["adds"]:
                self.storage.delete(marker_path(a["path"]))

    def checked_add(self, c: Committable, add: dict[str, Any], layout: Layout) -> AddAction:
        """The add action of one staged file, after checking that the file is there,
        unchanged, and fits the table (schema and partition columns)."""
        where, rel, txn = self.where, add["path"], c["txn"]
        info = self.storage.info(rel)
        if info is None:
            raise TransactionLostError(
                f"{where}: staged file {rel} of transaction {txn} is gone without having "
                "been committed (deleted by someone else?); its rows are not in the table. "
                + REWRITE_ADVICE
            )
        if info[0] != add["size"]:
            raise TransactionLostError(
                f"{where}: staged file {rel} of transaction {txn} has {info[0]} bytes, not the "
                f"{add['size']} it had when prepared: it was changed, so it is not committed"
            )
        pv = add["partition_values"]
        stored = layout.stored  # the names files and partition values use
        if sorted(pv) != sorted(stored.partition_by):
            raise DeltaSchemaError(
                f"{where}: staged file {rel} is partitioned by {sorted(pv)} but the table by "
                f"{list(stored.partition_by)}; nothing was committed"
            )
        meta = self.storage.parquet_metadata(rel)
        if json.loads(add["stats"]).get("numRecords") != meta.num_rows:
            raise TransactionLostError(
                f"{where}: staged file {rel} of transaction {txn} holds {meta.num_rows} rows, "
                "not the number its prepare recorded: it was changed, so it is not committed"
            )
        check_file_schema(meta, stored, f"{where}: staged file {rel}")
        return AddAction(
            path=rel,
            size=info[0],
            partition_values=pv,
            modification_time=int(add["modification_time"]),
            data_change=True,
            stats=add["stats"],
        )

    # -- driver side: abort, sweep -----------------------------------------------------

    def abort(self, committables: Sequence[Committable]) -> None:
        """Delete the staged files of ``committables`` (idempotent). A file the
        table references is never deleted."""
        paths = [a["path"] for c in committables for a in c.get("adds", ())]
        paths += [ch["path"] for c in committables for ch in c.get("changes", ())]
        if paths:
            retry_transient(
                lambda: self._delete_staged(paths),
                what=f"abort of {len(committables)} staged transaction(s) in {self.where}",
                transient=_TRANSIENT,
                deadline=self.commit_timeout,
            )

    def _delete_staged(self, paths: list[str]) -> None:
        dt = self.load()
        committed = table.committed_paths(dt) if dt is not None else set()
        for rel in paths:
            if rel in committed:
                log.error("%s: not deleting %s: the table references it", self.where, rel)
            else:
                self.storage.delete(rel)
            self.storage.delete(marker_path(rel))

    def abort_lingering(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        """Delete the staged files of every transaction of ``scope`` that has a
        staging marker and for which ``is_orphan`` is true; return their names.

        Only markers are listed (one small directory), never the whole table.
        Committed transactions have no marker (their commit deleted it); a file
        the table references is kept even so."""
        return retry_transient(
            lambda: self._sweep(scope, is_orphan),
            what=f"sweep of lingering staged files in {self.where}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )

    def _staged(self, prefixes: tuple[str, ...]) -> dict[str, tuple[TxnName, list[str]]]:
        """Every transaction under one of ``prefixes`` that has staging markers:
        its name and the stems of its markers (one per staged file)."""
        found: dict[str, tuple[TxnName, list[str]]] = {}
        for stem in sorted(self.storage.list_files(STAGING_DIR)):
            parts = split_stem(stem) if stem.startswith(prefixes) else None
            name = TxnName.parse(parts[0]) if parts else None
            if name is not None:
                found.setdefault(str(name), (name, []))[1].append(stem)
        return found

    def _spark_staged(self, prefixes: tuple[str, ...]) -> dict[str, TxnName]:
        """Every transaction under one of ``prefixes`` with a Spark staging
        directory (:mod:`sinks.delta.spark_stage`): a batch whose driver died
        before its files moved to their places."""
        found: dict[str, TxnName] = {}
        for d in self.storage.list_dirs(SPARK_STAGING_DIR):
            name = TxnName.parse(d) if d.startswith(prefixes) else None
            if name is not None:
                found[d] = name
        return found

    def lingering(self, job: str, pipeline: str) -> list[LingeringTxn]:
        """Every transaction of (``job``, ``pipeline``, this sink), of every
        incarnation, with staging markers in the table: what :meth:`abort_lingering`
        looks at."""
        prefixes = scope_prefixes(job, pipeline, self.sink_id)
        found, spark = retry_transient(
            lambda: (self._staged(prefixes), self._spark_staged(prefixes)),
            what=f"listing of staged files in {self.where}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )
        return [
            LingeringTxn(txn, name, "staged", f"{len(stems)} staged file(s)")
            for txn, (name, stems) in found.items()
        ] + [
            LingeringTxn(txn, name, "staged", "files in Spark's staging directory")
            for txn, name in spark.items()
            if txn not in found
        ]

    def classify(self, committables: Sequence[Committable]) -> dict[str, str]:
        """The checks of :meth:`commit`: committed when the table's app version of
        its scope is at or above its batch (commits carry the highest batch of
        their call, and batches only grow); else prepared when every staged file
        is there as prepared and its rows were checked against the table's row
        rules of now, lost when one is gone or changed or the rules changed."""

        def read() -> dict[str, str]:
            dt = self.load()
            if dt is None:
                return {c["txn"]: LOST for c in committables}
            layout = table.layout_of(dt)
            try:
                rules = RowRules.of(dt, self.where).digest
            except DeltaSchemaError:
                rules = None  # rules no row can be checked against: nothing commits
            found: dict[str, str] = {}
            for c in committables:
                name = TxnName.require(c["txn"])
                scope = JobScope(name.job, name.pipeline, name.sink_id, name.incarnation)
                done = dt.transaction_version(app_id(scope))
                if done is not None and done >= name.batch_id:
                    found[c["txn"]] = COMMITTED
                    continue
                try:
                    if c.get("checked", "") != rules:
                        raise TransactionLostError(c["txn"])
                    for a in c.get("adds", ()):
                        self.checked_add(c, a, layout)
                    for ch in c.get("changes", ()):
                        if self.storage.info(ch["path"]) is None:
                            raise TransactionLostError(ch["path"])
                except TransactionLostError:
                    found[c["txn"]] = LOST
                else:
                    found[c["txn"]] = PREPARED
            return found

        return retry_transient(
            read,
            what=f"check of {len(committables)} staged transaction(s) in {self.where}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )

    def _sweep(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        prefixes = scope.own_prefixes()
        orphans = {
            txn: stems for txn, (name, stems) in self._staged(prefixes).items() if is_orphan(name)
        }
        spark = sorted(d for d, name in self._spark_staged(prefixes).items() if is_orphan(name))
        for d in spark:
            self.storage.delete_tree(f"{SPARK_STAGING_DIR}/{d}")
        if spark:
            log.info("%s: deleted Spark's staging directories of %s", self.where, spark)
        if not orphans:
            return spark
        dt = self.load()
        committed = table.committed_paths(dt) if dt is not None else set()
        aborted = []
        for txn, stems in sorted(orphans.items()):
            kept = 0
            for stem in stems:
                marker = f"{STAGING_DIR}/{stem}"
                data = self.storage.read(marker)
                rel = data.decode("utf-8", "replace") if data else ""
                if rel in committed:
                    kept += 1  # a marker a crash left behind after the commit
                elif _is_staged_path(rel, stem):
                    self.storage.delete(rel)
                self.storage.delete(marker)
            if kept < len(stems):
                aborted.append(txn)
        if aborted:
            log.info("%s: deleted the staged files of %s", self.where, aborted)
        return sorted(set(aborted) | set(spark))


def _is_staged_path(rel: str, stem: str) -> bool:
    """Whether a marker's content names the data file of ``stem`` (a damaged or
    foreign marker must never make the sweep delete anything else)."""
    parts = rel.split("/")
    return (
        parts[-1] == stem + DATA_SUFFIX
        and not rel.startswith("/")
        and all(p not in ("", ".", "..") and not p.startswith("_delta_log") for p in parts)
    )
