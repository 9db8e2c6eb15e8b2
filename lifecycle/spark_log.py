"""Reading a Spark streaming query's commit log: which batches Spark completed.

Spark writes ``<checkpointLocation>/commits/<batchId>`` (atomically, by rename)
once a micro-batch has finished, and never replays a batch that has one. That
file is the "checkpoint complete" truth for a batch; it is read from the
checkpoint location itself (through the job's state store, so on whatever
storage the location is), and the answer is the same during a run and after a
crash.
"""

from __future__ import annotations

import hashlib
import os

from lifecycle.state.store import LocalStore
from lifecycle.state.store_interface import StateStore


class SparkCommitLog:
    """The commit log of one streaming query: its checkpoint location is
    ``location`` in ``store``, or the local directory ``store`` when no
    location is given."""

    def __init__(self, store: StateStore | str | os.PathLike[str], location: str = "") -> None:
        self.store = store if isinstance(store, StateStore) else LocalStore(store)
        self.location = location

    def _rel(self, *names: str) -> str:
        return "/".join(n for n in (self.location, *names) if n)

    def exists(self) -> bool:
        """Whether the query has ever started (its checkpoint has metadata)."""
        return self.store.exists(self._rel("metadata"))

    def latest(self) -> int:
        """Highest batch id Spark has completed, or -1 when none."""
        ids = [int(n) for n in self.store.list(self._rel("commits")) if n.isdigit()]
        return max(ids, default=-1)

    def completed(self, batch_id: int) -> bool:
        return batch_id <= self.latest()

    def planned_offsets(self, batch_id: int) -> list[str] | None:
        """The source offsets Spark planned for ``batch_id``, one line per source
        (its ``offsets/<batch_id>`` entry without the version and the metadata
        line, which holds times), or None when Spark has not planned the batch."""
        data = self.store.read(self._rel("offsets", str(batch_id)))
        if data is None:
            return None
        return data.decode().splitlines()[2:]

    def offsets_digest(self, batch_id: int) -> str | None:
        """A digest of :meth:`planned_offsets`, or None when Spark has not
        planned the batch."""
        lines = self.planned_offsets(batch_id)
        if lines is None:
            return None
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]
