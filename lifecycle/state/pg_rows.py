"""The PostgreSQL ledger's rows: a whole ledger read as a document, and each
operation of :mod:`lifecycle.state.model` written as the rows it touches.

:func:`load_doc` gives the document :meth:`LedgerState.to_doc` would (format
3), so the state in memory is built by :meth:`LedgerState.from_doc`, as the
file ledger builds it from a snapshot. :func:`write_op` runs inside the write
transaction, after the operation was applied to the state in memory: it writes
the rows the operation changes, and for the trims (history beyond its length,
digests beyond their window) it deletes what the state in memory no longer
holds, below its oldest kept entry. Each statement touches the rows of the
change, never the whole ledger.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from lifecycle.state.model import LedgerState, Op
from lifecycle.state.pg_schema import Statements


def load_doc(conn: psycopg.Connection, st: Statements, job: str) -> dict[str, Any] | None:
    """The ledger of ``job`` as a document (its format recorded), or None when it has none. The
    caller makes the reads consistent (a transaction holding the job's row, or
    one snapshot)."""
    row = conn.execute(st.load_ledger, (job,)).fetchone()
    if row is None:
        return None
    fmt, incarnation, run, next_checkpoint, history_limit, digest_window = row
    pending: dict[str, dict[str, Any]] = {}
    pending_digests: dict[str, dict[str, str]] = {}
    for p, b, committables, digest in conn.execute(st.load_pending, (job,)):
        pending.setdefault(p, {})[str(b)] = committables
        if digest is not None:
            pending_digests.setdefault(p, {})[str(b)] = digest
    decided = None
    history = []
    for cid, kind, cut, finished, decided_at, committed_at, rows, evidence in conn.execute(
        st.load_checkpoints, (job,)
    ):
        cp = {
            "id": cid,
            "kind": kind,
            "cut": cut,
            "finished": finished,
            "decided_at": decided_at,
            "committed_at": committed_at,
            "rows": rows,
        }
        if committed_at is not None:
            cp["evidence"] = evidence or {}
        if committed_at is None:
            decided = cp
        else:
            history.append(cp)
    spark: dict[str, int] = {}
    cuts: dict[str, int] = {}
    for p, completed, cut in conn.execute(st.load_pipelines, (job,)):
        if completed is not None:
            spark[p] = completed
        if cut is not None:
            cuts[p] = cut
    owed: dict[str, dict[str, dict[str, Any]]] = {}
    table = sql.Identifier(st.schema, "owed").as_string(conn)
    if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone() != (None,):
        # (a schema no format-3 ledger has opened yet has no such table)
        for p, b, sinks in conn.execute(st.load_owed, (job,)):
            owed.setdefault(p, {})[str(b)] = sinks
    digests: dict[str, dict[str, str]] = {}
    for p, b, digest in conn.execute(st.load_digests, (job,)):
        digests.setdefault(p, {})[str(b)] = digest
    return {
        "format": fmt,
        "job": job,
        "incarnation": incarnation,
        "run": run,
        "next_checkpoint": next_checkpoint,
        "pending": pending,
        "pending_digests": pending_digests,
        "decided": decided,
        "history": history,
        "finished": sorted(p for (p,) in conn.execute(st.load_finished, (job,))),
        "totals": dict(conn.execute(st.load_totals, (job,)).fetchall()),
        "spark_completed": spark,
        "committed_cut": cuts,
        "committed_digests": digests,
        "abandoned": [
            {"checkpoint": c, "txns": txns, "note": note, "at": at}
            for c, txns, note, at in conn.execute(st.load_abandoned, (job,))
        ],
        "sinks": dict(conn.execute(st.load_sinks, (job,)).fetchall()),
        "owed": owed,
        "limits": {"history": history_limit, "digests": digest_window},
    }


def write_op(
    conn: psycopg.Connection, st: Statements, job: str, op: Op, state: LedgerState
) -> None:
    """Write the rows operation ``op`` changes; ``state`` has ``op`` applied."""
    kind = op["op"]
    if kind == "run":
        conn.execute(st.set_run, (state.run, job))
    elif kind == "batch":
        conn.execute(st.put_batch, (job, op["p"], op["b"], Jsonb(op["c"]), op["d"]))
    elif kind == "drop":
        conn.execute(st.drop_batches, (job, op["p"], list(op["bs"])))
    elif kind == "decide":
        cp = op["cp"]
        row = (job, cp["id"], cp["kind"], Jsonb(cp["cut"]), Jsonb(cp["finished"]))
        conn.execute(st.decide, (*row, cp["decided_at"]))
        conn.execute(st.set_next_checkpoint, (state.next_checkpoint, job))
    elif kind == "complete":
        _complete(conn, st, job, op, state)
    elif kind == "spark":
        conn.execute(st.raise_spark, (job, op["p"], op["b"]))
    elif kind == "abandon":
        row = (job, op["checkpoint"], Jsonb(op["txns"]), op["note"], op["at"])
        conn.execute(st.abandon, row)
    elif kind == "sinks":
        conn.execute(st.clear_sinks, (job,))
        if op["s"]:
            conn.execute(st.put_sinks, (job, Jsonb(op["s"])))
    elif kind in ("owe", "repaying", "repaid"):
        touched = [int(b) for b in op["s"]] if kind == "owe" else [int(op["b"])]
        for b in touched:
            now = state.owed.get(op["p"], {}).get(b)
            if now:
                conn.execute(st.put_owed, (job, op["p"], b, Jsonb(now)))
            else:
                conn.execute(st.drop_owed, (job, op["p"], b))
        if kind == "repaid":
            labels = [f"{op['p']}/{sid}" for sid in op["s"]]
            conn.execute(st.add_totals, (job, labels, [int(n) for n in op["s"].values()]))
    elif kind == "limits":
        conn.execute(st.set_limits, (op["history"], op["digests"], job))
        _trim_history(conn, st, job, state)
        for p in state.committed_digests:
            _trim_digests(conn, st, job, p, state)
    else:
        raise ValueError(f"unknown ledger operation {kind!r}")


def _complete(
    conn: psycopg.Connection, st: Statements, job: str, op: Op, state: LedgerState
) -> None:
    kept = (Jsonb(op.get("evidence") or {}),) if st.evidence else ()
    found = conn.execute(st.commit_checkpoint, (op["at"], Jsonb(op["rows"]), *kept, job, op["id"]))
    row = found.fetchone()
    if row is None:
        raise RuntimeError(f"checkpoint {op['id']} of job {job!r} is not decided in the database")
    cut, finished = row
    for p, last in cut.items():
        conn.execute(st.commit_batches, {"job": job, "p": p, "last": last})
        _trim_digests(conn, st, job, p, state)
        conn.execute(st.raise_cut, (job, p, last))
    _trim_history(conn, st, job, state)
    if finished:
        conn.execute(st.add_finished, (job, finished))
    rows: dict[str, int] = op["rows"]
    if rows:
        conn.execute(st.add_totals, (job, list(rows), list(rows.values())))


def _trim_history(conn: psycopg.Connection, st: Statements, job: str, state: LedgerState) -> None:
    if state.history:
        conn.execute(st.trim_history_before, (job, state.history[0]["id"]))
    else:
        conn.execute(st.trim_history_all, (job,))


def _trim_digests(
    conn: psycopg.Connection, st: Statements, job: str, p: str, state: LedgerState
) -> None:
    kept = state.committed_digests.get(p)
    if kept is None:
        return  # none was ever remembered for p
    if kept:
        oldest = next(iter(kept))
        conn.execute(st.trim_digests_before, {"job": job, "p": p, "oldest": oldest})
    else:
        conn.execute(st.trim_digests_all, (job, p))
