"""Who writes: a job's pipeline's sink, and the incarnation that holds it.

:class:`JobScope` names the work of one sink of one pipeline of one job, and
the incarnation (the ledger's random id) that writes it; transaction names
start with it (:mod:`sinks.naming`). :class:`ClaimedScopes` is a committer's
memory of the scopes it claimed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sinks.naming import TxnName, scope_prefix


@dataclass(frozen=True)
class JobScope:
    """Identifies the job, pipeline and sink a sink instance writes for, and the
    incarnation (the ledger's random id) that writes. ``incarnation`` is None
    only for work named before incarnations existed."""

    job: str
    pipeline: str
    sink_id: str
    incarnation: str | None = None

    def txn_prefix(self) -> str:
        """The prefix shared by every transaction name of this scope (this
        incarnation's names only)."""
        return scope_prefix(self.job, self.pipeline, self.sink_id, self.incarnation)

    def own_prefixes(self) -> tuple[str, ...]:
        """The prefixes of every name this incarnation may sweep: its own, and
        those of the first format (work prepared before an upgrade, which the
        upgraded ledger owns)."""
        legacy = scope_prefix(self.job, self.pipeline, self.sink_id, None)
        return (self.txn_prefix(),) if self.incarnation is None else (self.txn_prefix(), legacy)

    def key(self) -> str:
        """``job/pipeline/sink``: the scope in progress records and messages."""
        return f"{self.job}/{self.pipeline}/{self.sink_id}"


class ClaimedScopes:
    """The scopes a driver-side sink instance claimed, and for which incarnation.

    A committable commits in the scope of the incarnation its name carries. A
    first-format name (no incarnation, prepared before an upgrade) commits as
    the incarnation that claimed its scope: the upgraded ledger owns it."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str, str], str] = {}

    def remember(self, scope: JobScope) -> None:
        """Record that ``scope.incarnation`` holds the claim of ``scope``."""
        assert scope.incarnation is not None
        self._by_key[(scope.job, scope.pipeline, scope.sink_id)] = scope.incarnation

    def owns(self, scope: JobScope) -> bool:
        """Whether this instance claimed ``scope`` (its incarnation included)."""
        key = (scope.job, scope.pipeline, scope.sink_id)
        return self._by_key.get(key) == scope.incarnation

    def owner(self, job: str, pipeline: str, sink_id: str, incarnation: str | None) -> str | None:
        """The incarnation work named with ``incarnation`` commits as."""
        return incarnation or self._by_key.get((job, pipeline, sink_id))

    def group(self, names: Iterable[TxnName]) -> dict[JobScope, list[TxnName]]:
        """``names`` by the scope, with its owning incarnation, they commit in."""
        groups: dict[JobScope, list[TxnName]] = {}
        for n in names:
            owner = self.owner(n.job, n.pipeline, n.sink_id, n.incarnation)
            groups.setdefault(JobScope(n.job, n.pipeline, n.sink_id, owner), []).append(n)
        return groups
