"""A sink in memory that is its own committer: the base of the test doubles
that exercise the coordinator's decisions without a target (the recovery rules,
parallel commits, the ledger's cost). It keeps no claim and no progress,
cannot classify or list its work, and sweeps nothing; subclasses record what
they are asked to do."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from sinks.base import (
    Committable,
    Committer,
    JobScope,
    LingeringTxn,
    OrphanTest,
    Outcome,
    Sink,
    SinkWriter,
    WriteContext,
)
from sinks.progress import SinkProgress


class MemorySink(Sink, Committer):
    """Writes nothing; commits, aborts and sweeps nothing unless overridden."""

    kind = "memory"

    def __init__(self, sink_id: str = "s") -> None:
        self._sink_id = sink_id

    @property
    def sink_id(self) -> str:
        return self._sink_id

    def preflight(self, schema: pa.Schema) -> None:
        pass

    def open_writer(self, ctx: WriteContext, schema: pa.Schema) -> SinkWriter:
        raise NotImplementedError(f"{self.describe()} writes nothing")

    def committer(self) -> Committer:
        return self

    def claim(self, scope: JobScope, *, start_over_from: str | None = None) -> SinkProgress:
        return SinkProgress(owner=scope.incarnation)

    def progress(self, scope: JobScope) -> SinkProgress:
        return SinkProgress(owner=None)

    def commit(self, committables: Sequence[Committable]) -> None:
        pass

    def abort(self, committables: Sequence[Committable]) -> None:
        pass

    def classify(self, committables: Sequence[Committable]) -> dict[str, Outcome]:
        raise NotImplementedError(f"{self.describe()} cannot classify its transactions")

    def lingering(self, job: str, pipeline: str) -> list[LingeringTxn]:
        raise NotImplementedError(f"{self.describe()} cannot list its lingering work")

    def sweep(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        return []
