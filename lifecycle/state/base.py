"""What the ledger backends share: reads from the state in memory, and changes
built as operations (:mod:`lifecycle.state.model`) that a backend makes durable.

A backend loads the whole :class:`~lifecycle.state.model.LedgerState` when it
opens and is its only writer while it holds the ledger, so every read is
answered from memory at the cost of its answer. A change is checked here, then
handed to :meth:`StateLedger._change`, which makes the operation durable and
applies it to the state in memory (``LedgerState.apply``, the one place the
rules of every operation live).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

from lifecycle.state.model import KINDS, Batch, Checkpoint, LedgerState, Op, Pending
from lifecycle.state.protocol import check_batch
from sinks.base import Committable

T = TypeVar("T")


class StateLedger:
    """Reads and changes of a ledger over its state in memory. Thread-safe within
    one process: subclasses set ``_state`` and implement :meth:`_change`."""

    _state: LedgerState

    def __init__(self) -> None:
        self._mutex = threading.RLock()

    def _change(self, op: Op) -> None:
        """Make ``op`` durable, then apply it to ``_state``. The caller has checked
        that it applies; a failed change leaves the durable state unchanged."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # -- reading --------------------------------------------------------------------

    @property
    def job(self) -> str:
        return self._state.job

    @property
    def run(self) -> int:
        return self._state.run

    @property
    def incarnation(self) -> str:
        """This ledger's random id, drawn when it was created and never changed."""
        incarnation = self._state.incarnation
        assert incarnation is not None
        return incarnation

    def pending(self) -> Pending:
        """A copy of all pending committables (costs as much as they are: prefer
        :meth:`pending_batch`)."""
        with self._mutex:
            return copy.deepcopy(self._state.pending)

    def read_pending(self, read: Callable[[Pending], T]) -> T:
        """``read(pending)`` on the pending committables themselves, without a
        copy, while no operation changes them; ``read`` must not keep or change
        them."""
        with self._mutex:
            return read(self._state.pending)

    def evidence_floor(self, label: str) -> int | None:
        """The lowest batch of sink ``label`` whose audit evidence is kept (None: none)."""
        with self._mutex:
            return self._state.evidence_floor(label)

    def pending_pipelines(self) -> list[str]:
        """Pipelines with pending batches, sorted."""
        with self._mutex:
            return sorted(self._state.pending)

    def pending_batch_ids(self, pipeline: str) -> list[int]:
        """Ids of the pending batches of ``pipeline``, ascending."""
        with self._mutex:
            return list(self._state.batch_ids.get(pipeline, ()))

    def pending_batch(self, pipeline: str, batch_id: int) -> Batch | None:
        """A copy of the committables (sink -> list) of one pending batch, or None."""
        with self._mutex:
            return self._state.batch(pipeline, batch_id)

    def is_owned(self, txn: str) -> bool:
        """Whether a pending entry owns the transaction named ``txn``."""
        with self._mutex:
            return txn in self._state.owned

    def owned_txns(self) -> set[str]:
        """Names of every transaction a pending entry owns."""
        with self._mutex:
            return set(self._state.owned)

    def decided(self) -> Checkpoint | None:
        with self._mutex:
            d = self._state.decided
            return Checkpoint.from_json(copy.deepcopy(d)) if d else None

    def history(self) -> list[Checkpoint]:
        with self._mutex:
            return [Checkpoint.from_json(copy.deepcopy(c)) for c in self._state.history]

    def finished(self) -> set[str]:
        with self._mutex:
            return set(self._state.finished)

    def totals(self) -> dict[str, int]:
        with self._mutex:
            return dict(self._state.totals)

    def spark_completed(self, pipeline: str) -> int:
        """The highest batch of ``pipeline`` Spark reported complete (-1: none)."""
        with self._mutex:
            return self._state.spark_completed.get(pipeline, -1)

    def committed_cut(self, pipeline: str) -> int:
        """The highest batch of ``pipeline`` a completed checkpoint committed (-1: none)."""
        with self._mutex:
            return self._state.committed_cut.get(pipeline, -1)

    def committed_digest(self, pipeline: str, batch_id: int) -> str | None:
        """The offsets digest recorded with a committed batch, while it is among
        the last ``digest_window`` committed batches of ``pipeline`` that had one."""
        with self._mutex:
            return self._state.committed_digests.get(pipeline, {}).get(batch_id)

    def abandoned(self) -> list[dict[str, Any]]:
        """Every abandonment recorded: ``{"checkpoint", "txns", "note", "at"}``."""
        with self._mutex:
            return copy.deepcopy(self._state.abandoned)

    def abandoned_txns(self, checkpoint_id: int) -> set[str]:
        """Names of the transactions abandoned in checkpoint ``checkpoint_id``."""
        with self._mutex:
            return set(self._state.abandoned_txns.get(int(checkpoint_id), ()))

    def owed(self) -> dict[str, dict[int, dict[str, int]]]:
        """Batches owed to sinks that lost their work of them, per pipeline and
        batch: sink id -> the rows the lost work held (see :mod:`lifecycle.replay`)."""
        with self._mutex:
            return {
                p: {b: {sid: int(d["rows"]) for sid, d in sinks.items()} for b, sinks in bs.items()}
                for p, bs in self._state.owed.items()
            }

    def owed_parts(self, pipeline: str, batch_id: int) -> dict[str, list[int]]:
        """Per sink id that owes only the lost tasks' share of batch ``batch_id``
        of ``pipeline`` (its other tasks' work committed), the Spark partitions
        it owes; a sink that owes the whole batch is not in it."""
        with self._mutex:
            sinks = self._state.owed.get(pipeline, {}).get(int(batch_id), {})
            return {sid: list(d["parts"]) for sid, d in sinks.items() if "parts" in d}

    def owed_work(self, pipeline: str, batch_id: int) -> dict[str, list[Committable]]:
        """The work recorded as writing owed batch ``batch_id`` of ``pipeline``
        again, per sink id (only sinks that have such work)."""
        with self._mutex:
            sinks = self._state.owed.get(pipeline, {}).get(int(batch_id), {})
            return {sid: copy.deepcopy(d["work"]) for sid, d in sinks.items() if "work" in d}

    def sinks_settings(self) -> dict[str, dict[str, Any]]:
        """The recorded settings of every sink of the job, by ``pipeline/sink_id``
        (see :meth:`record_sinks`)."""
        with self._mutex:
            return copy.deepcopy(self._state.sinks)

    # -- changes --------------------------------------------------------------------

    def begin_run(self) -> int:
        with self._mutex:
            self._change({"op": "run"})
            return self.run

    def record_batch(
        self,
        pipeline: str,
        batch_id: int,
        committables: dict[str, list[Committable]],
        digest: str | None = None,
    ) -> None:
        """Record the committables (and the offsets digest) of a pre-committed
        batch; a batch recorded again replaces the earlier record."""
        if digest is not None and not isinstance(digest, str):
            raise TypeError(f"digest must be a str, not {type(digest).__name__}")
        check_batch(committables)
        op = {"op": "batch", "p": pipeline, "b": int(batch_id), "c": committables, "d": digest}
        self._change(op)

    def drop_batches(self, pipeline: str, batch_ids: list[int]) -> None:
        with self._mutex:
            pending = self._state.pending.get(pipeline, {})
            drop = [int(b) for b in batch_ids if b in pending]
            if drop:
                self._change({"op": "drop", "p": pipeline, "bs": drop})

    def decide(self, kind: str, cut: dict[str, int], finished: list[str]) -> Checkpoint:
        """Record a checkpoint decision. From here on it commits, whatever happens."""
        if kind not in KINDS:
            raise ValueError(f"unknown checkpoint kind {kind!r}")
        with self._mutex:
            if self._state.decided is not None:
                raise RuntimeError("a checkpoint is already being committed")
            cp = Checkpoint(
                id=self._state.next_checkpoint,
                kind=kind,
                cut={p: int(b) for p, b in cut.items()},
                finished=sorted(set(self._state.finished) | set(finished)),
                decided_at=time.time(),
            )
            self._change({"op": "decide", "cp": asdict(cp)})
            return cp

    def complete(
        self,
        cp: Checkpoint,
        rows: dict[str, int],
        evidence: dict[str, list[dict[str, Any]]] | None = None,
    ) -> Checkpoint:
        """Record that ``cp`` committed: its batches leave ``pending``; the
        history keeps ``evidence`` (sink label -> what each committed transaction
        left for an audit) with it."""
        with self._mutex:
            decided = self._state.decided
            if decided is None or decided["id"] != cp.id:
                raise RuntimeError(f"checkpoint {cp.id} is not the decided one")
            done = Checkpoint.from_json(
                {
                    **copy.deepcopy(decided),
                    "committed_at": time.time(),
                    "rows": dict(rows),
                    "evidence": evidence or {},
                }
            )
            op = {
                "op": "complete",
                "id": cp.id,
                "at": done.committed_at,
                "rows": done.rows,
                "evidence": done.evidence,
            }
            self._change(op)
            return done

    def record_spark_completed(self, pipeline: str, batch_id: int) -> None:
        """Spark reported ``batch_id`` of ``pipeline`` complete (a lower id than
        the one recorded changes nothing)."""
        with self._mutex:
            if batch_id > self._state.spark_completed.get(pipeline, -1):
                self._change({"op": "spark", "p": pipeline, "b": int(batch_id)})

    def record_sinks(self, sinks: dict[str, dict[str, Any]]) -> bool:
        """Record the settings of every sink of the job (``pipeline/sink_id`` ->
        the sink's ``settings()``, which holds no secret), replacing the ones
        recorded before; nothing is written when they are unchanged. Returns
        whether a record was written. The ``twophase`` commands rebuild the
        sinks from them (:func:`sinks.rebuild.from_settings`)."""
        if not isinstance(sinks, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in sinks.items()
        ):
            raise TypeError("sinks must map 'pipeline/sink_id' to a settings dict")
        payload = json.loads(json.dumps(sinks, allow_nan=False))  # JSON values only
        with self._mutex:
            if payload == self._state.sinks:
                return False
            self._change({"op": "sinks", "s": payload})
            return True

    def record_owed(
        self,
        pipeline: str,
        batches: dict[int, dict[str, int]],
        parts: dict[int, dict[str, list[int]]] | None = None,
    ) -> None:
        """Record that ``batches`` of ``pipeline`` (batch id -> sink id -> rows)
        are owed to those sinks: their work of them was lost before it committed
        (or follows lost work), and each batch is to be written to them again
        from its source. ``parts`` (batch id -> sink id -> Spark partitions):
        where a sink owes only the lost tasks' share of a batch, because the
        rest of its work of it committed. One change, whatever the number of
        batches."""
        owe = {str(b): dict(sinks) for b, sinks in batches.items() if sinks}
        if owe:
            op: dict[str, Any] = {"op": "owe", "p": pipeline, "s": owe}
            share = {
                str(b): {sid: sorted(ks) for sid, ks in sinks.items()}
                for b, sinks in (parts or {}).items()
                if sinks
            }
            if share:
                op["parts"] = share
            self._change(op)

    def record_repaying(
        self, pipeline: str, batch_id: int, work: dict[str, list[Committable]]
    ) -> None:
        """Record the work (sink id -> committables) that writes owed batch
        ``batch_id`` of ``pipeline`` again, before it commits."""
        with self._mutex:
            owed = self._state.owed.get(pipeline, {}).get(int(batch_id), {})
            if not set(work) <= set(owed):
                raise RuntimeError(f"batch {batch_id} of {pipeline} is not owed to {sorted(work)}")
            self._change({"op": "repaying", "p": pipeline, "b": int(batch_id), "s": work})

    def record_repaid(self, pipeline: str, batch_id: int, sinks: dict[str, int]) -> None:
        """Record that ``sinks`` (sink id -> rows committed) hold batch
        ``batch_id`` of ``pipeline`` again."""
        if sinks:
            op = {"op": "repaid", "p": pipeline, "b": int(batch_id), "s": dict(sinks)}
            self._change(op)

    def record_abandoned(self, checkpoint_id: int, txns: list[str], note: str) -> None:
        """Keep the record that checkpoint ``checkpoint_id`` abandoned ``txns``."""
        op = {
            "op": "abandon",
            "checkpoint": int(checkpoint_id),
            "txns": [str(t) for t in txns],
            "note": str(note),
            "at": time.time(),
        }
        self._change(op)
