"""The ``twophase`` console command::

    twophase status STATE_DIR [--json] [--watch [S]] [--stuck-after S]
                                                     whether the job runs, and what
                                                     its ledger holds
    twophase stop [--drain] [--timeout S] STATE_DIR  stop a running job, wait for it
    twophase start-over STATE_DIR --from ID          the next run takes the sinks over
                                                     from incarnation ID (state lost)
    twophase lingering STATE_DIR                     unfinished work the sinks hold
    twophase audit STATE_DIR [--last N | --all] [--json]
                                                     check the sinks' own records of
                                                     the last checkpoints (evidence)
    twophase recover STATE_DIR                       the recovery rules, without the job
    twophase abandon STATE_DIR --checkpoint N [--yes]
    twophase abandon STATE_DIR --owed PIPELINE/BATCH [--yes]
                                                     give up the lost transactions of
                                                     the decided checkpoint N
    twophase version

Every command but ``version`` takes ``--ledger``, the job's ``ledger=``:

* a job whose ledger is in PostgreSQL (``Job(ledger=URI)``) recorded the URI,
  without its password, in ``STATE_DIR/ledger.location``: the commands find it
  there, with the password from libpq's environment (``PGPASSWORD``,
  ``~/.pgpass``). ``--ledger URI`` names it instead (``status`` and
  ``lingering`` then need no STATE_DIR; ``?job=NAME`` picks the job when the
  schema holds several);
* a job whose file ledger is in a local directory of its own
  (``Job(ledger=DIR)``) needs ``--ledger DIR`` (``status`` and ``lingering``
  then need no STATE_DIR either); without ``--ledger`` the ledger of a local
  STATE_DIR is ``STATE_DIR/ledger``.

STATE_DIR may be a URI (``viewfs://``, ``hdfs://``, ``s3a://``, ...): its
control files and ``ledger.location`` are read and written through Hadoop's
FileSystem in a JVM that the command starts only then, and only when it needs
them (PySpark's gateway, no SparkContext), with the Hadoop configuration a
job's session gets (``HADOOP_CONF_DIR``, the ``spark.hadoop.*`` settings of
``spark-defaults.conf`` or ``PYSPARK_SUBMIT_ARGS``); a plain path needs no JVM.
A URI STATE_DIR holds no file ledger: without a ``ledger.location`` the
commands need ``--ledger``.

``twophase status`` exits 0 when the job is healthy (running, or ended with
nothing pending), 1 when it runs but is stuck (pending work or a decided
checkpoint older than ``--stuck-after``), 2 when there is no ledger (or its
heartbeat was written by a newer twophase), 3 when it is not running (ended,
or died) and pending work waits for its next start, 4 when its last run failed
or died leaving nothing pending (see :mod:`lifecycle.status`; the text says
``DIED`` for a driver gone without a word, ``--json`` prints the document,
where that is ``lost``, and ``--raw`` the ledger's own).

``twophase stop`` exits 0 when the job stopped with its final (``--drain``) or
savepoint checkpoint committed and nothing left undecided, 1 when it did not,
2 when no job is running on STATE_DIR or it did not stop within the timeout.

``lingering``, ``recover`` and ``abandon`` rebuild the sinks from the settings
the ledger records; secrets come from the environment (:mod:`sinks.settings`).
They exit 0 on success (``lingering``: nothing lingers), 1 when the work is
not done (``lingering``: something lingers; ``recover``: recovery failed;
``abandon``: refused or not confirmed) and 2 when they cannot start (no
ledger, a job holds it, a sink cannot be rebuilt or reached).
What they do is in :mod:`lifecycle.operations`, what ``status``, ``stop`` and
``start-over`` do in :mod:`lifecycle.remote`, the grammar of every command in
:mod:`lifecycle.cli_args`: this module parses and prints.

``twophase audit`` (see :mod:`lifecycle.audit`) exits 0 when every checked
transaction is in its sink as the ledger says (``expired`` ones, which the sink
no longer keeps, do not fail it), 1 on any mismatch (a missing table or topic
included), 2 when it cannot start or cannot read a sink.

Longer than 450 lines because this docstring is the commands' reference (their
usage, where they find the ledger, their exit codes) beside what each prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NoReturn

from lifecycle import audit as audit_view
from lifecycle import operations, remote
from lifecycle import status as status_view
from lifecycle._exit import leave
from lifecycle.cli_args import build_parser
from lifecycle.errors import CheckpointCommitError
from lifecycle.ledger import read_ledger
from sinks.errors import ConfigError, TransactionLostError, TwoPhaseError


def format_status(doc: dict[str, Any]) -> str:
    """A readable view of a ledger document (no heartbeat: as a stopped job)."""
    return status_view.format_text(status_view.job_status(doc, None), doc)


def _fail(message: object, code: int) -> int:
    print(f"twophase: {message}", file=sys.stderr)
    return code


def _ledger_arg(ledger: str | None) -> str:
    """`` --ledger URI|DIR`` (a URI without its password) for a command line to suggest."""
    return f" --ledger '{remote.shown_location(ledger)}'" if ledger else ""


def lingering(state_dir: str | None, *, ledger: str | None = None) -> int:
    """List the unfinished work the job's sinks hold, with the ledger's view
    (``ledger``: the job's ``ledger=``, see the module docstring)."""
    if state_dir is None and ledger is None:
        return _fail("lingering needs a STATE_DIR or --ledger URI (or DIR)", 2)
    try:
        doc, found = operations.lingering(state_dir, ledger=ledger)
    except (TwoPhaseError, NotImplementedError) as e:
        return _fail(e, 2)
    except Exception as e:  # a sink that cannot be reached
        return _fail(f"could not list the sinks' work: {e!r}", 2)
    print(f"job {doc['job']}  incarnation {doc['incarnation']} (this state)")
    if not found:
        print("nothing lingering")
        return 0
    label = None
    for f in found:
        if f.label != label:
            label = f.label
            print(f"{f.label}  ({f.target})")
        detail = f" ({f.txn.detail})" if f.txn.detail else ""
        print(f"  {f.txn.txn}  {f.txn.state}{detail}")
        print(f"      ledger: {f.view}")
    ours = sum(1 for f in found if f.ours)
    print(f"{len(found)} lingering: {ours} of this incarnation, {len(found) - ours} of others")
    return 1


def recover(state_dir: str, *, ledger: str | None = None) -> int:
    """Apply the recovery rules to a stopped job, without Spark (``ledger``: the
    job's ``ledger=``, see the module docstring)."""
    moves: list[tuple[str, str, list[str]]] = []

    def observe(what: str, label: str, txns: list[str]) -> None:
        moves.append((what, label, txns))
        shown = ", ".join(txns[:3]) + (f" (+{len(txns) - 3})" if len(txns) > 3 else "")
        print(f"{what:<9} {label}: {len(txns)} transaction(s): {shown}", flush=True)

    try:
        op = operations.Operator(state_dir, observer=observe, ledger=ledger)
    except TwoPhaseError as e:
        return _fail(e, 2)
    with op:
        before = op.ledger.decided()
        print(
            f"recovering job {op.ledger.job} (incarnation {op.ledger.incarnation}) "
            f"from {state_dir}",
            flush=True,
        )
        try:
            checkpoints = op.recover()
        except TwoPhaseError as e:
            print(f"twophase: recovery failed: {e}", file=sys.stderr)
            lost = isinstance(e, TransactionLostError) or (
                isinstance(e, CheckpointCommitError)
                and isinstance(e.__cause__, TransactionLostError)
            )
            decided = op.ledger.decided()
            if lost and decided is not None:
                print(
                    f"twophase: a transaction of checkpoint {decided.id} is lost; to give it "
                    f"up and commit the rest: twophase abandon {state_dir} --checkpoint "
                    f"{decided.id}{_ledger_arg(ledger)}",
                    file=sys.stderr,
                )
            return 1
        for cp in checkpoints:
            finished = " (finished before the stop)" if before and cp.id == before.id else ""
            print(
                f"checkpoint {cp.id} ({cp.kind}) committed{finished}: cut {cp.cut}, "
                f"rows {cp.rows or {}}"
            )
        if not moves and not checkpoints:
            print("nothing to recover")
        left = op.ledger.pending_pipelines()
        print(
            "recovered: nothing pending, no checkpoint decided"
            if not left and op.ledger.decided() is None
            else f"recovered; pending batches of {left} stay for the job's next run"
        )
    return 0


def _confirm(question: str) -> bool:
    try:
        answer = input(question)
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def audit(
    state_dir: str | None, *, last: int | None, as_json: bool, ledger: str | None = None
) -> int:
    """Check the ledger's evidence of the last checkpoints against the sinks."""
    if state_dir is None and ledger is None:
        return _fail("audit needs a STATE_DIR or --ledger URI (or DIR)", 2)
    try:
        doc, _where = operations.read_state(state_dir, ledger)
        sinks = operations.rebuild_sinks(doc.get("sinks") or {})
    except (TwoPhaseError, NotImplementedError) as e:
        return _fail(e, 2)
    try:
        report = audit_view.audit(doc, sinks, last=last)
    finally:
        operations.close_sinks(sinks)
    if as_json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        print(audit_view.format_report(report))
    if not report.ok:
        return 1
    return 2 if report.unreadable else 0


def abandon(
    state_dir: str, checkpoint: int, *, yes: bool, note: str, ledger: str | None = None
) -> int:
    """Give up the lost transactions of the decided checkpoint, after confirmation
    (``ledger``: the job's ``ledger=``, see the module docstring)."""
    try:
        op = operations.Operator(state_dir, ledger=ledger)
    except TwoPhaseError as e:
        return _fail(e, 2)
    with op:
        try:
            found = op.assess(checkpoint)
        except operations.AbandonRefusedError as e:
            return _fail(e, 1)
        except (TwoPhaseError, NotImplementedError) as e:
            return _fail(f"could not check the transactions of checkpoint {checkpoint}: {e}", 2)
        cp = found.checkpoint
        if not found.lost:
            return _fail(
                f"nothing in checkpoint {cp.id} is lost: there is nothing to abandon "
                f"(`twophase recover {state_dir}{_ledger_arg(ledger)}` commits it)",
                1,
            )
        print(
            f"checkpoint {cp.id} ({cp.kind}, cut {cp.cut}) cannot commit: "
            f"{len(found.lost)} transaction(s) are lost:"
        )
        for t in found.lost:
            print(f"  {t.label}  {t.txn}  {t.rows} row(s)  ({t.target})")
        print(f"what each sink holds of checkpoint {cp.id} (the rest commits once abandoned):")
        for label, counts in sorted(found.states.items()):
            rows = found.rows[label]
            parts = [f"{n} {state} ({rows[state]} row(s))" for state, n in sorted(counts.items())]
            print(f"  {label}: {', '.join(parts)}")
        lost_rows = sum(t.rows for t in found.lost)
        print(
            f"abandoning loses {lost_rows} row(s) for good: they are in no sink of theirs and "
            "are never written again by this job; re-run the affected batches from source to "
            "restore them"
        )
        if not yes and not _confirm(
            f"abandon {len(found.lost)} transaction(s) of checkpoint {cp.id}? [y/N] "
        ):
            print("not abandoned: nothing changed")
            return 1
        op.abandon(found, note)
    print(
        f"abandoned: recorded in the ledger's history (`twophase status`). Run `twophase "
        f"recover {state_dir}{_ledger_arg(ledger)}` or the job to commit the rest of "
        f"checkpoint {cp.id}"
    )
    return 0


def give_up_owed(
    state_dir: str, owed: str, *, yes: bool, note: str, ledger: str | None = None
) -> int:
    """Give up a batch owed to sinks (recovery rule 5) whose source no longer has
    it, after confirmation (``owed``: ``PIPELINE/BATCH``)."""
    pipeline, _, batch = owed.rpartition("/")
    if not pipeline or not batch.isdigit():
        return _fail(f"--owed takes PIPELINE/BATCH (e.g. load/12), not {owed!r}", 2)
    try:
        op = operations.Operator(state_dir, ledger=ledger)
    except TwoPhaseError as e:
        return _fail(e, 2)
    with op:
        owing = op.ledger.owed().get(pipeline, {}).get(int(batch))
        if not owing:
            listed = {p: sorted(bs) for p, bs in op.ledger.owed().items()}
            return _fail(f"batch {batch} of {pipeline} is not owed (owed: {listed or 'none'})", 1)
        rows = sum(owing.values())
        print(
            f"batch {batch} of {pipeline} is owed to "
            + ", ".join(f"{sid} ({n} row(s))" for sid, n in sorted(owing.items()))
            + f": giving it up loses {rows} row(s) for good in those sinks (the other sinks "
            "hold the batch); re-run its rows from source to restore them"
        )
        if not yes and not _confirm(f"give up batch {batch} of {pipeline}? [y/N] "):
            print("not abandoned: nothing changed")
            return 1
        op.give_up_owed(pipeline, int(batch), note)
    print("abandoned: recorded in the ledger's history (`twophase status`); the job runs on")
    return 0


def stop(state_dir: str, *, drain: bool, timeout: float, ledger: str | None = None) -> int:
    """Ask the job on ``state_dir`` to stop, wait for it to exit, report the outcome
    (``ledger``: the job's ``ledger=``, see the module docstring)."""
    asked = remote.ask_to_stop(state_dir, ledger, drain=drain)
    if asked is None:
        print(f"twophase: no job is running with state_dir {state_dir}", file=sys.stderr)
        return 2
    what = "drain" if drain else "stop (savepoint)"
    print(f"asked the job to {what}; waiting for it to exit ...", flush=True)
    if not remote.wait_for_exit(asked, timeout):
        print(f"twophase: the job did not exit within {timeout:.0f}s", file=sys.stderr)
        return 2
    last = remote.stop_checkpoint(asked)
    if last is not None:
        print(f"the job exited; {last['kind']} checkpoint {last['id']} committed")
        return 0
    print(
        "twophase: the job exited without committing its "
        f"{asked.kind} checkpoint; see the job's log and `twophase status {state_dir}"
        f"{_ledger_arg(ledger)}`",
        file=sys.stderr,
    )
    return 1


def start_over(state_dir: str, incarnation: str, ledger: str | None = None) -> int:
    """Record the operator's choice to start over from ``incarnation``."""
    try:
        remote.request_start_over(state_dir, incarnation, ledger)
    except ConfigError as e:
        print(f"twophase: {e}", file=sys.stderr)
        return 2
    print(
        f"the next run with state_dir {state_dir} takes every sink over from incarnation "
        f"{incarnation}: it aborts what that incarnation left prepared, keeps what it "
        "committed, and records the choice in each sink"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    if args.cmd == "version":
        try:
            print(version("twophase"))
        except PackageNotFoundError:
            print("unknown (not installed)")
        return 0
    try:
        return _command(args)
    except ConfigError as e:  # a ledger or state that cannot be found or reached
        print(f"twophase: {e}", file=sys.stderr)
        return 2


def _command(args: argparse.Namespace) -> int:
    if args.cmd == "lingering":
        return lingering(args.state_dir, ledger=args.ledger)
    if args.cmd == "audit":
        return audit(
            args.state_dir,
            last=None if args.all else args.last,
            as_json=args.json,
            ledger=args.ledger,
        )
    if args.cmd == "recover":
        return recover(args.state_dir, ledger=args.ledger)
    if args.cmd == "abandon" and args.owed is not None:
        return give_up_owed(
            args.state_dir, args.owed, yes=args.yes, note=args.note, ledger=args.ledger
        )
    if args.cmd == "abandon":
        return abandon(
            args.state_dir, args.checkpoint, yes=args.yes, note=args.note, ledger=args.ledger
        )
    if args.cmd == "stop":
        return stop(args.state_dir, drain=args.drain, timeout=args.timeout, ledger=args.ledger)
    if args.cmd == "start-over":
        return start_over(args.state_dir, args.incarnation, args.ledger)
    if args.state_dir is None and args.ledger is None:
        print("twophase: status needs a STATE_DIR or --ledger URI (or DIR)", file=sys.stderr)
        return 2
    if args.watch is None:
        return status(
            args.state_dir,
            args.ledger,
            as_json=args.json,
            raw=args.raw,
            stuck_after=args.stuck_after,
        )
    code = 2
    try:
        while True:
            if sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")
            code = status(
                args.state_dir,
                args.ledger,
                as_json=args.json,
                raw=args.raw,
                stuck_after=args.stuck_after,
            )
            print(
                f"(every {args.watch:g}s, Ctrl-C to stop; {time.strftime('%H:%M:%S')})", flush=True
            )
            time.sleep(max(0.1, args.watch))
    except KeyboardInterrupt:
        return code


def status(
    state_dir: str | None,
    ledger: str | None,
    *,
    as_json: bool = False,
    raw: bool = False,
    stuck_after: float | None = None,
) -> int:
    """Print whether the job runs and what its ledger holds; return the exit
    code (module docstring)."""
    doc = read_ledger(state_dir, ledger)
    if doc is None:
        where = remote.shown_location(ledger) if ledger else str(state_dir)
        if as_json:
            print(json.dumps(status_view.not_found(where), indent=2, sort_keys=True))
        print(f"twophase: no ledger in {where}", file=sys.stderr)
        return 2
    if raw:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    found = remote.current_status(state_dir, ledger, doc, stuck_after=stuck_after)
    if as_json:
        print(json.dumps(found, indent=2, sort_keys=True))
    else:
        print(status_view.format_text(found, doc))
    return int(found["exit_code"])


def entry() -> NoReturn:
    """The ``twophase`` console command: :func:`main`, then leave with its
    status, exit handlers run but no interpreter teardown after them
    (:mod:`lifecycle._exit`: deltalake can abort a process as it finalizes)."""
    try:
        status = main()
    except SystemExit as e:  # argparse's --help and usage errors
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    leave(status)


if __name__ == "__main__":
    entry()
