"""``twophase status``: what a job is doing now, from its ledger and its heartbeat.

:func:`job_status` builds a document (the ``--json`` output, schema
:data:`SCHEMA`); :func:`format_text` renders it for people. The document::

    ``schema``            ``"twophase.status/1"``; a new major number marks a breaking change
    ``job``, ``incarnation``, ``run``   the ledger's identity
    ``state``             ``running`` (also ``recovering``, ``draining``, ``stopping``
                          while alive), ``finished``, ``stopped``, ``failed``, ``lost``
                          (the driver died: its pid is gone, or the heartbeat lapsed:
                          killed, or its host is down; the text names it ``DIED``)
                          or ``unknown`` (no heartbeat: never run by this version)
    ``alive``, ``why``    whether the job runs now, and what says so
    ``heartbeat``         the heartbeat (pid, host, started_at, renewed_at, ended_at, error) or null
    ``health``, ``exit_code``   the verdict (below)
    ``pipelines``         per pipeline: ``finished``, ``last_committed_batch``,
                          ``rows_committed`` (sink -> rows), ``pending_batches``,
                          ``pending_committables``, ``pending_rows``,
                          ``oldest_pending_age_s`` (null when nothing is pending),
                          ``owed`` (batch -> sink -> rows: work lost in a target before
                          it committed, written again from the source at the next start;
                          see lifecycle.replay)
    ``decided``           a checkpoint decided but not yet committed: id, kind, age_s; or null
    ``last_checkpoint``   id, kind, committed_at, age_s of the newest committed one; or null
    ``stuck_after_s``     the threshold the verdict used

Verdicts and exit codes: 0 ``healthy`` (running, or ended with nothing
pending), 1 ``stuck`` (running, but pending work or a decided checkpoint is
older than ``stuck_after``), 2 ``not_found`` (no ledger), 3 ``pending`` (not
running, and pre-committed work, a decided checkpoint or an owed batch waits
for the next start, whether the run ended or died), 4 ``failed`` (the last run
ended with an error, or its driver died without a word and left nothing
pending: ``lost``). So a dead job exits 3 when work waits for its next start,
else 4. A held ledger lock counts as running when there is no heartbeat, or
when it lapsed.

The document's words are stable within ``twophase.status/1``; the text view
names the state ``lost`` for what it means to an operator, ``DIED``
(:func:`shown_state`), and says what its exit code means (:func:`summary`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from lifecycle import heartbeat
from lifecycle._table import aligned, local_time

SCHEMA = "twophase.status/1"
HEALTHY, STUCK, NOT_FOUND, PENDING, FAILED = 0, 1, 2, 3, 4
VERDICTS = {
    HEALTHY: "healthy",
    STUCK: "stuck",
    NOT_FOUND: "not_found",
    PENDING: "pending",
    FAILED: "failed",
}
SHOWN_STATES = {"lost": "died"}
"""how the text names a state of the document (the others as they are)"""
DEFAULT_STUCK_AFTER_S = 300.0
"""the default ``--stuck-after``: at least this, and at least 10 checkpoint intervals"""


def stuck_after_default(beat: Mapping[str, Any] | None) -> float:
    interval = float((beat or {}).get("checkpoint_interval") or 0)
    return max(DEFAULT_STUCK_AFTER_S, 10 * interval)


def job_status(
    doc: Mapping[str, Any],
    beat: Mapping[str, Any] | None,
    *,
    locked: bool = False,
    stuck_after: float | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The status document (module docstring) of ledger document ``doc`` and
    heartbeat ``beat`` (None: none found); ``locked``: a process holds the
    ledger's lock (taken as running when there is no heartbeat)."""
    now = time.time() if now is None else now
    stuck_after = stuck_after_default(beat) if stuck_after is None else stuck_after
    if beat is not None and beat.get("incarnation") not in (None, doc.get("incarnation")):
        beat = None  # the heartbeat of another state's job (a state_dir started over)
    live = heartbeat.judge(dict(beat) if beat is not None else None, now)
    if locked and (beat is None or live.state == "lost"):
        why = "a process holds the ledger's lock" + (
            f" (the heartbeat says: {live.why})" if beat is not None else ""
        )
        live = heartbeat.Liveness("running", True, why)
    pipelines = _pipelines(doc, now)
    decided = doc.get("decided")
    history = doc.get("history") or []
    last = history[-1] if history else None
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "job": doc.get("job"),
        "incarnation": doc.get("incarnation"),
        "run": doc.get("run"),
        "state": live.state,
        "alive": live.alive,
        "why": live.why,
        "heartbeat": _beat(beat),
        "pipelines": pipelines,
        "decided": {
            "id": decided["id"],
            "kind": decided["kind"],
            "age_s": _age(now, decided.get("decided_at")),
        }
        if decided
        else None,
        "last_checkpoint": {
            "id": last["id"],
            "kind": last["kind"],
            "committed_at": last.get("committed_at"),
            "age_s": _age(now, last.get("committed_at")),
        }
        if last
        else None,
        "stuck_after_s": stuck_after,
    }
    code = _verdict(out, stuck_after)
    out["health"] = VERDICTS[code]
    out["exit_code"] = code
    return out


def shown_state(state: str) -> str:
    """The word people read for a document's ``state``: ``lost`` is ``died``
    (the driver is gone without a word: killed, or its host is down)."""
    return SHOWN_STATES.get(state, state)


def meaning(status: Mapping[str, Any]) -> str:
    """What the exit code of ``status`` means, in a few words."""
    code = status["exit_code"]
    if code == PENDING:
        return "not running, and work waits for the next start"
    if code == FAILED and status["state"] == "lost":
        return "it died, and nothing waits for the next start: start it again"
    if code == FAILED:
        return "the last run ended with an error"
    if code == STUCK:
        return "running, but pending work is older than the threshold"
    if code == NOT_FOUND:
        return "no ledger"
    return "running" if status.get("alive") else "nothing waits"


def summary(status: Mapping[str, Any]) -> str:
    """One line of ``status``: the state as people read it, the verdict, the
    exit code and what it means (``DIED, failed (exit 4: ...)``)."""
    return (
        f"{shown_state(status['state']).upper()}, {status['health']} "
        f"(exit {status['exit_code']}: {meaning(status)})"
    )


def not_found(where: str) -> dict[str, Any]:
    """The status document when there is no ledger at ``where``."""
    return {
        "schema": SCHEMA,
        "job": None,
        "state": "unknown",
        "alive": False,
        "why": f"no ledger in {where}",
        "health": VERDICTS[NOT_FOUND],
        "exit_code": NOT_FOUND,
    }


def _verdict(status: Mapping[str, Any], stuck_after: float) -> int:
    if status["state"] == "failed":
        return FAILED
    waiting = [
        p["oldest_pending_age_s"]
        for p in status["pipelines"].values()
        if p["pending_batches"] and p["oldest_pending_age_s"] is not None
    ]
    decided = status["decided"]
    if decided is not None and decided["age_s"] is not None:
        waiting.append(decided["age_s"])
    if status["alive"]:
        return STUCK if any(age > stuck_after for age in waiting) else HEALTHY
    pending = decided is not None or any(
        p["pending_batches"] or p["owed"] for p in status["pipelines"].values()
    )
    if pending:
        return PENDING
    return FAILED if status["state"] == "lost" else HEALTHY


def _pipelines(doc: Mapping[str, Any], now: float) -> dict[str, dict[str, Any]]:
    names = set(doc.get("finished") or ()) | set(doc.get("committed_cut") or ())
    names |= set(doc.get("pending") or ())
    owed = doc.get("owed") or {}
    names |= set(owed)
    totals: dict[str, dict[str, int]] = {}
    for label, rows in (doc.get("totals") or {}).items():
        p, _, sid = label.partition("/")
        totals.setdefault(p, {})[sid] = int(rows)
        names.add(p)
    finished = set(doc.get("finished") or ())
    cuts = doc.get("committed_cut") or {}
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(names):
        batches = (doc.get("pending") or {}).get(p) or {}
        txns = rows = 0
        oldest: float | None = None
        for sinks in batches.values():
            for cs in sinks.values():
                txns += len(cs)
                for c in cs:
                    rows += int(c.get("rows", 0))
                    at = c.get("registered_at")
                    if at is not None and (oldest is None or at < oldest):
                        oldest = float(at)
        out[p] = {
            "finished": p in finished,
            "last_committed_batch": cuts.get(p),
            "rows_committed": totals.get(p, {}),
            "pending_batches": len(batches),
            "pending_committables": txns,
            "pending_rows": rows,
            "oldest_pending_age_s": _age(now, oldest),
            "owed": {
                str(b): {sid: int(debt["rows"]) for sid, debt in sinks.items()}
                for b, sinks in (owed.get(p) or {}).items()
            },
        }
    return out


def _beat(beat: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if beat is None:
        return None
    keys = ("pid", "host", "state", "started_at", "renewed_at", "ended_at", "error", "every_s")
    return {k: beat.get(k) for k in keys if k in beat}


def _age(now: float, at: Any) -> float | None:
    return round(max(0.0, now - float(at)), 1) if at else None


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def format_text(status: Mapping[str, Any], doc: Mapping[str, Any] | None = None) -> str:
    """``status`` for people; with the ledger document ``doc``, also its
    checkpoints, pending batches per sink and abandonments."""
    out = [
        f"job {status.get('job')}  incarnation {status.get('incarnation') or '-'}  "
        f"run {status.get('run')}",
        f"state: {shown_state(status['state']).upper()} ({status['why']})",
        f"health: {status['health']} (exit {status['exit_code']}: {meaning(status)})",
    ]
    finished = [p for p, v in status["pipelines"].items() if v["finished"]]
    out.append(f"finished pipelines: {', '.join(finished) if finished else '-'}")
    if status.get("decided"):
        d = status["decided"]
        then = "it is committing" if status["alive"] else "the next start finishes it"
        out.append(
            f"COMMIT IN PROGRESS: checkpoint {d['id']} ({d['kind']}) decided "
            f"{_secs(d['age_s'])} ago; {then}"
        )
    last = status.get("last_checkpoint")
    if last:
        out.append(
            f"last checkpoint: #{last['id']} ({last['kind']}) {local_time(last['committed_at'])}, "
            f"{_secs(last['age_s'])} ago"
        )
    out.append("pipelines:")
    rows = [("pipeline", "state", "last batch", "rows committed", "pending", "oldest")]
    for p, v in status["pipelines"].items():
        rows.append(
            (
                p,
                "finished" if v["finished"] else "-",
                "-" if v["last_committed_batch"] is None else str(v["last_committed_batch"]),
                f"{sum(v['rows_committed'].values()):,}",
                f"{v['pending_batches']} batch(es), {v['pending_rows']:,} rows"
                if v["pending_batches"]
                else "none",
                _secs(v["oldest_pending_age_s"]),
            )
        )
    if len(rows) == 1:
        out.append("  none yet")
    else:
        out.extend(aligned(rows))
    for p, v in status["pipelines"].items():
        for b, sinks in v["owed"].items():
            lost = ", ".join(f"{sid} {n:,} row(s)" for sid, n in sorted(sinks.items()))
            out.append(
                f"OWED: batch {b} of {p} to {lost}: lost in the target before it committed; "
                "the next start writes it again from the source"
            )
    if doc is not None:
        out.append(_ledger_details(doc))
    return "\n".join(out)


def _ledger_details(doc: Mapping[str, Any]) -> str:
    """The ledger's checkpoints, pending work per sink and abandonments."""
    out = []
    pending = doc.get("pending") or {}
    out.append("pending (pre-committed, awaiting a checkpoint):")
    if not pending:
        out.append("  none")
    for p, batches in sorted(pending.items()):
        per_sink: dict[str, list[int]] = {}
        for _b, sinks in batches.items():
            for sid, cs in sinks.items():
                acc = per_sink.setdefault(sid, [0, 0])
                acc[0] += len(cs)
                acc[1] += sum(int(c.get("rows", 0)) for c in cs)
        ids = sorted(int(b) for b in batches)
        out.append(f"  {p}: batches {ids[0]}..{ids[-1]} ({len(ids)})")
        for sid, (txns, rows) in sorted(per_sink.items()):
            out.append(f"    {sid}: {txns} transaction(s), {rows} row(s)")
    history = doc.get("history") or []
    out.append(f"checkpoints (last {min(10, len(history))} of {len(history)} kept):")
    for cp in history[-10:]:
        rows = sum(cp.get("rows", {}).values())
        fin = f" finished {cp['finished']}" if cp.get("finished") else ""
        out.append(
            f"  #{cp['id']:<5} {cp['kind']:<9} {local_time(cp['committed_at'])}  "
            f"cut {cp['cut']}{fin}  {rows} row(s)"
        )
    totals = doc.get("totals") or {}
    out.append("rows committed per sink:")
    out.extend(f"  {k}: {v}" for k, v in sorted(totals.items()))
    if not totals:
        out.append("  none")
    abandoned = doc.get("abandoned") or []
    if abandoned:
        out.append("abandoned (an operator gave these transactions up):")
        for a in abandoned:
            out.append(
                f"  checkpoint {a['checkpoint']}  {local_time(a['at'])}  {len(a['txns'])} "
                f"transaction(s): {a['note']}"
            )
            out.extend(f"    {t}" for t in a["txns"])
    return "\n".join(out)
