"""The Delta versions a sink commits: its claims, and each checkpoint's staged
work as one version: the Delta sink's :class:`~sinks.committer.Committer`
(abort and the sweep of staged work it inherits from :mod:`sinks.delta.sweep`).

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

The commit deletes a transaction's staging markers once its Delta version
exists; staged work that will never be committed is aborted and swept by
:mod:`sinks.delta.sweep`.

A claim is a version of its own, compare-and-set on the snapshot it checked
(:meth:`DeltaCommitter.claim`, :mod:`sinks.delta.progress`).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from deltalake import CommitProperties, Transaction
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import AddAction

from sinks import _faults
from sinks._parallel import raise_first, run_all
from sinks._retry import retry_transient
from sinks.audit import CheckpointEvidence, Finding
from sinks.capabilities import Audits
from sinks.committer import Committable, Committer, Outcome
from sinks.delta import audit as delta_audit
from sinks.delta import merge, progress, replace, spark_txn, store_errors, table
from sinks.delta.constraints import RowRules
from sinks.delta.layout import DeltaSchemaError, Layout, check_file_schema
from sinks.delta.spark_features import SparkRoute
from sinks.delta.storage import marker_path
from sinks.delta.sweep import TRANSIENT, DeltaSweeper
from sinks.errors import REWRITE_ADVICE, CommitRefusedError, PreflightError, TransactionLostError
from sinks.keys import KeyedWrite
from sinks.naming import TxnName
from sinks.progress import SinkProgress, conflict, may_claim
from sinks.scope import ClaimedScopes, JobScope

log = logging.getLogger("sinks.delta")

T = TypeVar("T")

FILE_THREADS = 8
"""Staged files a commit checks, or unmarks, at once: each is a round trip or
two on an object store, and a checkpoint commits a file or more per task."""


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
class DeltaCommitter(DeltaSweeper, Audits, Committer):
    """Commits one Delta sink's claims and staged work (and aborts and sweeps
    it, as a :class:`~sinks.delta.sweep.DeltaSweeper`)."""

    claims: ClaimedScopes
    rules: KeyedWrite
    replace_where: str | None
    spark_route: SparkRoute
    """how delta-spark reaches the table (:func:`~sinks.delta.spark_features.route`)"""

    # -- progress and claims -----------------------------------------------------------

    def progress(self, scope: JobScope) -> SinkProgress:
        """The owner of ``scope`` and the batch up to which it holds it committed."""
        dt = self.load()
        return progress.read(dt, scope) if dt is not None else SinkProgress(owner=None)

    def claim(self, scope: JobScope, *, start_over_from: str | None = None) -> SinkProgress:
        """Make ``scope.incarnation`` the owner of ``scope`` (a version of its
        own, compare-and-set) and remember the scope as this sink's."""
        ours = scope.incarnation
        assert ours is not None

        def claim_once() -> SinkProgress:
            dt = self.load()
            if dt is None:
                raise PreflightError(f"{self.where} does not exist (preflight creates it)")
            found = progress.read(dt, scope)
            txn = None
            if found.owner != ours:
                # only a claim to commit needs delta-spark (twophase recover has no
                # Spark): read again through its transaction, which checks what it read
                txn = spark_txn.open_if_needed(dt, self.spark_route, self.where)
                if txn is not None:
                    found = progress.read(txn, scope)
            if not may_claim(found, ours, start_over_from):
                raise conflict(self.where, scope.key(), found, ours)
            if found.owner == ours:
                return found
            if txn is not None:
                txn.commit([], progress.claim_transactions(scope, found.owner))
            else:
                progress.commit_claim(dt, scope, previous=found.owner)  # compare-and-set
            return SinkProgress(owner=ours, batch=-1, previous=found.owner)

        found = retry_transient(
            claim_once,
            what=f"claim of {scope.key()} in {self.where}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )
        self.claims.remember(scope)
        return found

    # -- commit ----------------------------------------------------------------------

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
            transient=TRANSIENT,
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
        txn = spark_txn.open_if_needed(dt, self.spark_route, where, rewrites=rewrites)
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
            spark_blocked=None,  # open_if_needed opened delta-spark's transaction if needed
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
        adds = self._checked_adds(cs, layout)
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
        self._each_file(
            [marker_path(a["path"]) for c in cs for a in c["adds"]], self.storage.delete, "unmark"
        )

    def _checked_adds(self, cs: list[Committable], layout: Layout) -> list[AddAction]:
        """:meth:`checked_add` of every staged file of ``cs``, a few at once
        (each looks the file up and reads its footer: round trips on an object
        store); the first failing check, in the files' order, is raised."""
        pairs = [(c, a) for c in cs for a in c["adds"]]
        return self._each_file(pairs, lambda ca: self.checked_add(ca[0], ca[1], layout), "check")

    def _each_file(self, items: Sequence[Any], call: Callable[[Any], T], what: str) -> list[T]:
        calls = [functools.partial(call, item) for item in items]
        done = raise_first(run_all(calls, limit=FILE_THREADS, name=f"twophase-delta-{what}"))
        return cast(list[T], done)

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

    def classify(self, committables: Sequence[Committable]) -> dict[str, Outcome]:
        """The checks of :meth:`commit`: committed when the table's app version of
        its scope is at or above its batch (commits carry the highest batch of
        their call, and batches only grow); else prepared when every staged file
        is there as prepared and its rows were checked against the table's row
        rules of now, lost when one is gone or changed or the rules changed."""

        def read() -> dict[str, Outcome]:
            dt = self.load()
            if dt is None:
                return {c["txn"]: Outcome.LOST for c in committables}
            layout = table.layout_of(dt)
            try:
                rules = RowRules.of(dt, self.where).digest
            except DeltaSchemaError:
                rules = None  # rules no row can be checked against: nothing commits
            found: dict[str, Outcome] = {}
            for c in committables:
                name = TxnName.require(c["txn"])
                scope = JobScope(name.job, name.pipeline, name.sink_id, name.incarnation)
                done = dt.transaction_version(app_id(scope))
                if done is not None and done >= name.batch_id:
                    found[c["txn"]] = Outcome.COMMITTED
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
                    found[c["txn"]] = Outcome.LOST
                else:
                    found[c["txn"]] = Outcome.PREPARED
            return found

        return retry_transient(
            read,
            what=f"check of {len(committables)} staged transaction(s) in {self.where}",
            transient=TRANSIENT,
            deadline=self.commit_timeout,
        )

    # -- audits ----------------------------------------------------------------------

    def evidence(self, committable: Committable) -> dict[str, Any]:
        return delta_audit.evidence(committable)

    def audit(self, scope: JobScope, checkpoints: Sequence[CheckpointEvidence]) -> list[Finding]:
        try:
            dt = self.load()
        except (DeltaError, OSError) as e:
            said = store_errors.explain(e, self.storage.table_uri, self.storage.storage_options)
            raise OSError(f"cannot open {self.where}: {said}") from None
        return delta_audit.audit(self.storage, dt, app_id(scope), checkpoints)
