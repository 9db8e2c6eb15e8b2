"""Delta Lake exactly-once sink: staged Parquet files, one Delta version per commit.

This module is the sink's face: its options, preflight (the table's layout,
created or checked), schema evolution and its writers (:mod:`sinks.delta.writer`
in tasks, :mod:`sinks.delta.spark_stage` by Spark's own writer,
:mod:`sinks.delta.changes` for keyed sinks). Executors stage Parquet files in
the table directory, invisible until committed; claims and the commit path are
the committer's (:mod:`sinks.delta.committer`; its abort and sweep:
:mod:`sinks.delta.sweep`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from sinks import settings
from sinks.base import ClaimedScopes, Committable, JobScope, Sink, SinkWriter, WriteContext
from sinks.capabilities import StagesThroughSpark
from sinks.delta import replace, s3_writers, spark_features, store_errors, table
from sinks.delta.changes import ChangeWriter
from sinks.delta.committer import DeltaCommitter
from sinks.delta.constraints import RowRules
from sinks.delta.layout import DeltaSchemaError, Layout, quoted
from sinks.delta.spark_stage import SparkStage, nested_not_null
from sinks.delta.storage import (
    TableStorage,
    local_root,
)
from sinks.delta.writer import DeltaWriter
from sinks.errors import ConfigError, PreflightError
from sinks.keys import KeyedWrite
from sinks.naming import check_id

log = logging.getLogger("sinks.delta")

WRITE_WITH = ("auto", "spark", "arrow")


class DeltaSink(Sink, StagesThroughSpark):
    """Appends a pipeline's output to a Delta table exactly once.

    Args:
        table_uri: the table's directory (a local path) or URI (``s3://...``,
            ``file://...``, anything deltalake opens).
        partition_by: partition columns (string, integer, boolean or date). For
            a new table they define its partitioning; for an existing one they
            must equal its partition columns (``None``: whatever the table has).
        storage_options: deltalake / object_store options (credentials,
            endpoint, region, ...). On S3 no lock is needed: deltalake commits
            by conditional PUT.
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
            fields inside nested columns, and except where other sinks of the
            pipeline write each micro-batch with per-task writers: the Arrow
            writer then joins their tasks (one Spark job writes every sink,
            :mod:`lifecycle.binding`); ``"arrow"`` otherwise.
        key: merge by these columns instead of appending (the rules of
            :mod:`sinks.keys`): each checkpoint's changes replace the rows of
            their keys, copy-on-write (:mod:`sinks.delta.merge`), on a local,
            shared-filesystem, S3 or HDFS table.
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
        other_writers: on S3, ``"check"`` (default) refuses at preflight a
            table that one of its last 100 versions shows written by an engine
            that commits without a conditional PUT (delta-spark), since the two
            could overwrite each other's commits; ``"stopped"`` says such
            engines write only while this job is stopped
            (:mod:`sinks.delta.s3_writers`); ``"none"``: nothing else commits
            while this job runs, which lets the sink commit through delta-spark
            there (:func:`sinks.delta.spark_features.route`). Other stores
            ignore it.

    Tables are ordinary Delta tables (protocol 1/2, or 3/7 with ``timestampNtz``
    when a column is a timestamp without time zone) that delta-spark reads.
    Readers see a checkpoint's rows all at once, in one version.
    """

    kind = "delta"
    _driver_only = ("_committer",)

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
        other_writers: str = "check",
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
        if replace_where is not None and (self.rules.keyed or not replace_where.strip()):
            raise ConfigError(
                "DeltaSink: replace_where replaces the partitions it matches with the "
                "pipeline's rows, which is neither a merge (key=) nor an empty predicate"
            )
        self.replace_where = replace_where
        if schema_mode not in (None, "merge"):
            raise ConfigError(f"schema_mode={schema_mode!r}: None (refuse changes) or 'merge'")
        self.schema_mode = schema_mode
        if other_writers not in s3_writers.OTHER_WRITERS:
            raise ConfigError(
                f"other_writers={other_writers!r}: one of "
                + ", ".join(repr(w) for w in s3_writers.OTHER_WRITERS)
            )
        self.other_writers = other_writers
        self._spark_route = spark_features.route(self.table_uri, other_writers)
        self._new_columns: list[pa.Field] = []
        self._storage = TableStorage(self.table_uri, self.storage_options)
        self._layout: Layout | None = None
        self._row_rules = RowRules()
        self._claims = ClaimedScopes()
        self._init_driver_state()

    def _init_driver_state(self) -> None:
        self._committer = DeltaCommitter(
            where=self.describe(),
            sink_id=self.sink_id,
            storage=self._storage,
            load=self._load,
            claims=self._claims,
            rules=self.rules,
            replace_where=self.replace_where,
            commit_timeout=self.commit_timeout,
            spark_route=self._spark_route,
        )

    def committer(self) -> DeltaCommitter:
        """The driver's :class:`~sinks.delta.committer.DeltaCommitter`."""
        return self._committer

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
            "other_writers": self.other_writers,
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
            other_writers=s.get("other_writers", "check"),
        )

    def __repr__(self) -> str:
        return f"DeltaSink({self.table_uri!r}, partition_by={self.partition_by})"

    def _load(self) -> DeltaTable | None:
        return table.load(self.table_uri, self.storage_options)

    # -- preflight ----------------------------------------------------------------

    def preflight(self, schema: pa.Schema) -> None:
        """Check (or create) the table: writable by this sink, the same columns as
        ``schema`` with compatible types, the expected partition columns
        (:func:`sinks.delta.table.check_target`)."""
        where = self.describe()
        try:
            target = table.check_target(
                self._storage,
                schema,
                where,
                rules=self.rules,
                partition_by=self.partition_by,
                create_missing=self.create_table,
                replace_where=self.replace_where,
                merge_schema=self.schema_mode == "merge",
                spark_writes=self.write_with == "spark",
                spark_route=self._spark_route,
            )
            shared = s3_writers.check(target.table, where, self.other_writers)
        except DeltaSchemaError as e:
            raise PreflightError(str(e)) from e
        except (DeltaError, OSError) as e:
            said = store_errors.explain(e, self.table_uri, self.storage_options)
            raise PreflightError(f"cannot open {where}: {said}".strip()) from e
        if shared is not None:
            raise PreflightError(shared)
        self._row_rules = target.row_rules
        self._new_columns = target.new_columns
        self._layout = target.layout

    @property
    def commits_at_finish(self) -> bool:  # type: ignore[override]
        return self.replace_where is not None

    def partition_columns(self) -> list[str] | None:
        return list(self.rules.key) or None

    def sort_columns(self) -> list[str] | None:
        return self.rules.sort_columns() if self.rules.keyed else None

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
        table.add_columns(dt, new, self._spark_route.uri, self.describe())
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

    def _spark_writes(self) -> bool:
        """Whether micro-batches are staged by Spark's own Parquet writer (see
        ``write_with``); known after :meth:`preflight`."""
        if self.write_with == "auto":
            return (
                self._storage.root is not None
                and self._layout is not None
                and not nested_not_null(self._layout)
                and self._layout.mapping is None  # physical names: the Arrow writer's
            )
        return self.write_with == "spark"

    def frame_for_write(self, df: Any) -> Any:
        """``df`` with the table's generated columns it lacks computed and its
        CHECK constraints, invariants and given generated columns checked
        (:mod:`sinks.delta.constraints`)."""
        layout = self._ready()
        if not self._row_rules:
            return df
        is_delete = None
        d = self.rules.delete_when
        if d is not None:
            from pyspark.sql import functions as F

            # the value cast to the column's type, as the change writer compares (Arrow)
            value = F.lit(d.value).cast(df.schema[d.column].dataType)
            is_delete = F.coalesce(F.col(quoted(d.column)) == value, F.lit(False))
        return self._row_rules.frame(df, layout, self.describe(), is_delete)

    def joins_shared_jobs(self) -> bool:
        """An appending sink without derived columns, checks or
        ``replace_where`` (whose check reads the batch: it stays persisted),
        whose ``write_with`` is not ``"spark"``: its Arrow writer joins the job
        the pipeline's other sinks share (``"auto"`` prefers that to a Spark
        job of its own, which would read the batch again)."""
        self._ready()
        return (
            not self._row_rules
            and not self.rules.keyed
            and self.replace_where is None
            and self.write_with != "spark"
        )

    def precommit_frame(
        self, df: Any, scope: JobScope, run: int, batch_id: int, *, shared: bool = False
    ) -> list[Committable] | None:
        self._ready()
        if self.replace_where is not None:
            assert self._layout is not None
            replace.check_rows(df, self.replace_where, self._layout, self.describe(), batch_id)
        if self.rules.keyed or not self._spark_writes():
            return None
        if shared and self.write_with == "auto":
            return None  # the Arrow writer joins the other sinks' tasks: no job of its own
        assert self._layout is not None  # set by preflight
        staged = SparkStage(self._storage, self._layout, self.describe()).stage(
            df, scope, run, batch_id
        )
        return [staged] if staged is not None else []
