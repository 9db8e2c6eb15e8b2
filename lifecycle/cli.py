"""The ``twophase`` console command.

    twophase status STATE_DIR [--json]               what a job's ledger holds
    twophase stop [--drain] [--timeout S] STATE_DIR  stop a running job, wait for it
    twophase start-over STATE_DIR --from ID          the next run takes the sinks over
                                                     from incarnation ID (state lost)
    twophase version

Each command takes ``--ledger DIR`` too: the job's ``ledger=``, needed when
STATE_DIR is a URI (``viewfs://``, ``hdfs://``, ``s3a://``, ...). The control
files of such a STATE_DIR are written through Hadoop's FileSystem in a JVM
that the command starts only then (PySpark's gateway, no SparkContext), with
the Hadoop configuration a job's session gets (``HADOOP_CONF_DIR``, the
``spark.hadoop.*`` settings of ``spark-defaults.conf`` or
``PYSPARK_SUBMIT_ARGS``); a plain path needs no JVM.

``twophase stop`` exits 0 when the job stopped with its final (``--drain``) or
savepoint checkpoint committed and nothing left undecided, 1 when it did not,
2 when no job is running on STATE_DIR or it did not stop within the timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from lifecycle import control
from lifecycle.ledger import is_locked, read_ledger
from lifecycle.state.store import open_store, scheme_of
from sinks.errors import ConfigError
from sinks.naming import check_incarnation


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def format_status(doc: dict[str, Any]) -> str:
    """A readable view of a ledger document."""
    inc = doc.get("incarnation") or "-"
    out = [
        f"job {doc['job']}  incarnation {inc}  (run {doc['run']}, next checkpoint "
        f"{doc['next_checkpoint']})"
    ]
    finished = doc.get("finished") or []
    out.append(f"finished pipelines: {', '.join(finished) if finished else '-'}")
    decided = doc.get("decided")
    if decided:
        out.append(
            f"COMMIT IN PROGRESS: checkpoint {decided['id']} ({decided['kind']}) decided "
            f"{_when(decided['decided_at'])}, cut {decided['cut']}; the next start finishes it"
        )
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
    out.append(f"checkpoints (last {len(history)}):")
    for cp in history[-10:]:
        rows = sum(cp.get("rows", {}).values())
        fin = f" finished {cp['finished']}" if cp.get("finished") else ""
        out.append(
            f"  #{cp['id']:<5} {cp['kind']:<9} {_when(cp['committed_at'])}  "
            f"cut {cp['cut']}{fin}  {rows} row(s)"
        )
    totals = doc.get("totals") or {}
    out.append("rows committed per sink:")
    out.extend(f"  {k}: {v}" for k, v in sorted(totals.items()))
    if not totals:
        out.append("  none")
    return "\n".join(out)


def ledger_root(state_dir: str, ledger: str | None) -> str:
    """The directory whose ``ledger/`` holds the job's ledger: ``--ledger`` when
    given, else a local ``state_dir``."""
    if ledger is not None:
        return ledger
    if scheme_of(state_dir) is not None:
        raise ConfigError(
            f"state_dir {state_dir} is a URI, which holds no ledger: pass --ledger DIR "
            "(the job's ledger=)"
        )
    return state_dir


def stop(state_dir: str, *, drain: bool, timeout: float, ledger: str | None = None) -> int:
    """Ask the job on ``state_dir`` to stop, wait for it to exit, report the outcome."""
    root = ledger_root(state_dir, ledger)
    if not is_locked(root):
        print(f"twophase: no job is running with state_dir {state_dir}", file=sys.stderr)
        return 2
    req = control.write_request(
        open_store(state_dir, None), drain=drain, source=f"twophase stop (pid {os.getpid()})"
    )
    what = "drain" if drain else "stop (savepoint)"
    print(f"asked the job to {what}; waiting for it to exit ...", flush=True)
    deadline = time.monotonic() + timeout
    while is_locked(root):
        if time.monotonic() > deadline:
            print(f"twophase: the job did not exit within {timeout:.0f}s", file=sys.stderr)
            return 2
        time.sleep(0.2)
    doc = read_ledger(root) or {}
    kind = "final" if drain else "savepoint"
    last = (doc.get("history") or [None])[-1]
    ok = (
        last is not None
        and last["kind"] in (kind, "final")
        and (last.get("committed_at") or 0) >= req.requested_at
        and not doc.get("pending")
        and doc.get("decided") is None
    )
    if ok:
        print(f"the job exited; {last['kind']} checkpoint {last['id']} committed")
        return 0
    print(
        "twophase: the job exited without committing its "
        f"{kind} checkpoint; see the job's log and `twophase status {state_dir}"
        f"{f' --ledger {ledger}' if ledger else ''}`",
        file=sys.stderr,
    )
    return 1


def start_over(state_dir: str, incarnation: str, ledger: str | None = None) -> int:
    """Record the operator's choice to start over from ``incarnation``."""
    try:
        check_incarnation(incarnation)
    except ConfigError as e:
        print(f"twophase: {e}", file=sys.stderr)
        return 2
    doc = read_ledger(ledger_root(state_dir, ledger))
    if doc is not None and doc.get("incarnation") == incarnation:
        print(
            f"twophase: {incarnation} is the incarnation of {state_dir} itself; starting "
            "over from it needs a new state_dir",
            file=sys.stderr,
        )
        return 2
    control.request_start_over(
        open_store(state_dir, None), incarnation, source=f"twophase (pid {os.getpid()})"
    )
    print(
        f"the next run with state_dir {state_dir} takes every sink over from incarnation "
        f"{incarnation}: it aborts what that incarnation left prepared, keeps what it "
        "committed, and records the choice in each sink"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="twophase", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="show a job's checkpoints and pending transactions")
    st.add_argument("state_dir")
    st.add_argument("--json", action="store_true", help="print the raw ledger document")
    sp = sub.add_parser("stop", help="stop a running job (a savepoint, or --drain)")
    sp.add_argument("state_dir")
    sp.add_argument(
        "--drain",
        action="store_true",
        help="end every pipeline's input and commit one final checkpoint",
    )
    sp.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (600)")
    so = sub.add_parser(
        "start-over",
        help="let the next run on STATE_DIR take the sinks over from a lost incarnation",
    )
    so.add_argument("state_dir")
    so.add_argument(
        "--from",
        dest="incarnation",
        required=True,
        help="the incarnation id the job's refusal named",
    )
    for p in (st, sp, so):
        p.add_argument(
            "--ledger",
            default=None,
            metavar="DIR",
            help="the job's ledger= (needed when STATE_DIR is a URI)",
        )
    sub.add_parser("version", help="print the version")
    args = ap.parse_args(argv)
    if args.cmd == "version":
        try:
            print(version("twophase"))
        except PackageNotFoundError:
            print("unknown (not installed)")
        return 0
    try:
        return _command(args)
    except ConfigError as e:
        print(f"twophase: {e}", file=sys.stderr)
        return 2


def _command(args: argparse.Namespace) -> int:
    if args.cmd == "stop":
        return stop(args.state_dir, drain=args.drain, timeout=args.timeout, ledger=args.ledger)
    if args.cmd == "start-over":
        return start_over(args.state_dir, args.incarnation, ledger=args.ledger)
    root = ledger_root(args.state_dir, args.ledger)
    doc = read_ledger(root)
    if doc is None:
        print(f"twophase: no ledger in {root}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2, sort_keys=True) if args.json else format_status(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
