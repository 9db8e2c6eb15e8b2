"""Delta Lake exactly-once sink: staged Parquet files, one Delta version per commit.

Executors stage Parquet files in the table directory (:mod:`sinks.delta.writer`);
they are invisible until a Delta version adds them. The driver commits every
staged file of one ``commit`` call (one checkpoint of one pipeline) as ONE Delta
version, through deltalake's ``create_write_transaction``, carrying an
application transaction ``txn(appId, version)``:

* ``appId`` is ``tp2.<job>.<pipeline>.<sink_id>.i<incarnation>`` (the scope of
  the transaction names, :func:`sinks.delta.progress.progress_app`);
* ``version`` is the highest Spark batch id among the committables. Spark batch
  ids of a pipeline only grow (a batch with a commit-log entry is never
  replayed, one without is replayed with the same id), and each commit call
  holds every pending batch up to the checkpoint's cut, so successive commits of
  a sink carry increasing versions: the scheme of delta-spark's own streaming
  sink (``txn(queryId, batchId)``), and it needs nothing from the coordinator.

The table also records which incarnation owns the scope (the claim, see
:mod:`sinks.delta.progress`). Before committing, on the snapshot the commit is
built on: another incarnation owning the scope refuses the commit
(:class:`~sinks.progress.IncarnationConflictError`); the incarnation's app
version at or above this commit's means the batches are committed already
(this very commit went through before a crash, or Spark replayed batches this
incarnation committed): nothing is committed, and staged files left over are
swept as orphans. The commit itself is made with ``max_commit_retries=0``:
when another writer committed first, the checks run again on the new snapshot.

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

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import AddAction

from sinks import _faults, settings
from sinks._retry import retry_transient
from sinks.audit import CheckpointEvidence, Finding
from sinks.base import (
    COMMITTED,
    LOST,
    PREPARED,
    ClaimedScopes,
    Committable,
    JobScope,
    LingeringTxn,
    OrphanTest,
    Sink,
    SinkWriter,
    WriteContext,
)
from sinks.delta import audit as delta_audit
from sinks.delta import merge, progress, replace, table
from sinks.delta.changes import ChangeWriter
from sinks.delta.layout import DeltaSchemaError, Layout, check_file_schema
from sinks.delta.spark_stage import SparkStage, nested_not_null
from sinks.delta.storage import (
    DATA_SUFFIX,
    SPARK_STAGING_DIR,
    STAGING_DIR,
    TableStorage,
    local_root,
    marker_path,
    split_stem,
)
from sinks.delta.writer import DeltaWriter
from sinks.errors import ConfigError, PreflightError, TransactionLostError
from sinks.keys import KeyedWrite
from sinks.naming import TxnName, check_id, scope_prefixes
from sinks.progress import SinkProgress, conflict, may_claim

log = logging.getLogger("sinks.delta")

_TRANSIENT = (CommitFailedError, OSError)
WRITE_WITH = ("auto", "spark", "arrow")


def app_id(scope: JobScope) -> str:
    """The Delta application id under which a scope's commits are recorded."""
    return progress.progress_app(scope)


class DeltaSink(Sink):
    """Appends a pipeline's output to a Delta table exactly once.

    Args:
        table_uri: the table's directory (a local path) or URI (``s3://...``,
            ``file://...``, anything deltalake opens).
        partition_by: partition columns (string, integer, boolean or date). For
            a new table they define its partitioning; for an existing one they
            must equal its partition columns (``None``: whatever the table has).
        storage_options: deltalake / object_store options (credentials, endpoint,
            ``AWS_S3_ALLOW_UNSAFE_RENAME`` or a locking provider on S3, ...).
        sink_id: stable id of this sink in its pipeline (part of every staged file
            name and of the Delta app id); default derived from the table URI.
        create_table: create a missing table from the DataFrame schema.
        commit_timeout: seconds a commit, abort or sweep keeps retrying commit
            conflicts and storage errors before the job fails (the decision stays
            in the ledger; the next start finishes it).
        write_with: who writes the Parquet files. ``"spark"``: Spark's own
            Parquet writer, one Spark job per micro-batch, no Python in the
            tasks (:mod:`sinks.delta.spark_stage`; local and shared-filesystem
            tables). ``"arrow"``: the sink's writer in each task
            (``mapInArrow``, pyarrow; any store deltalake opens). ``"auto"``
            (default): ``"spark"`` for local tables, except tables with NOT NULL
            fields inside nested columns; ``"arrow"`` otherwise.
        key: merge by these columns instead of appending (the rules of
            :mod:`sinks.keys`): each checkpoint's changes replace the rows of
            their keys, copy-on-write (:mod:`sinks.delta.merge`). Needs a table
            Spark reads and writes directly (local or shared filesystem).
        order_by: with ``key``, the column whose greatest value wins among the
            rows of one key in a batch.
        delete_when: with ``key``, which rows delete their key: a boolean
            column's name, or ``(column, value)``; the column is not written.
        schema_mode: ``"merge"`` adds the DataFrame's columns the table lacks
            (nullable) in a version of their own at job start, before any data
            (:meth:`evolve_schema`); a column whose type differs from the
            table's is refused either way. ``None`` (default): a new column
            fails preflight.
        replace_where: a Spark SQL predicate over partition columns (e.g.
            ``"day = '2026-11-01'"``, as delta-spark's ``replaceWhere``): a
            bounded pipeline replaces the partitions it matches with everything
            it writes, in one version at its final checkpoint
            (:mod:`sinks.delta.replace`). A row outside it fails the backfill.

    Tables are ordinary Delta tables (protocol 1/2, or 3/7 with ``timestampNtz``
    when a column is a timestamp without time zone) that delta-spark reads.
    Readers see a checkpoint's rows all at once, in one version.
    """

    kind = "delta"

    def __init__(
        self,
        table_uri: str | os.PathLike[str],
        *,
        partition_by: Sequence[str] | None = None,
        storage_options: dict[str, str] | None = None,
        sink_id: str | None = None,
        create_table: bool = True,
        commit_timeout: float = 300.0,
        write_with: str = "auto",
        key: Sequence[str] | None = None,
        order_by: str | None = None,
        delete_when: str | tuple[str, Any] | None = None,
        replace_where: str | None = None,
        schema_mode: str | None = None,
    ) -> None:
        uri = os.fspath(table_uri)
        if not uri:
            raise ConfigError("DeltaSink needs a table URI")
        root = local_root(uri)
        self.table_uri = root if root is not None else uri.rstrip("/")
        if isinstance(partition_by, str):
            partition_by = [partition_by]
        if partition_by is not None:
            partition_by = list(partition_by)
            if len(set(partition_by)) != len(partition_by) or not all(
                isinstance(c, str) and c for c in partition_by
            ):
                raise ConfigError(f"partition_by {partition_by!r}: give distinct column names")
        self.partition_by = partition_by
        self.storage_options = dict(storage_options or {})
        self.create_table = create_table
        self.commit_timeout = commit_timeout
        if write_with not in WRITE_WITH:
            raise ConfigError(f"write_with={write_with!r}: one of {', '.join(WRITE_WITH)}")
        if write_with == "spark" and root is None:
            raise ConfigError(
                f"write_with='spark' stages files by moving them, which needs a local or "
                f"shared-filesystem table, not {uri}; use write_with='arrow' (or 'auto')"
            )
        self.write_with = write_with
        self._sink_id = check_id("sink_id", sink_id or self._default_id())
        self.rules = KeyedWrite.of(f"Delta table {self.table_uri}", key, order_by, delete_when)
        if self.rules.keyed and root is None:
            raise ConfigError(
                f"DeltaSink(key=...) merges with Spark jobs that read and write the table's "
                f"files directly, which needs a local or shared-filesystem table, not {uri}"
            )
        if replace_where is not None and (self.rules.keyed or not replace_where.strip()):
            raise ConfigError(
                "DeltaSink: replace_where replaces the partitions it matches with the "
                "pipeline's rows, which is neither a merge (key=) nor an empty predicate"
            )
        self.replace_where = replace_where
        if schema_mode not in (None, "merge"):
            raise ConfigError(f"schema_mode={schema_mode!r}: None (refuse changes) or 'merge'")
        self.schema_mode = schema_mode
        self._new_columns: list[pa.Field] = []
        self._storage = TableStorage(self.table_uri, self.storage_options)
        self._layout: Layout | None = None
        self._claims = ClaimedScopes()

    def _default_id(self) -> str:
        digest = hashlib.sha1(self.table_uri.encode()).hexdigest()[:6]
        base = self.table_uri.rstrip("/").rsplit("/", 1)[-1]
        readable = re.sub(r"[^A-Za-z0-9_-]", "_", base)[:24] or "table"
        return f"delta-{readable}-{digest}"

    @property
    def sink_id(self) -> str:
        return self._sink_id

    def describe(self) -> str:
        return f"Delta table {self.table_uri}"

    def settings(self) -> dict[str, Any]:
        """Non-secret settings (:mod:`sinks.settings`): ``storage_options``
        without the keys that look secret (key, secret, token, password,
        credential, sas: listed under ``"redacted"``)."""
        options, redacted, omitted = settings.split_secrets(
            self.storage_options, settings.STORAGE_SECRET_WORDS
        )
        return {
            "kind": self.kind,
            "v": settings.FORMAT,
            "sink_id": self.sink_id,
            "table_uri": self.table_uri,
            "partition_by": self.partition_by,
            "storage_options": options,
            "redacted": redacted,
            "omitted": omitted,
            "create_table": self.create_table,
            "commit_timeout": self.commit_timeout,
            "write_with": self.write_with,
            "key": list(self.rules.key),
            "order_by": self.rules.order_by,
            "delete_when": self.rules.delete_when.settings() if self.rules.delete_when else None,
            "replace_where": self.replace_where,
            "schema_mode": self.schema_mode,
        }

    @classmethod
    def from_settings(cls, s: Mapping[str, Any], secrets: Mapping[str, str]) -> DeltaSink:
        """The sink of :meth:`settings`; each redacted storage option from
        ``TWOPHASE_<SINK>_<KEY>`` or the variable named like the key (upper
        case) in ``secrets``; when neither is set it stays out (the object
        store's own credential chain applies)."""
        options = dict(s["storage_options"])
        for key in s.get("redacted", []):
            names = (settings.env_name(s["sink_id"], key), key.upper())
            value = settings.lookup(secrets, names)
            if value is not None:
                options[key] = value
            else:
                log.info(
                    "Delta sink %s: storage option %s not in the environment (%s); left to "
                    "the object store's credential chain",
                    s["sink_id"],
                    key,
                    " or ".join(names),
                )
        return cls(
            s["table_uri"],
            partition_by=s["partition_by"],
            storage_options=options,
            sink_id=s["sink_id"],
            create_table=s["create_table"],
            commit_timeout=s["commit_timeout"],
            write_with=s.get("write_with", "auto"),
            key=s.get("key") or None,
            order_by=s.get("order_by"),
            delete_when=s.get("delete_when"),
            replace_where=s.get("replace_where"),
            schema_mode=s.get("schema_mode"),
        )

    def __repr__(self) -> str:
        return f"DeltaSink({self.table_uri!r}, partition_by={self.partition_by})"

    def _load(self) -> DeltaTable | None:
        return table.load(self.table_uri, self.storage_options)

    # -- preflight ----------------------------------------------------------------

    def preflight(self, schema: pa.Schema) -> None:
        """Check (or create) the table: writable by this sink, the same columns as
        ``schema`` with compatible types, the expected partition columns."""
        where = self.describe()
        try:
            self._layout = self._check_or_create(schema, where)
        except DeltaSchemaError as e:
            raise PreflightError(str(e)) from e
        except (DeltaError, OSError) as e:
            raise PreflightError(f"cannot open {where}: {e}".strip()) from e

    @property
    def commits_at_finish(self) -> bool:  # type: ignore[override]
        return self.replace_where is not None

    def partition_columns(self) -> list[str] | None:
        return list(self.rules.key) or None

    def sort_columns(self) -> list[str] | None:
        return self.rules.sort_columns() if self.rules.keyed else None

    def _check_or_create(self, schema: pa.Schema, where: str) -> Layout:
        if self.rules.keyed:
            self.rules.preflight(schema)
            schema = self.rules.written(schema)
        missing = [c for c in self.partition_by or () if c not in schema.names]
        if missing:
            raise DeltaSchemaError(
                f"{where}: partition column(s) {missing} are not columns of the DataFrame "
                f"({schema.names})"
            )
        dt = self._load()
        if dt is None:
            if not self.create_table:
                raise DeltaSchemaError(
                    f"{where} does not exist; create it, or pass create_table=True to DeltaSink"
                )
            try:
                wanted = Layout.of(schema, self.partition_by or ())
            except DeltaSchemaError as e:
                raise DeltaSchemaError(f"{where} cannot be created from the DataFrame: {e}") from e
            wanted.check_partitioning(where)
            if not table.create(self.table_uri, self.storage_options, wanted):
                log.info("%s was created concurrently by another writer; checking it", where)
            dt = self._load()
            if dt is None:
                raise DeltaSchemaError(f"{where} vanished right after it was created")
        table.check_writable(dt, where)
        retention = dt.metadata().configuration.get(progress.RETENTION_PROPERTY)
        if retention is not None:
            raise DeltaSchemaError(
                f"{where} sets {progress.RETENTION_PROPERTY}={retention}: Delta would expire "
                "the app transactions in which this sink remembers what it committed, and "
                "then a replayed batch could be committed twice. Unset the property "
                "(ALTER TABLE ... UNSET TBLPROPERTIES)"
            )
        layout = table.layout_of(dt)
        if self.partition_by is not None and list(layout.partition_by) != self.partition_by:
            raise DeltaSchemaError(
                f"{where} is partitioned by {list(layout.partition_by)}, but DeltaSink was "
                f"given partition_by={self.partition_by}; pass the table's partition columns "
                "(in that order) or partition_by=None"
            )
        layout.check_partitioning(where)
        self._new_columns = layout.check_input(schema, where, merge=self.schema_mode == "merge")
        if self.replace_where is not None:
            replace.check_predicate(self.replace_where, layout, where)
        return layout

    # -- executor side --------------------------------------------------------------

    def evolve_schema(self, schema: pa.Schema) -> None:
        """With ``schema_mode="merge"``: add the DataFrame's new columns to the
        table in a version of their own (nullable), then check again. A retry
        after a crash finds them there and adds nothing."""
        new = self._new_columns
        if not new:
            return
        dt = self._load()
        if dt is None:
            raise PreflightError(f"{self.describe()} vanished after preflight")
        table.add_columns(dt, new)
        log.info(
            "%s: added the column(s) %s (schema_mode='merge')",
            self.describe(),
            ", ".join(f"{f.name} {f.type}" for f in new),
        )
        self.preflight(schema)

    def _ready(self) -> Layout:
        if self._layout is None or self._new_columns:
            raise RuntimeError(
                "DeltaSink.preflight() must run before data is written"
                + (", and evolve_schema() after it (new columns)" if self._new_columns else "")
            )
        return self._layout

    def open_writer(self, ctx: WriteContext, schema: pa.Schema) -> SinkWriter:
        self._ready()
        assert self._layout is not None
        if self.rules.keyed:
            return ChangeWriter(self._storage, self._layout, self.rules, ctx)
        return DeltaWriter(self._storage, self._layout, ctx)

    def spark_writes(self) -> bool:
        """Whether micro-batches are staged by Spark's own Parquet writer (see
        ``write_with``); known after :meth:`preflight`."""
        if self.write_with == "auto":
            return (
                self._storage.root is not None
                and self._layout is not None
                and not nested_not_null(self._layout)
            )
        return self.write_with == "spark"

    def precommit_frame(
        self, df: Any, scope: JobScope, run: int, batch_id: int
    ) -> list[Committable] | None:
        self._ready()
        if self.replace_where is not None:
            replace.check_rows(df, self.replace_where, self.describe(), batch_id)
        if self.rules.keyed or not self.spark_writes():
            return None
        staged = SparkStage(self._storage, self._layout, self.describe()).stage(
            df, scope, run, batch_id
        )
        return [staged] if staged is not None else []

    # -- progress and claims -----------------------------------------------------------

    def progress(self, scope: JobScope) -> SinkProgress:
        dt = self._load()
        return progress.read(dt, scope) if dt is not None else SinkProgress(owner=None)

    def claim(self, scope: JobScope, *, start_over_from: str | None = None) -> SinkProgress:
        ours = scope.incarnation
        assert ours is not None

        def claim_once() -> SinkProgress:
            dt = self._load()
            if dt is None:
                raise PreflightError(f"{self.describe()} does not exist (preflight creates it)")
            found = progress.read(dt, scope)
            if not may_claim(found, ours, start_over_from):
                raise conflict(self.describe(), scope.key(), found, ours)
            if found.owner == ours:
                return found
            progress.commit_claim(dt, scope, previous=found.owner)  # compare-and-set
            return SinkProgress(owner=ours, batch=-1, previous=found.owner)

        found = retry_transient(
            claim_once,
            what=f"claim of {scope.key()} in {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )
        self._claims.remember(scope)
        return found

    # -- driver side: commit ---------------------------------------------------------

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
                f"{self!r} got committables of {sorted(s.key() for s in scopes)}; one commit "
                f"call takes the committables of one pipeline's sink {self.sink_id!r} and "
                "one incarnation"
            )
        scope = scopes.pop()
        version = max(n.batch_id for n in names)
        app = app_id(scope)
        retry_transient(
            lambda: self._commit_once(cs, scope, version),
            what=f"commit of {len(cs)} staged transaction(s) as {app} v{version} "
            f"to {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )

    def _commit_once(self, cs: list[Committable], scope: JobScope, version: int) -> None:
        where = self.describe()
        app = app_id(scope)
        dt = self._load()
        if dt is None:
            raise TransactionLostError(
                f"{where} does not exist any more; the staged files of {len(cs)} "
                "transaction(s) cannot be committed"
            )
        owner = self._claims.owner(scope.job, scope.pipeline, scope.sink_id, scope.incarnation)
        found = progress.read(dt, scope)
        if found.owner is not None and owner is not None and found.owner != owner:
            raise conflict(where, scope.key(), found, owner, at_commit=True)
        done = dt.transaction_version(app)
        if done is not None and done >= version:
            log.info(
                "%s: %s holds batches up to %d committed, this commit's are up to %d: "
                "committed already (files of a replay, if any, are deleted)",
                where,
                app,
                done,
                version,
            )
            merge.discard_changes(self._storage, cs)
            # This very commit's files are in the table (kept); a replay's are not.
            committed = table.committed_paths(dt)
            for c in cs:
                for a in c["adds"]:
                    if a["path"] not in committed:
                        self._storage.delete(a["path"])
                    self._storage.delete(marker_path(a["path"]))
            return
        table.check_writable(dt, where)
        layout = table.layout_of(dt)
        if self.rules.keyed:
            merge.commit(
                dt=dt,
                layout=layout,
                storage=self._storage,
                rules=self.rules,
                committables=cs,
                scope=scope,
                app=app,
                version=version,
                where=where,
                checked_add=lambda c, a: self._checked_add(c, a, layout),
            )
            return
        adds = [self._checked_add(c, a, layout) for c in cs for a in c["adds"]]
        gone = (
            replace.removes(dt, layout, self.replace_where)
            if self.replace_where is not None
            else []
        )
        dt.create_write_transaction(
            [*adds, *gone],
            mode="append",
            schema=dt.schema(),
            partition_by=list(layout.partition_by) or None,
            commit_properties=CommitProperties(
                app_transactions=[Transaction(app, version, int(time.time() * 1000))],
                custom_metadata={"twophaseApp": app, "twophaseBatch": version},
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
        _faults.hit("driver.mid_commit", batch=version, sink=self.kind)
        for c in cs:
            for a in c["adds"]:
                self._storage.delete(marker_path(a["path"]))

    def _checked_add(self, c: Committable, add: dict[str, Any], layout: Layout) -> AddAction:
        """The add action of one staged file, after checking that the file is there,
        unchanged, and fits the table (schema and partition columns)."""
        where, rel, txn = self.describe(), add["path"], c["txn"]
        info = self._storage.info(rel)
        if info is None:
            raise TransactionLostError(
                f"{where}: staged file {rel} of transaction {txn} is gone without having "
                "been committed (deleted by someone else?); its rows are not in the table. "
                "The job stops rather than lose them silently; re-run the batch from source."
            )
        if info[0] != add["size"]:
            raise TransactionLostError(
                f"{where}: staged file {rel} of transaction {txn} has {info[0]} bytes, not the "
                f"{add['size']} it had when prepared: it was changed, so it is not committed"
            )
        pv = add["partition_values"]
        if sorted(pv) != sorted(layout.partition_by):
            raise DeltaSchemaError(
                f"{where}: staged file {rel} is partitioned by {sorted(pv)} but the table by "
                f"{list(layout.partition_by)}; nothing was committed"
            )
        meta = self._storage.parquet_metadata(rel)
        if json.loads(add["stats"]).get("numRecords") != meta.num_rows:
            raise TransactionLostError(
                f"{where}: staged file {rel} of transaction {txn} holds {meta.num_rows} rows, "
                "not the number its prepare recorded: it was changed, so it is not committed"
            )
        check_file_schema(meta, layout, f"{where}: staged file {rel}")
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
                what=f"abort of {len(committables)} staged transaction(s) in {self.describe()}",
                transient=_TRANSIENT,
                deadline=self.commit_timeout,
            )

    def _delete_staged(self, paths: list[str]) -> None:
        dt = self._load()
        committed = table.committed_paths(dt) if dt is not None else set()
        for rel in paths:
            if rel in committed:
                log.error("%s: not deleting %s: the table references it", self.describe(), rel)
            else:
                self._storage.delete(rel)
            self._storage.delete(marker_path(rel))

    def evidence(self, committable: Committable) -> dict[str, Any]:
        return delta_audit.evidence(committable)

    def audit(self, scope: JobScope, checkpoints: Sequence[CheckpointEvidence]) -> list[Finding]:
        return delta_audit.audit(self._storage, self._load(), app_id(scope), checkpoints)

    def abort_lingering(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        """Delete the staged files of every transaction of ``scope`` that has a
        staging marker and for which ``is_orphan`` is true; return their names.

        Only markers are listed (one small directory), never the whole table.
        Committed transactions have no marker (their commit deleted it); a file
        the table references is kept even so."""
        return retry_transient(
            lambda: self._sweep(scope, is_orphan),
            what=f"sweep of lingering staged files in {self.describe()}",
            transient=_TRANSIENT,
            deadline=self.commit_timeout,
        )

    def _staged(self, prefixes: tuple[str, ...]) -> dict[str, tuple[TxnName, list[str]]]:
        """Every transaction under one of ``prefixes`` that has staging markers:
        its name and the stems of its markers (one per staged file)."""
        found: dict[str, tuple[TxnName, list[str]]] = {}
        for stem in sorted(self._storage.list_files(STAGING_DIR)):
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
        for d in self._storage.list_dirs(SPARK_STAGING_DIR):
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
            what=f"listing of staged files in {self.describe()}",
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
        is there as prepared, lost when one is gone or changed."""

        def read() -> dict[str, str]:
            dt = self._load()
            if dt is None:
                return {c["txn"]: LOST for c in committables}
            layout = table.layout_of(dt)
            found: dict[str, str] = {}
            for c in committables:
                name = TxnName.require(c["txn"])
                scope = JobScope(name.job, name.pipeline, name.sink_id, name.incarnation)
                done = dt.transaction_version(app_id(scope))
                if done is not None and done >= name.batch_id:
                    found[c["txn"]] = COMMITTED
                    continue
                try:
                    for a in c.get("adds", ()):
                        self._checked_add(c, a, layout)
                    for ch in c.get("changes", ()):
                        if self._storage.info(ch["path"]) is None:
                            raise TransactionLostError(ch["path"])
                except TransactionLostError:
                    found[c["txn"]] = LOST
                else:
                    found[c["txn"]] = PREPARED
            return found

        return retry_transient(
            read,
            what=f"check of {len(committables)} staged transaction(s) in {self.describe()}",
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
            self._storage.delete_tree(f"{SPARK_STAGING_DIR}/{d}")
        if spark:
            log.info("%s: deleted Spark's staging directories of %s", self.describe(), spark)
        if not orphans:
            return spark
        dt = self._load()
        committed = table.committed_paths(dt) if dt is not None else set()
        aborted = []
        for txn, stems in sorted(orphans.items()):
            kept = 0
            for stem in stems:
                marker = f"{STAGING_DIR}/{stem}"
                data = self._storage.read(marker)
                rel = data.decode("utf-8", "replace") if data else ""
                if rel in committed:
                    kept += 1  # a marker a crash left behind after the commit
                elif _is_staged_path(rel, stem):
                    self._storage.delete(rel)
                self._storage.delete(marker)
            if kept < len(stems):
                aborted.append(txn)
        if aborted:
            log.info("%s: deleted the staged files of %s", self.describe(), aborted)
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
