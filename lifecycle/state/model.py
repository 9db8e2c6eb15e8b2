"""The ledger's state in memory and the operations that change it.

The journal records operations, not documents. An operation is a small JSON
object (``{"op": "batch", ...}``) carrying everything it needs (times
included), and :meth:`LedgerState.apply` is deterministic: replaying a
snapshot's journal gives back the state the writer had. Applying an operation
costs time proportional to what it touches (one batch's committables, the
batches a checkpoint commits), never to the whole state, and so do the
queries: the pending batches of a pipeline are kept with their ids sorted, and
an index of transaction names owned by pending entries is kept up to date.

Operations::

    ``run``                     a new run started
    ``batch p b c d``           committables ``c`` (sink -> list) of pending batch ``b``
                                of pipeline ``p``, with the offsets digest ``d`` (or null);
                                replaces an earlier registration of the batch
    ``drop p bs``               pending batches ``bs`` of ``p`` leave without a commit
    ``decide cp``               checkpoint ``cp`` is decided
    ``complete id at rows ev``  the decided checkpoint ``id`` committed at ``at``, with
                                the audit evidence ``ev`` (sink -> list) kept in the history
    ``spark p b``               Spark reported batch ``b`` of ``p`` complete
    ``abandon checkpoint txns note at``  an abandonment, kept for the record
    ``sinks s``                 the settings of every sink of the job (label -> the
                                sink's non-secret ``settings()``), replacing the last ones
    ``limits history digests``  how many checkpoints and digests are kept
    ``owe p s parts``           batches of ``p`` are owed to sinks, ``s``: batch -> sink id
                                -> rows: the sinks' work of them was lost in the target
                                before it committed (or follows lost work), so each batch
                                is written to them again from its source
                                (lifecycle.replay); ``parts`` (optional): batch -> sink
                                id -> the Spark partitions owed, where only the lost
                                tasks' share of a batch is owed (the rest committed)
    ``repaying p b s``          the work (sink id -> committables) that writes owed batch
                                ``b`` of ``p`` again, recorded before it commits (owned:
                                no sweep aborts it)
    ``repaid p b s``            sinks ``s`` (sink id -> rows) of batch ``b`` of ``p`` hold it
                                again: it leaves ``owed``, its rows count in the totals

Format 3 added ``owe``, ``repaying`` and ``repaid`` (the ``owed`` field of the
document: pipeline -> batch -> sink id -> ``{"rows", "work"}``); a
format-2 document reads as one that owes nothing. A version that knows only
format 2 refuses a format-3 ledger rather than skip what it owes. Format 4
added ``parts`` to a debt (``{"rows", "parts", "work"}``: only those Spark
partitions of the batch are owed); a version that knows only format 3 refuses
a format-4 ledger rather than write a whole batch again whose other tasks
committed.
"""

from __future__ import annotations

import copy
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sinks.base import Committable
from sinks.naming import TxnName

FORMAT = 4
READABLE_FORMATS = (2, 3, 4)
"""the document formats this version reads (and writes as :data:`FORMAT`)"""
HISTORY = 50
DIGEST_WINDOW = 1000
KINDS = ("periodic", "final", "savepoint", "recovery")

Batch = dict[str, list[Committable]]
"""sink id -> committables of one batch"""

# pending: pipeline -> batch id -> sink id -> committables
Pending = dict[str, dict[int, Batch]]

Op = dict[str, Any]


@dataclass
class Checkpoint:
    """A cut across pipelines: every pending batch at or below ``cut[p]`` commits.
    ``finished``: every pipeline finished as of this checkpoint (cumulative)."""

    id: int
    kind: str
    cut: dict[str, int]
    finished: list[str] = field(default_factory=list)
    decided_at: float = 0.0
    committed_at: float | None = None
    rows: dict[str, int] = field(default_factory=dict)
    evidence: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """per sink label, what each committed transaction left for an audit
    (see :mod:`lifecycle.audit`); empty before the commit"""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Checkpoint:
        return cls(**{k: v for k, v in d.items() if k in _CHECKPOINT_FIELDS})


_CHECKPOINT_FIELDS = frozenset(Checkpoint.__dataclass_fields__)


class LedgerState:
    """Everything the ledger holds, with the indexes its queries need."""

    def __init__(
        self,
        job: str,
        incarnation: str | None,
        *,
        history: int = HISTORY,
        digest_window: int = DIGEST_WINDOW,
    ) -> None:
        self.job = job
        self.incarnation = incarnation
        self.run = 0
        self.next_checkpoint = 1
        self.pending: Pending = {}
        self.batch_ids: dict[str, list[int]] = {}  # pending batch ids per pipeline, sorted
        self.digests: dict[str, dict[int, str]] = {}  # offsets digests of pending batches
        self.owned: dict[str, int] = {}  # txn -> how many pending committables name it
        self.decided: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self.finished: list[str] = []
        self.totals: dict[str, int] = {}
        self.spark_completed: dict[str, int] = {}
        self.committed_cut: dict[str, int] = {}
        # digests of committed batches, oldest first, at most digest_window per pipeline
        self.committed_digests: dict[str, dict[int, str]] = {}
        self.abandoned: list[dict[str, Any]] = []
        # checkpoint id -> names of the transactions abandoned in it (index of the above)
        self.abandoned_txns: dict[int, set[str]] = {}
        self.sinks: dict[str, dict[str, Any]] = {}  # label -> non-secret settings
        # pipeline -> batch id -> sink id -> {"rows": n, "work": [committables] (once
        # recorded)}: lost batches written again from source
        self.owed: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
        self.history_limit = history
        self.digest_window = digest_window
        self._ops: dict[str, Callable[[Op], None]] = {
            "run": self._run,
            "batch": self._batch,
            "drop": self._drop,
            "decide": self._decide,
            "complete": self._complete,
            "spark": self._spark,
            "abandon": self._abandon,
            "sinks": self._sinks,
            "limits": self._limits,
            "owe": self._owe,
            "repaying": self._repaying,
            "repaid": self._repaid,
        }

    # -- operations -------------------------------------------------------------------

    def apply(self, op: Op) -> None:
        """Apply one operation (module docstring). Raises ValueError for an
        operation that does not fit the state (unknown, or a checkpoint that is
        not the decided one)."""
        handler = self._ops.get(op.get("op", ""))
        if handler is None:
            raise ValueError(f"unknown ledger operation {op.get('op')!r}")
        handler(op)

    def _run(self, op: Op) -> None:
        self.run += 1

    def _batch(self, op: Op) -> None:
        p: str = op["p"]
        b: int = op["b"]
        batches = self.pending.setdefault(p, {})
        earlier = batches.get(b)
        if earlier is None:
            insort(self.batch_ids.setdefault(p, []), b)
        else:
            self._disown(earlier)
        batches[b] = op["c"]
        self._own(op["c"])
        if op.get("d") is None:
            self.digests.get(p, {}).pop(b, None)
        else:
            self.digests.setdefault(p, {})[b] = op["d"]

    def _drop(self, op: Op) -> None:
        p: str = op["p"]
        ids = self.batch_ids.get(p, [])
        for b in op["bs"]:
            if b in self.pending.get(p, {}):
                self._remove(p, b)
                del ids[bisect_left(ids, b)]
        self._tidy(p)

    def _decide(self, op: Op) -> None:
        if self.decided is not None:
            raise ValueError("a checkpoint is already being committed")
        self.decided = op["cp"]
        self.next_checkpoint = int(op["cp"]["id"]) + 1

    def _complete(self, op: Op) -> None:
        cp = self.decided
        if cp is None or cp["id"] != op["id"]:
            raise ValueError(f"checkpoint {op['id']} is not the decided one")
        for p, last in cp["cut"].items():
            ids = self.batch_ids.get(p, [])
            k = bisect_right(ids, last)
            for b in ids[:k]:
                digest = self._remove(p, b)
                if digest is not None:
                    self._remember_digest(p, b, digest)
            del ids[:k]
            self._tidy(p)
            self.committed_cut[p] = max(self.committed_cut.get(p, -1), last)
        self.history.append(
            {
                **cp,
                "committed_at": op["at"],
                "rows": dict(op["rows"]),
                "evidence": op.get("evidence") or {},
            }
        )
        self._trim_history()
        self.finished = sorted(set(self.finished) | set(cp["finished"]))
        for sink, n in op["rows"].items():
            self.totals[sink] = self.totals.get(sink, 0) + n
        self.decided = None

    def _spark(self, op: Op) -> None:
        p: str = op["p"]
        self.spark_completed[p] = max(self.spark_completed.get(p, -1), op["b"])

    def _abandon(self, op: Op) -> None:
        self.abandoned.append(
            {"checkpoint": op["checkpoint"], "txns": op["txns"], "note": op["note"], "at": op["at"]}
        )
        self.abandoned_txns.setdefault(int(op["checkpoint"]), set()).update(op["txns"])

    def _sinks(self, op: Op) -> None:
        self.sinks = dict(op["s"])

    def _limits(self, op: Op) -> None:
        self.history_limit = op["history"]
        self.digest_window = op["digests"]
        self._trim_history()
        for p in self.committed_digests:
            self._trim_digests(p)

    def _owe(self, op: Op) -> None:
        batches = self.owed.setdefault(op["p"], {})
        parts = op.get("parts") or {}
        for b, sinks in op["s"].items():
            owed = batches.setdefault(int(b), {})
            for sid, rows in sinks.items():
                debt: dict[str, Any] = {"rows": int(rows)}
                share = (parts.get(str(b)) or {}).get(sid)
                if share is not None:
                    debt["parts"] = sorted(int(k) for k in share)
                owed.setdefault(str(sid), debt)

    def _repaying(self, op: Op) -> None:
        owed = self.owed[op["p"]][int(op["b"])]
        for sid, work in op["s"].items():
            if "work" in owed[sid]:
                self._disown({sid: owed[sid]["work"]})
            owed[sid]["work"] = work
            self._own({sid: work})  # kept from sweeps until it is settled

    def _repaid(self, op: Op) -> None:
        p: str = op["p"]
        b = int(op["b"])
        owed = self.owed.get(p, {}).get(b, {})
        for sid, n in op["s"].items():
            debt = owed.pop(sid, None)
            if debt is not None and "work" in debt:
                self._disown({sid: debt["work"]})
            label = f"{p}/{sid}"
            self.totals[label] = self.totals.get(label, 0) + int(n)
        if not owed:
            self.owed.get(p, {}).pop(b, None)
        if not self.owed.get(p):
            self.owed.pop(p, None)

    # -- helpers ----------------------------------------------------------------------

    def _own(self, batch: Batch) -> None:
        for cs in batch.values():
            for c in cs:
                txn = c.get("txn")
                if isinstance(txn, str):
                    self.owned[txn] = self.owned.get(txn, 0) + 1

    def _disown(self, batch: Batch) -> None:
        for cs in batch.values():
            for c in cs:
                txn = c.get("txn")
                if isinstance(txn, str):
                    left = self.owned[txn] - 1
                    if left:
                        self.owned[txn] = left
                    else:
                        del self.owned[txn]

    def _remove(self, p: str, b: int) -> str | None:
        """Remove pending batch ``b`` of ``p`` (not from ``batch_ids``); its digest."""
        self._disown(self.pending[p].pop(b))
        return self.digests.get(p, {}).pop(b, None)

    def _tidy(self, p: str) -> None:
        if not self.pending.get(p):
            self.pending.pop(p, None)
            self.batch_ids.pop(p, None)
        if not self.digests.get(p):
            self.digests.pop(p, None)

    def _remember_digest(self, p: str, b: int, digest: str) -> None:
        kept = self.committed_digests.setdefault(p, {})
        kept.pop(b, None)  # re-inserted as the newest
        kept[b] = digest
        self._trim_digests(p)

    def _trim_digests(self, p: str) -> None:
        kept = self.committed_digests[p]
        while len(kept) > self.digest_window:
            del kept[next(iter(kept))]

    def _trim_history(self) -> None:
        extra = len(self.history) - self.history_limit
        if extra > 0:
            del self.history[:extra]

    # -- queries ------------------------------------------------------------------------

    def evidence_floor(self, label: str) -> int | None:
        """The lowest batch of sink ``label`` whose evidence the history keeps
        (None: it keeps none of that sink). Batches only grow from checkpoint to
        checkpoint, so the oldest checkpoint holding the sink's evidence has it."""
        for cp in self.history:
            found = (cp.get("evidence") or {}).get(label)
            if found:
                names = (TxnName.parse(str(c.get("txn"))) for c in found)
                return min((n.batch_id for n in names if n is not None), default=None)
        return None

    def batch(self, p: str, b: int) -> Batch | None:
        """A copy of the committables of pending batch ``b`` of ``p``."""
        found = self.pending.get(p, {}).get(b)
        return copy.deepcopy(found) if found is not None else None

    # -- documents ------------------------------------------------------------------------

    def to_doc(self) -> dict[str, Any]:
        """The state as a JSON document (a snapshot; what ``twophase status`` shows).
        It shares objects with the state: serialise or copy it before the next change."""
        return {
            "format": FORMAT,
            "job": self.job,
            "incarnation": self.incarnation,
            "run": self.run,
            "next_checkpoint": self.next_checkpoint,
            "pending": {
                p: {str(b): self.pending[p][b] for b in self.batch_ids[p]}
                for p in sorted(self.pending)
            },
            "pending_digests": {
                p: {str(b): d for b, d in sorted(ds.items())} for p, ds in self.digests.items()
            },
            "decided": self.decided,
            "history": self.history,
            "finished": self.finished,
            "totals": self.totals,
            "spark_completed": self.spark_completed,
            "committed_cut": self.committed_cut,
            "committed_digests": {
                p: {str(b): d for b, d in ds.items()} for p, ds in self.committed_digests.items()
            },
            "abandoned": self.abandoned,
            "sinks": self.sinks,
            "limits": {"history": self.history_limit, "digests": self.digest_window},
            "owed": {
                p: {str(b): sinks for b, sinks in sorted(batches.items())}
                for p, batches in sorted(self.owed.items())
            },
        }

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> LedgerState:
        """The state a document of format 2 or 3 describes (see :meth:`to_doc`)."""
        limits = doc["limits"]
        state = cls(
            doc["job"],
            doc["incarnation"],
            history=int(limits["history"]),
            digest_window=int(limits["digests"]),
        )
        state.run = int(doc["run"])
        state.next_checkpoint = int(doc["next_checkpoint"])
        digests = doc.get("pending_digests", {})
        for p, batches in doc["pending"].items():
            for b, committables in batches.items():
                state._batch({"p": p, "b": int(b), "c": committables, "d": None})
            for b, d in digests.get(p, {}).items():
                state.digests.setdefault(p, {})[int(b)] = d
        state.decided = doc["decided"]
        state.history = list(doc["history"])
        state.finished = list(doc["finished"])
        state.totals = dict(doc["totals"])
        state.spark_completed = {p: int(b) for p, b in doc.get("spark_completed", {}).items()}
        state.committed_cut = {p: int(b) for p, b in doc.get("committed_cut", {}).items()}
        for p, ds in doc.get("committed_digests", {}).items():
            state.committed_digests[p] = {int(b): d for b, d in ds.items()}
            state._trim_digests(p)
        for a in doc.get("abandoned", []):
            state._abandon(a)
        state.sinks = dict(doc.get("sinks", {}))
        for p, batches in doc.get("owed", {}).items():  # format 3
            state.owed[p] = {
                int(b): {sid: dict(debt) for sid, debt in sinks.items()}
                for b, sinks in batches.items()
            }
            for sinks in state.owed[p].values():
                state._own({sid: d["work"] for sid, d in sinks.items() if "work" in d})
        state._trim_history()
        return state
