"""The ``twophase`` command line's grammar: its subcommands, their arguments,
defaults and help texts (``argparse``). What each command prints and its exit
codes are in :mod:`lifecycle.cli`, which parses with :func:`build_parser`."""

from __future__ import annotations

import argparse

from lifecycle import audit as audit_view
from lifecycle import status as status_view


def build_parser(description: str) -> argparse.ArgumentParser:
    """The parser of ``twophase`` (``description``: what ``--help`` says first)."""
    ap = argparse.ArgumentParser(prog="twophase", description=description)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ledger_help = (
        "the job's ledger=: its PostgreSQL ledger (postgresql://user@host/db[?schema=S&job=J]) "
        "when STATE_DIR does not record it, the password from PGPASSWORD or ~/.pgpass; or the "
        "local directory of its file ledger (needed when it is not STATE_DIR/ledger, as for a "
        "URI STATE_DIR)"
    )
    st = sub.add_parser("status", help="show a job's checkpoints and pending transactions")
    st.add_argument("state_dir", nargs="?")
    st.add_argument("--ledger", metavar="URI|DIR", help=ledger_help)
    st.add_argument(
        "--json",
        action="store_true",
        help=f"print the status as JSON (schema {status_view.SCHEMA}, see lifecycle.status)",
    )
    st.add_argument("--raw", action="store_true", help="print the ledger document itself (JSON)")
    st.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=float,
        metavar="S",
        help="refresh every S seconds (2) until interrupted",
    )
    st.add_argument(
        "--stuck-after",
        type=float,
        metavar="S",
        help="pending work older than S seconds makes a running job stuck (exit 1); "
        f"default max({status_view.DEFAULT_STUCK_AFTER_S:.0f}, 10 checkpoint intervals)",
    )
    sp = sub.add_parser("stop", help="stop a running job (a savepoint, or --drain)")
    sp.add_argument("state_dir")
    sp.add_argument(
        "--drain",
        action="store_true",
        help="end every pipeline's input and commit one final checkpoint",
    )
    sp.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (600)")
    sp.add_argument("--ledger", metavar="URI|DIR", help=ledger_help)
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
    so.add_argument("--ledger", metavar="URI|DIR", help=ledger_help)
    li = sub.add_parser(
        "lingering",
        help="list the prepared transactions, open Kafka transactions and staged Delta "
        "files the job's sinks hold, with the ledger's view of each",
    )
    li.add_argument("state_dir", nargs="?")
    li.add_argument("--ledger", metavar="URI|DIR", help=ledger_help)
    rc = sub.add_parser(
        "recover", help="apply the recovery rules to a stopped job without running it"
    )
    rc.add_argument("state_dir")
    rc.add_argument("--ledger", metavar="URI|DIR", help=ledger_help)
    ab = sub.add_parser(
        "abandon",
        help="give up the lost transactions of the decided checkpoint so the rest commits, "
        "or a batch owed to sinks whose source no longer has it",
    )
    ab.add_argument("state_dir")
    which = ab.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", type=int, help="the decided checkpoint's id")
    which.add_argument(
        "--owed", metavar="PIPELINE/BATCH", help="a batch owed to sinks (twophase status: OWED)"
    )
    ab.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    ab.add_argument("--note", default="", help="why, kept in the ledger with the record")
    ab.add_argument("--ledger", metavar="URI|DIR", help=ledger_help)
    au = sub.add_parser(
        "audit",
        help="check each sink's own records of the last checkpoints against the ledger",
    )
    au.add_argument("state_dir", nargs="?")
    au.add_argument(
        "--last",
        type=int,
        default=audit_view.DEFAULT_LAST,
        metavar="N",
        help=f"the N newest checkpoints ({audit_view.DEFAULT_LAST})",
    )
    au.add_argument(
        "--all", action="store_true", help="every checkpoint whose evidence the ledger keeps"
    )
    au.add_argument("--json", action="store_true", help="print the report as JSON")
    au.add_argument("--ledger", metavar="URI|DIR", help=ledger_help)
    sub.add_parser("version", help="print the version")
    return ap
