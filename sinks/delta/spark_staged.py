"""Staging markers of the files delta-spark writes for a merge on read, and how
a sweep tells whether their commit landed.

A merge on read (:mod:`sinks.delta.spark_dv`) leaves files that delta-spark
names, not the sink: the vector file (``deletion_vector_<uuid>.bin``, a name
the Delta protocol derives from the vector's id) and the data and change-data
files of delta-spark's writer (``part-...parquet``, ``_change_data/cdc-...``).
Each gets a staging marker of the merge's transaction,
``_twophase/staged/<txn>-<seq>``, holding the file's table-relative path,
as a file the sink stages does (:mod:`sinks.delta.storage`), so the sweep
finds them (:mod:`sinks.delta.sweep`). The rules:

1. **The marker before the file, where the sink writes it.** The vector file's
   marker is written before the file is created; the writer's files get
   theirs as soon as the write returns (delta-spark names them as it writes).
2. **Only such names.** A marker's path is taken for one of these files only
   when it has one of their shapes (:func:`is_spark_written`) and stays in the
   table's data directories (never ``_delta_log``, never ``..``).
3. **The sweep deletes them only when their commit did not land**
   (:func:`landed`): the files of a transaction are kept when the table holds
   the merge's version, the one whose app transaction reached the
   transaction's batch (its ``userMetadata``), and its ``commitInfo`` names
   this transaction (another attempt of the same batch may have landed
   instead). When the table's history no longer reaches that version, or
   cannot be read, the files are kept (VACUUM removes what is unreferenced).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from deltalake import DeltaTable

from sinks.delta import progress
from sinks.delta.storage import STAGING_DIR, TableStorage, file_stem
from sinks.naming import TxnName, scope_prefix

MERGE_TAG = "twophaseMerge"
"""the ``commitInfo.tags`` entry of a merge (JSON); its ``staged`` names the
transaction whose markers name its files"""
_SPARK_FILE = re.compile(
    r"^(?:deletion_vector_[0-9a-f-]{36}\.bin|cdc-[^/]+\.parquet|part-[^/]+\.parquet)$"
)


def is_spark_written(rel: str) -> bool:
    """Whether the table-relative path ``rel`` has the shape of a file
    delta-spark writes for a merge (rule 2): a vector, data or change-data
    file by name, under partition directories, a random prefix or
    ``_change_data``, never under another directory starting with ``_``."""
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return False
    if any(d.startswith("_") and d != "_change_data" for d in parts[:-1]):
        return False
    return _SPARK_FILE.match(parts[-1]) is not None


@dataclass
class Staged:
    """The markers of one merge's files (transaction ``name`` of the sink's scope)."""

    storage: TableStorage
    name: str
    paths: list[str] = field(default_factory=list)

    def mark(self, rel: str) -> None:
        """Write the marker of the file ``rel`` (before it exists, or just after)."""
        if not is_spark_written(rel):
            raise ValueError(f"not a file delta-spark writes for a merge: {rel}")
        self.storage.put(f"{STAGING_DIR}/{file_stem(self.name, len(self.paths))}", rel.encode())
        self.paths.append(rel)

    def record(self, written: Sequence[Any]) -> None:
        """Mark the files of delta-spark's file actions ``written``."""
        for w in written:
            self.mark(unquote(str(w.path())))

    def discard(self) -> None:
        """The commit did not land: delete the files, then their markers."""
        for rel in self.paths:
            self.storage.delete(rel)
        self.done()

    def done(self) -> None:
        """The commit landed: delete the markers (the files are the table's)."""
        for seq in range(len(self.paths)):
            self.storage.delete(f"{STAGING_DIR}/{file_stem(self.name, seq)}")


def landed(dt: DeltaTable, name: TxnName) -> bool:
    """Whether the merge of transaction ``name`` may be in the table (rule 3):
    ``False`` only when it certainly is not."""
    app = scope_prefix(name.job, name.pipeline, name.sink_id, name.incarnation).rstrip(".")
    try:
        done = dt.transaction_version(app)
        if done is None or done < name.batch_id:
            return False
        wanted = progress.user_metadata(app, name.batch_id)
        limit = 16
        while True:
            history = dt.history(limit)
            for info in history:
                if info.get("userMetadata") == wanted:
                    tag = (info.get("tags") or {}).get(MERGE_TAG)
                    return tag is None or json.loads(tag).get("staged") == str(name)
            if len(history) < limit:
                return True  # the history no longer reaches it: keep the files
            limit *= 4
    except Exception:
        return True
