"""Staged work of a Delta sink that will never be committed: aborted, listed, swept.

Staged files are found through their staging markers (:mod:`sinks.delta.storage`):
:meth:`DeltaSweeper.sweep` lists the marker directory, never the
whole table, and the commit deletes a transaction's markers once its Delta
version exists (:mod:`sinks.delta.committer`), so a committed file is never a
sweep candidate, even after OPTIMIZE removed it from the snapshot while time
travel still reads it. A file the table references is never deleted, whatever
its marker says. The files delta-spark names for a merge on read (vectors,
its writer's data and change-data files: :mod:`sinks.delta.spark_staged`) are
deleted only when their merge's version is certainly not in the table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from sinks._retry import retry_transient
from sinks.committer import Committable, LingeringTxn, OrphanTest
from sinks.delta import spark_staged, table
from sinks.delta.storage import (
    DATA_SUFFIX,
    SPARK_STAGING_DIR,
    STAGING_DIR,
    TableStorage,
    marker_path,
    split_stem,
)
from sinks.naming import TxnName, scope_prefixes
from sinks.scope import JobScope

log = logging.getLogger("sinks.delta")

TRANSIENT = (CommitFailedError, OSError)
"""what a Delta commit, abort or sweep retries: a conflict with another
writer, and the store's errors"""


@dataclass
class DeltaSweeper:
    """Deletes one Delta sink's staged work that will never be committed: the
    abort, lingering and sweep roles of
    :class:`~sinks.delta.committer.DeltaCommitter`, which extends it."""

    where: str
    """the sink, for messages"""
    sink_id: str
    storage: TableStorage
    load: Callable[[], DeltaTable | None]
    commit_timeout: float

    def abort(self, committables: Sequence[Committable]) -> None:
        """Delete the staged files of ``committables`` (idempotent). A file the
        table references is never deleted."""
        paths = [a["path"] for c in committables for a in c.get("adds", ())]
        paths += [ch["path"] for c in committables for ch in c.get("changes", ())]
        if paths:
            retry_transient(
                lambda: self._delete_staged(paths),
                what=f"abort of {len(committables)} staged transaction(s) in {self.where}",
                transient=TRANSIENT,
                deadline=self.commit_timeout,
            )

    def _delete_staged(self, paths: list[str]) -> None:
        dt = self.load()
        committed = table.committed_paths(dt) if dt is not None else set()
        for rel in paths:
            if rel in committed:
                log.error("%s: not deleting %s: the table references it", self.where, rel)
            else:
                self.storage.delete_staged(rel)
            self.storage.delete(marker_path(rel))

    def sweep(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        """Delete the staged files of every transaction of ``scope`` that has a
        staging marker and for which ``is_orphan`` is true; return their names.

        Only markers are listed (one small directory), never the whole table.
        Committed transactions have no marker (their commit deleted it); a file
        the table references is kept even so."""
        return retry_transient(
            lambda: self._sweep_once(scope, is_orphan),
            what=f"sweep of lingering staged files in {self.where}",
            transient=TRANSIENT,
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
        incarnation, with staging markers in the table: what :meth:`sweep` looks at."""
        prefixes = scope_prefixes(job, pipeline, self.sink_id)
        found, spark = retry_transient(
            lambda: (self._staged(prefixes), self._spark_staged(prefixes)),
            what=f"listing of staged files in {self.where}",
            transient=TRANSIENT,
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

    def _sweep_once(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
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
            markers = {f"{STAGING_DIR}/{stem}": stem for stem in stems}
            paths = {m: (self.storage.read(m) or b"").decode("utf-8", "replace") for m in markers}
            spark_written = [rel for rel in paths.values() if spark_staged.is_spark_written(rel)]
            merge_landed = bool(spark_written) and (
                dt is not None and spark_staged.landed(dt, TxnName.require(txn))
            )
            for marker, stem in markers.items():
                rel = paths[marker]
                if rel in committed or (merge_landed and rel in spark_written):
                    kept += 1  # a marker a crash left behind after the commit
                elif _is_staged_path(rel, stem) or rel in spark_written:
                    self.storage.delete_staged(rel)
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
