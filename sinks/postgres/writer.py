"""Executor side of the PostgreSQL sink: binary COPY inside a prepared transaction."""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from dataclasses import dataclass
from typing import Any

import pgpq
import psycopg
import pyarrow as pa
from psycopg import sql

from sinks.base import Committable, SinkWriter, WriteContext
from sinks.errors import KeySpansTasksError, LockWaitError, PreparedLimitError
from sinks.keys import KeyedWrite
from sinks.naming import TxnName
from sinks.postgres import liveness
from sinks.postgres.lock_watch import LockWatch
from sinks.postgres.upsert import DELETE_COLUMN, Upsert
from sinks.postgres.values import PG_TYPE_KEY, to_wire

DELETE_FLAG = pa.field(DELETE_COLUMN, pa.bool_(), metadata={PG_TYPE_KEY: "boolean"})
"""The column of the staging table that says a row is a delete (``delete_when``)."""

STAGE_NAME = re.compile(r"\bstage_[0-9a-f]{20}\b")
"""How an upsert's private staging table is named (in the marker schema): error
messages about it are rewritten to name the target table (:mod:`sinks.explain`)."""


def stage_table(gid: str) -> str:
    """The name of the staging table of the transaction ``gid`` (upserts)."""
    return f"stage_{hashlib.sha1(gid.encode()).hexdigest()[:20]}"


@dataclass(frozen=True)
class WriterSettings:
    """What a writer needs of its sink, handed over by ``PostgresSink.open_writer``
    (the writer never reaches back into the driver-side sink)."""

    where: str
    """the sink, for messages (``PostgresSink.describe()``)"""
    dsn: str
    connect_timeout: float
    commit_timeout: float
    lock_timeout: float
    table: sql.Composable
    """the target table, quoted"""
    markers: sql.Composable
    """the commit-marker table, quoted"""
    marker_audit: bool
    """whether the marker table has the audit columns (batch, rows)"""
    marker_schema: str
    rules: KeyedWrite
    """the keyed-write options (no key: an append)"""
    partitioned_by_key: bool = False
    """the user declared that no key spans two tasks of a batch (no shuffle)"""

    def connect(self, application_name: str) -> psycopg.Connection:
        return liveness.connect(
            self.dsn,
            application_name,
            connect_timeout=self.connect_timeout,
            commit_timeout=self.commit_timeout,
        )


class PostgresWriter(SinkWriter):
    """Writes one task's partition: ``BEGIN``; binary ``COPY`` (append) or COPY
    into a staging table then ``INSERT ... ON CONFLICT`` (upsert,
    :mod:`sinks.postgres.upsert`); a marker row; ``PREPARE TRANSACTION '<gid>'``.

    Nothing is opened until the first non-empty batch arrives, so an empty
    partition costs no connection and leaves no transaction. Record batches are
    encoded and streamed as they come: memory stays flat for any partition size.
    """

    def __init__(self, settings: WriterSettings, ctx: WriteContext, wire: pa.Schema) -> None:
        self._settings = settings
        self._name = ctx.txn_name()
        self._batch_id = ctx.batch_id
        self._gid = str(self._name)
        self._job = ctx.scope.job
        self._wire = wire
        self._conn: psycopg.Connection | None = None
        self._copy_cm: Any = None
        self._copy: Any = None
        self._encoder: pgpq.ArrowToPostgresBinaryEncoder | None = None
        self._rows = 0
        self._bytes = 0  # COPY data sent, the header and trailer included
        self._prepared = False
        self._upsert: Upsert | None = None
        self._scope_prefix = ctx.scope.txn_prefix()

    def _columns(self) -> sql.Composable:
        return sql.SQL(", ").join(sql.Identifier(n) for n in self._wire.names)

    def _begin(self) -> None:
        cfg = self._settings
        self._conn = conn = cfg.connect("twophase-writer")
        self._abort_earlier_attempts(conn)
        ms = int(cfg.lock_timeout * 1000)
        conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{ms}ms")))
        conn.execute("BEGIN")
        target = cfg.table
        if cfg.rules.keyed:
            names = [n for n in self._wire.names if n != DELETE_COLUMN]
            self._upsert = Upsert(
                target=target,
                stage=sql.Identifier(cfg.marker_schema, stage_table(self._gid)),
                columns=names,
                rules=cfg.rules,
                batch_id=self._batch_id,
                deletes=DELETE_COLUMN in self._wire.names,
            )
            self._upsert.create_stage(conn)
            target = self._upsert.stage
        self._encoder = pgpq.ArrowToPostgresBinaryEncoder(self._wire)
        self._copy_cm = conn.cursor().copy(
            sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(target, self._columns())
        )
        self._copy = self._copy_cm.__enter__()
        header = self._encoder.write_header()
        self._bytes += len(header)
        self._copy.write(header)

    def _abort_earlier_attempts(self, conn: psycopg.Connection) -> None:
        """Roll back prepared work of earlier executions of this partition (same
        run, batch, partition; another task attempt id): a failed attempt that
        Spark retried, or a task of a query that was stopped and started again in
        this run, which then replays the batch. Spark completed neither (else no
        second execution), and it never runs two attempts of a partition at once
        (speculation is refused by the Job), so that work will never be used; it
        may hold keys this execution writes and would block it."""
        rows = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            " AND starts_with(gid, %s) AND gid <> %s",
            (self._name.partition_prefix(), self._gid),
        ).fetchall()
        for (gid,) in rows:
            with contextlib.suppress(psycopg.errors.UndefinedObject):
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        try:
            self._write(batch)
        except psycopg.errors.LockNotAvailable as e:
            raise self._lock_wait_error() from e

    def _write(self, batch: pa.RecordBatch) -> None:
        cfg = self._settings
        rules = cfg.rules
        if rules.keyed:
            rules.check_nulls(batch, self._batch_id)
        if rules.delete_when is not None:
            deletes = rules.deletes(batch)
            batch = batch.drop_columns([rules.delete_when.column]).append_column(
                DELETE_FLAG, deletes
            )
        wire = to_wire(batch, self._wire, cfg.where)  # checked before sending
        if self._conn is None:
            self._begin()
        assert self._encoder is not None
        data = self._encoder.write_batch(wire)
        self._bytes += len(data)
        self._copy.write(data)
        self._rows += batch.num_rows

    def prepare(self) -> Committable | None:
        if self._conn is None:
            return None
        try:
            return self._prepare()
        except psycopg.errors.LockNotAvailable as e:
            raise self._lock_wait_error() from e

    def _wait_for_earlier_batches(self, conn: psycopg.Connection) -> None:
        """Wait until no earlier batch of this sink's scope is prepared.

        A delete does not wait for another transaction's uncommitted insert of
        its key (an upsert does, through the unique index), and the rows of
        batches that await their checkpoint are exactly that: without this
        wait, deleting a key that such a batch inserted would find no row, and
        the insert would commit after the delete. Batches are written one after
        the other, so once the earlier ones are settled (committed at a
        checkpoint, or rolled back) nothing else of the pipeline can hold the
        key. Bounded by ``lock_timeout`` like a lock wait."""
        limit = self._settings.lock_timeout
        started = time.monotonic()
        pause = 0.02
        while True:
            rows = conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                " AND starts_with(gid, %s)",
                (self._scope_prefix,),
            ).fetchall()
            earlier = [
                gid
                for (gid,) in rows
                if (n := TxnName.parse(gid)) is not None and n.batch_id < self._batch_id
            ]
            if not earlier:
                return
            waited = time.monotonic() - started
            if limit and waited > limit:
                raise LockWaitError(
                    f"task {self._gid} deletes keys and waited {waited:.0f}s (lock_timeout="
                    f"{limit:g}s) for earlier batches of its sink to be committed or rolled "
                    f"back: {', '.join(sorted(earlier)[:3])}. They commit at the next "
                    "checkpoint; a checkpoint that does not come (the driver stopped taking "
                    "them) or prepared work nobody settles (see pg_prepared_xacts) keeps "
                    "them. The task fails so that Spark retries it"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def _merge(self, conn: psycopg.Connection, upsert: Upsert) -> None:
        """The upsert's merge, watched (:mod:`sinks.postgres.lock_watch`): a
        wait for another task of this batch fails at once."""
        watch = LockWatch(conn, self._name, self._settings.connect)
        try:
            with watch:
                upsert.merge(conn, self._wait_for_earlier_batches)
        except psycopg.errors.QueryCanceled as e:
            if watch.holder is not None:
                raise self._spans_tasks_error(watch.holder) from e
            raise
        if watch.holder is not None:  # the cancel came as the statement ended
            raise self._spans_tasks_error(watch.holder)

    def _spans_tasks_error(self, holder: str) -> KeySpansTasksError:
        cfg = self._settings
        why = (
            "it was declared to be partitioned by the key (partitioned_by_key=True), and "
            "it is not: a key spans two tasks. Drop partitioned_by_key (the sink then "
            "repartitions each batch by its key), or repartition the DataFrame by the "
            "key (or a part of it) in the pipeline's transform"
            if cfg.partitioned_by_key
            else "Spark's plan said each key of the batch is in one partition "
            "(lifecycle.partitioning), and it is not: please report this with the "
            "pipeline's plan"
        )
        return KeySpansTasksError(
            f"{cfg.where}: batch {self._batch_id} writes one key in two of its tasks: task "
            f"{self._gid} waited for the prepared transaction {holder} of the same batch, "
            f"which only the checkpoint after the batch can commit. The batch was not "
            f"repartitioned by key={list(cfg.rules.key)} because {why}. Nothing of the "
            "batch is committed"
        )

    def _lock_wait_error(self) -> LockWaitError:
        return LockWaitError(
            f"task {self._gid} waited more than lock_timeout={self._settings.lock_timeout:g}s for "
            f"rows of {self._settings.where} that another transaction holds: prepared work "
            "of an interrupted earlier execution of this partition, or another writer of the "
            "same keys (see pg_prepared_xacts and pg_locks). The task fails so that Spark "
            "retries it; a retry rolls back this job's earlier executions of the partition"
        )

    def _prepare(self) -> Committable:
        assert self._encoder is not None
        conn, cfg = self._conn, self._settings
        assert conn is not None  # opened with the encoder
        trailer = self._encoder.finish()
        self._bytes += len(trailer)
        self._copy.write(trailer)
        cm, self._copy_cm = self._copy_cm, None
        cm.__exit__(None, None, None)
        if self._upsert is not None:
            self._merge(conn, self._upsert)
        conn.execute(
            *(
                (
                    sql.SQL(
                        "INSERT INTO {} (gid, job, batch, rows) VALUES (%s, %s, %s, %s)"
                    ).format(cfg.markers),
                    (self._gid, self._job, self._batch_id, self._rows),
                )
                if cfg.marker_audit
                else (
                    sql.SQL("INSERT INTO {} (gid, job) VALUES (%s, %s)").format(cfg.markers),
                    (self._gid, self._job),
                )
            ),
        )
        try:
            conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(self._gid)))
        except psycopg.errors.OutOfMemory as e:
            if "prepared transactions" not in str(e):
                raise
            raise PreparedLimitError(
                f"task {self._gid}: {cfg.where} holds as many prepared transactions as "
                f"its max_prepared_transactions allows ({e.diag.message_hint or e}). This "
                "job's batches awaiting a checkpoint count, and so do other jobs'. Raise "
                "max_prepared_transactions in postgresql.conf (a server restart), or take "
                "checkpoints more often (Job(checkpoint_interval=...)); the job takes one "
                "early when it sees the server close to the limit"
            ) from e
        self._prepared = True
        return {"txn": self._gid, "rows": self._rows, "bytes": self._bytes}

    def close(self, failed: bool = False) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if failed and self._prepared:
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(self._gid)))
            if self._copy_cm is not None:
                # leaving the COPY block with an error ends the COPY on the server
                self._copy_cm.__exit__(RuntimeError, RuntimeError("task failed"), None)
        except Exception:
            pass
        finally:
            # An unprepared transaction dies with its connection (rolled back);
            # a prepared one lives on in the server until COMMIT/ROLLBACK PREPARED.
            conn.close()
