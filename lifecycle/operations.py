"""What the ``twophase`` commands do to a job's state and sinks, without Spark.

The sinks are rebuilt from the settings the ledger records (``record_sinks``,
written by ``Job.run`` after preflight), their secrets from the environment
(:mod:`sinks.settings`). :mod:`lifecycle.cli` only parses and prints.

The ledger is the one a ``ledger`` location names (the job's ``ledger=``: a
PostgreSQL URI, or the local directory of a file ledger), else the
state_dir's (the PostgreSQL ledger recorded in ``STATE_DIR/ledger.location``,
or ``STATE_DIR/ledger`` of a local state_dir): see
:func:`lifecycle.ledger.locate`. STATE_DIR may be a URI: its files
(``ledger.location``, Spark's commit log) are read through the state store, in
a JVM of the command's own (:func:`lifecycle.state.store.open_store`).

* :func:`lingering` (read-only, the job may be running): every prepared
  transaction, announced Kafka transaction and staged Delta file of the job that
  the sinks hold, of every incarnation, each with the ledger's view of it.
* :class:`Operator` (holds the ledger's lock, so no job runs meanwhile):
  ``recover`` applies the coordinator's recovery rules, reading Spark's commit
  log from ``STATE_DIR/pipelines/<p>/spark/commits`` (through the state
  store); ``lost`` finds the
  transactions of the decided checkpoint a commit would find lost, and
  ``abandon`` records an operator's decision to give them up.
"""

from __future__ import annotations

import contextlib
import getpass
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from lifecycle.coordinator import Coordinator
from lifecycle.job_sinks import Observer, PipelineSinks, sink_label
from lifecycle.ledger import Checkpoint, Ledger, State, locate, open_ledger, read_ledger
from lifecycle.spark_log import SparkCommitLog
from lifecycle.state.pg_location import PgLocation
from lifecycle.state.store import open_store
from lifecycle.state.store_interface import StateStore
from sinks.base import Committable, LingeringTxn, Outcome, Sink
from sinks.errors import ConfigError, TwoPhaseError
from sinks.rebuild import from_settings


class NoLedgerError(ConfigError):
    """STATE_DIR holds no ledger, or one that cannot serve the command."""


class AbandonRefusedError(TwoPhaseError):
    """``twophase abandon`` does not apply: the checkpoint is not the decided
    one, or nothing in it is lost."""


def ledger_place(
    where: str | Path | StateStore, state: State | None = None, *, named: bool = False
) -> str:
    """Where the ledger at ``where`` (:func:`~lifecycle.ledger.locate`) is, for
    messages: a PostgreSQL URI without its password (with the state_dir that
    recorded it, unless ``named`` on the command line), a directory, or the
    ledger of a URI state_dir."""
    if isinstance(where, Path):
        return str(where)
    if isinstance(where, StateStore):
        return where.uri("ledger")
    shown = PgLocation.parse(where).display()
    if named or state is None:
        return shown
    state_dir = state.uri() if isinstance(state, StateStore) else state
    return f"{shown} (the ledger of {state_dir})"


def read_state(
    state: State | None, ledger: str | None = None
) -> tuple[dict[str, Any], str | Path | StateStore]:
    """The ledger document of ``state`` (a state_dir or its store) or of the
    ledger at ``ledger`` (see :func:`read_ledger`), and where that ledger is."""
    if state is None and ledger is None:
        raise NoLedgerError("needs a STATE_DIR or a ledger location")
    where = locate(state, ledger)
    doc = read_ledger(location=where)
    if doc is None:
        raise NoLedgerError(f"no ledger in {ledger_place(where, state, named=ledger is not None)}")
    return doc, where


def rebuild_sinks(
    recorded: Mapping[str, Mapping[str, Any]], secrets: Mapping[str, str] | None = None
) -> dict[str, dict[str, Sink]]:
    """``pipeline -> sink id -> sink`` from the recorded settings (label ->
    settings), secrets from ``secrets`` (default: the environment)."""
    out: dict[str, dict[str, Sink]] = {}
    for label, settings in sorted(recorded.items()):
        pipeline, _, sid = label.partition("/")
        out.setdefault(pipeline, {})[sid] = from_settings(settings, secrets)
    return out


def _needed_labels(doc: Mapping[str, Any]) -> set[str]:
    """Labels of the sinks that hold pending work or are part of the decision."""
    return {
        sink_label(p, sid)
        for p, batches in (doc.get("pending") or {}).items()
        for sinks in batches.values()
        for sid in sinks
    }


def _check_recorded(doc: Mapping[str, Any], where: str) -> None:
    missing = sorted(_needed_labels(doc) - set(doc.get("sinks") or {}))
    if missing or not doc.get("sinks"):
        raise NoLedgerError(
            f"the ledger in {where} records no settings for sink(s) "
            f"{missing or '(any)'} (it was last run by a version that did not record them): "
            "run the job itself, which records them after preflight and recovers"
        )


def close_sinks(sinks: Mapping[str, Mapping[str, Sink]]) -> None:
    """Close every sink of :func:`rebuild_sinks`, whatever happens."""
    for by_id in sinks.values():
        for sink in by_id.values():
            with contextlib.suppress(Exception):
                sink.close()


# -- lingering --------------------------------------------------------------------------


@dataclass(frozen=True)
class Lingering:
    """One piece of unfinished work a sink holds, with the ledger's view."""

    label: str
    """``pipeline/sink_id``"""
    target: str
    """what the sink writes to (``describe()``)"""
    txn: LingeringTxn
    ours: bool
    """True when it is of this state's incarnation (or of the first name format)"""
    view: str
    """what the ledger says of it"""


def owners(doc: Mapping[str, Any]) -> dict[str, int]:
    """Transaction name -> the pending batch that owns it, from a ledger document."""
    return {
        c["txn"]: int(b)
        for batches in (doc.get("pending") or {}).values()
        for b, sinks in batches.items()
        for cs in sinks.values()
        for c in cs
        if isinstance(c.get("txn"), str)
    }


def ledger_view(
    doc: Mapping[str, Any], found: LingeringTxn, owned: Mapping[str, int]
) -> tuple[bool, str]:
    """``(ours, what the ledger document says of found)``; ``owned`` is
    :func:`owners` of the document."""
    name = found.name
    incarnation = doc.get("incarnation")
    if name.incarnation is not None and name.incarnation != incarnation:
        return False, (
            f"another incarnation's ({name.incarnation}): this state leaves it alone "
            "(a start-over from that incarnation aborts it)"
        )
    owner = owned.get(found.txn)
    if owner is None:
        if found.state in ("committed", "aborted"):
            return True, "unowned, ended: the next start tombstones its announcement"
        return True, "unowned: an orphan the next start aborts"
    decided = doc.get("decided")
    if decided is not None and owner <= decided["cut"].get(name.pipeline, -1):
        abandoned = {
            t
            for a in doc.get("abandoned") or []
            if a["checkpoint"] == decided["id"]
            for t in a["txns"]
        }
        if found.txn in abandoned:
            return True, (
                f"part of decided checkpoint {decided['id']} (batch {owner}), abandoned: "
                "skipped when it commits, then swept"
            )
        return True, (
            f"part of decided checkpoint {decided['id']} (batch {owner}): the next start commits it"
        )
    return True, (
        f"owned by pending batch {owner}: the next start commits it if Spark completed "
        "the batch, else aborts it"
    )


def lingering(
    state_dir: str | Path | None,
    secrets: Mapping[str, str] | None = None,
    *,
    ledger: str | None = None,
) -> tuple[dict[str, Any], list[Lingering]]:
    """The ledger document and everything the job's sinks hold unfinished (see
    the module docstring). Reads only: the job may be running. ``ledger``: the
    job's ``ledger=`` (then ``state_dir`` is optional)."""
    doc, where = read_state(state_dir, ledger)
    _check_recorded(doc, ledger_place(where, state_dir, named=ledger is not None))
    sinks = rebuild_sinks(doc["sinks"], secrets)
    owned = owners(doc)
    found: list[Lingering] = []
    try:
        for p, by_id in sorted(sinks.items()):
            for sid, sink in sorted(by_id.items()):
                for t in sink.committer().lingering(doc["job"], p):
                    ours, view = ledger_view(doc, t, owned)
                    found.append(Lingering(sink_label(p, sid), sink.describe(), t, ours, view))
    finally:
        close_sinks(sinks)
    return doc, found


# -- recover, abandon -----------------------------------------------------------------------


@dataclass
class LostTxn:
    """A transaction of the decided checkpoint that a commit would find lost."""

    label: str
    target: str
    committable: Committable

    @property
    def txn(self) -> str:
        return str(self.committable["txn"])

    @property
    def rows(self) -> int:
        return int(self.committable.get("rows", 0))


@dataclass
class Assessment:
    """What each sink says of the transactions of the decided checkpoint."""

    checkpoint: Checkpoint
    lost: list[LostTxn] = field(default_factory=list)
    states: dict[str, dict[str, int]] = field(default_factory=dict)
    """label -> state (committed / prepared / lost) -> how many"""
    rows: dict[str, dict[str, int]] = field(default_factory=dict)
    """label -> state -> rows"""


class Operator:
    """An operator's hold on a stopped job: the ledger (locked: refused while a
    job runs) and the sinks rebuilt from it. Use as a context manager.
    ``ledger``: the job's ``ledger=`` (needed when ``state_dir`` does not lead to
    it: a file ledger of its own directory, a PostgreSQL ledger not recorded)."""

    def __init__(
        self,
        state_dir: str | Path,
        secrets: Mapping[str, str] | None = None,
        *,
        observer: Observer | None = None,
        ledger: str | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.store = open_store(state_dir, None)  # a URI: a JVM of its own
        doc, where = read_state(self.store, ledger)
        _check_recorded(doc, ledger_place(where, self.store, named=ledger is not None))
        limits = doc.get("limits") or {}
        kept = {
            k: int(v)
            for k, v in (
                ("history", limits.get("history")),
                ("digest_window", limits.get("digests")),
            )
            if v is not None
        }
        # the lock, with the job's own limits (a default would trim its audit evidence)
        located = None if isinstance(where, StateStore) else where  # the state_dir's own
        self.ledger: Ledger = open_ledger(located, self.store, doc["job"], **kept)
        try:
            self.sinks = rebuild_sinks(self.ledger.sinks_settings(), secrets)
        except BaseException:
            self.ledger.close()
            raise
        self.coordinator = Coordinator(
            self.ledger.job,
            self.ledger,
            [
                PipelineSinks(p, by_id, SparkCommitLog(self.store, f"pipelines/{p}/spark"))
                for p, by_id in self.sinks.items()
            ],
            observer=observer,
        )

    def __enter__(self) -> Operator:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        close_sinks(self.sinks)
        self.ledger.close()

    def recover(self) -> list[Checkpoint]:
        """Claim every sink and apply the recovery rules, as a start of the job
        does before its queries start; the checkpoints committed."""
        coord = self.coordinator
        coord.claim_sinks()
        coord.recover()
        coord.check_sinks_behind_ledger()
        return list(coord.checkpoints_taken)

    def assess(self, checkpoint_id: int) -> Assessment:
        """Ask each sink about the transactions of the decided checkpoint
        ``checkpoint_id`` (those not abandoned yet) without committing any."""
        decided = self.ledger.decided()
        if decided is None or decided.id != checkpoint_id:
            now = f"checkpoint {decided.id} is" if decided else "no checkpoint is"
            raise AbandonRefusedError(
                f"checkpoint {checkpoint_id} is not the decided one ({now} being committed): "
                "only a transaction of the checkpoint being committed can be abandoned"
            )
        found = Assessment(decided)
        for (p, sid), cs in self.coordinator.committables_of(decided).items():
            if not cs:
                continue
            sink = self.sinks[p][sid]
            label = sink_label(p, sid)
            verdicts = sink.committer().classify(cs)
            for c in cs:
                state = verdicts[c["txn"]]
                counts = found.states.setdefault(label, {})
                counts[state] = counts.get(state, 0) + 1
                rows = found.rows.setdefault(label, {})
                rows[state] = rows.get(state, 0) + int(c.get("rows", 0))
                if state == Outcome.LOST:
                    found.lost.append(LostTxn(label, sink.describe(), c))
        return found

    def give_up_owed(self, pipeline: str, batch_id: int, note: str = "") -> str:
        """Give up batch ``batch_id`` of ``pipeline``, owed to sinks that lost
        their work of it (recovery rule 5) and whose source no longer has it:
        work recorded as paying it is aborted, the debt leaves the ledger, and
        an abandonment records what is missing. Returns the record's note."""
        owing = self.ledger.owed().get(pipeline, {}).get(batch_id)
        if not owing:
            owed = {p: sorted(bs) for p, bs in self.ledger.owed().items()}
            raise AbandonRefusedError(
                f"batch {batch_id} of pipeline {pipeline!r} is not owed (owed: {owed or 'none'})"
            )
        for sid, work in self.ledger.owed_work(pipeline, batch_id).items():
            self.sinks[pipeline][sid].committer().abort(work)
        text = (
            f"{_operator()} with twophase abandon --owed: batch {batch_id} of "
            f"{pipeline} given up, {sum(owing.values())} row(s) not written ("
            + ", ".join(f"{pipeline}/{sid}: {n}" for sid, n in sorted(owing.items()))
            + ")"
            + (f"; {note}" if note else "")
        )
        last = self.ledger.history()
        self.ledger.record_abandoned(last[-1].id if last else 0, [], text)
        self.ledger.record_repaid(pipeline, batch_id, dict.fromkeys(owing, 0))
        return text

    def abandon(self, found: Assessment, note: str = "") -> str:
        """Record that the lost transactions of ``found`` are given up (kept in
        the ledger's history); the note recorded."""
        if not found.lost:
            raise AbandonRefusedError(
                f"nothing in checkpoint {found.checkpoint.id} is lost: there is nothing to "
                "abandon (`twophase recover` commits it)"
            )
        per_sink: dict[str, int] = {}
        for t in found.lost:
            per_sink[t.label] = per_sink.get(t.label, 0) + t.rows
        text = (
            f"{_operator()} with twophase abandon: "
            f"{len(found.lost)} lost transaction(s), "
            f"{sum(per_sink.values())} row(s) not written ("
            + ", ".join(f"{k}: {v}" for k, v in sorted(per_sink.items()))
            + ")"
            + (f"; {note}" if note else "")
        )
        self.ledger.record_abandoned(found.checkpoint.id, [t.txn for t in found.lost], text)
        return text


def _operator() -> str:
    """``user@host`` of whoever runs the command, for the ledger's records."""
    try:
        who = getpass.getuser()
    except Exception:  # no login name in this environment
        who = "?"
    return f"{who}@{socket.gethostname()}"
