"""Reading a Spark streaming query's commit log: which batches Spark completed.

Spark writes ``<checkpointLocation>/commits/<batchId>`` (atomically, by rename)
once a micro-batch has finished, and never replays a batch that has one. That
file is the "checkpoint complete" truth for a batch; it is read from disk, so
the answer is the same during a run and after a crash.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


class SparkCommitLog:
    """The commit log of one streaming query (a local checkpoint location)."""

    def __init__(self, checkpoint_location: str | os.PathLike[str]) -> None:
        self.location = Path(checkpoint_location)
        self.commits = self.location / "commits"

    def exists(self) -> bool:
        """Whether the query has ever started (its checkpoint has metadata)."""
        return (self.location / "metadata").exists()

    def latest(self) -> int:
        """Highest batch id Spark has completed, or -1 when none."""
        try:
            names = os.listdir(self.commits)
        except FileNotFoundError:
            return -1
        ids = [int(n) for n in names if n.isdigit()]
        return max(ids, default=-1)

    def completed(self, batch_id: int) -> bool:
        return batch_id <= self.latest()

    def offsets_digest(self, batch_id: int) -> str | None:
        """A digest of the source offsets Spark planned for ``batch_id`` (its
        ``offsets/<batch_id>`` entry without the metadata line, which holds
        times), or None when Spark has not planned the batch."""
        try:
            lines = (self.location / "offsets" / str(batch_id)).read_text().splitlines()
        except FileNotFoundError:
            return None
        return hashlib.sha256("\n".join(lines[2:]).encode()).hexdigest()[:32]
