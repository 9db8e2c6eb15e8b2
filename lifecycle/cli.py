"""The ``twophase`` console command.

twophase status STATE_DIR [--json]   what a job's ledger holds
twophase version
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from lifecycle.ledger import read_ledger


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def format_status(doc: dict[str, Any]) -> str:
    """A readable view of a ledger document."""
    out = [f"job {doc['job']}  (run {doc['run']}, next checkpoint {doc['next_checkpoint']})"]
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="twophase", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="show a job's checkpoints and pending transactions")
    st.add_argument("state_dir")
    st.add_argument("--json", action="store_true", help="print the raw ledger document")
    sub.add_parser("version", help="print the version")
    args = ap.parse_args(argv)
    if args.cmd == "version":
        try:
            print(version("twophase"))
        except PackageNotFoundError:
            print("unknown (not installed)")
        return 0
    doc = read_ledger(args.state_dir)
    if doc is None:
        print(f"twophase: no ledger in {args.state_dir}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2, sort_keys=True) if args.json else format_status(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
