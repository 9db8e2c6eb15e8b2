"""The ledger: persistence, crash atomicity, locking, compaction.

Tests of what a ledger answers and how it changes take ``ledger_factory`` and
run against every backend (``[file]``, ``[postgres]`` and ``[store]``, all in
the default run); tests of the file ledger's own format (journal, snapshots, compaction,
format 1) use :class:`FileLedger` directly. The PostgreSQL ledger's own
(locking, fencing, rows) are in ``test_pg_ledger.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from inspect import signature
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lifecycle.cli import format_status
from lifecycle.ledger import (
    FORMAT,
    HISTORY,
    Checkpoint,
    CorruptLedgerError,
    FileLedger,
    Ledger,
    LedgerLockedError,
    PostgresLedger,
    StoreLedger,
    is_locked,
    read_ledger,
)
from lifecycle.state.file_ledger import read_directory
from lifecycle.state.frames import scan
from lifecycle.state.pg_location import PgLocation
from lifecycle.state.snapshot import generations, read_snapshot, write_snapshot
from sinks.errors import ConfigError
from tests.ledgers import LedgerBackend
from tests.procs import tree_at

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NEVER = 1 << 40  # compact_bytes that never compacts


def _c(name: str, rows: int = 1) -> dict[str, object]:
    return {"txn": name, "rows": rows}


def test_both_backends_have_the_ledger_interface() -> None:
    """FileLedger and PostgresLedger offer every member of the Ledger protocol,
    with the same parameters; the coordinator and the job type against it."""
    members = [m for m in vars(Ledger) if not m.startswith("_")]
    assert len(members) == 36
    for cls in (FileLedger, PostgresLedger, StoreLedger):
        for name in members:
            ours, theirs = getattr(Ledger, name), getattr(cls, name, None)
            assert theirs is not None, f"{cls.__name__} has no {name}"
            if isinstance(ours, property):
                assert isinstance(theirs, property), f"{cls.__name__}.{name}"
                continue
            params = [(p.name, p.kind, p.default) for p in signature(ours).parameters.values()]
            got = [(p.name, p.kind, p.default) for p in signature(theirs).parameters.values()]
            assert got == params, f"{cls.__name__}.{name}{signature(theirs)}"


def test_round_trip_and_runs(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open()
    assert led.begin_run() == 1
    led.record_batch("p", 0, {"s": [_c("a"), _c("b")]})
    led.record_batch("p", 1, {"s": []})
    led.close()
    led = ledger_factory.open()
    assert led.begin_run() == 2
    assert led.pending() == {"p": {0: {"s": [_c("a"), _c("b")]}, 1: {"s": []}}}
    assert led.owned_txns() == {"a", "b"}


def test_decide_complete_moves_batches_to_history(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open()
    for b in range(3):
        led.record_batch("p", b, {"s": [_c(f"t{b}", 10)]})
    led.record_batch("q", 0, {"s": [_c("q0", 5)]})
    cp = led.decide("periodic", {"p": 1}, [])
    assert led.decided() == cp
    with pytest.raises(RuntimeError):
        led.decide("periodic", {"p": 2}, [])  # one decision at a time
    done = led.complete(cp, {"p/s": 20})
    assert done.committed_at is not None and led.decided() is None
    assert led.pending() == {"p": {2: {"s": [_c("t2", 10)]}}, "q": {0: {"s": [_c("q0", 5)]}}}
    assert led.totals() == {"p/s": 20}
    cp2 = led.decide("final", {"p": 2, "q": 0}, ["p", "q"])
    led.complete(cp2, {"p/s": 10, "q/s": 5})
    assert led.pending() == {} and led.finished() == {"p", "q"}
    assert [c.kind for c in led.history()] == ["periodic", "final"]
    led.close()
    again = ledger_factory.open()
    assert again.history() == led.history() and again.finished() == {"p", "q"}
    assert again.totals() == {"p/s": 30, "q/s": 5} and again.pending() == {}


def test_a_decision_survives_reopening(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open()
    led.record_batch("p", 0, {"s": [_c("a")]})
    cp = led.decide("periodic", {"p": 0}, [])
    led.close()
    assert ledger_factory.open().decided() == cp


def test_history_is_trimmed_and_the_files_stay_small(tmp_path: Path) -> None:
    led = FileLedger(tmp_path, "j", compact_bytes=16_000)
    for b in range(HISTORY * 3):
        led.record_batch("p", b, {"s": [_c(f"tp1.j.p.s.r1.b{b}.p{i}.a{i}") for i in range(8)]})
        led.complete(led.decide("periodic", {"p": b}, []), {"p/s": 8})
    assert len(led.history()) == HISTORY
    assert led.pending() == {}
    assert led.totals() == {"p/s": 8 * HISTORY * 3}
    assert led.generation > 0  # the journal was compacted
    assert sum(f.stat().st_size for f in tmp_path.iterdir()) < 40_000


def test_second_opener_is_refused(ledger_factory: LedgerBackend) -> None:
    if not ledger_factory.locks:
        pytest.skip("no lock: a second opener is fenced (test_store_ledger.py)")
    led = ledger_factory.open()
    assert ledger_factory.locked()
    with pytest.raises(LedgerLockedError, match="in use by another process"):
        ledger_factory.open()
    led.close()
    assert not ledger_factory.locked()
    ledger_factory.open().close()


def test_another_jobs_ledger_is_refused(tmp_path: Path) -> None:
    FileLedger(tmp_path, "a").begin_run()
    with pytest.raises(ConfigError, match="belongs to job 'a'"):
        FileLedger(tmp_path, "b", lock=False)


_FAILING_WRITER = """
import json, os, resource, signal, sys
from lifecycle.ledger import FileLedger
led = FileLedger(sys.argv[1], "j")
led.record_batch("p", 0, {"s": [{"txn": "a", "rows": 1}]})
size = led._journal.size
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
# the file may grow by 20 bytes: the next record is written in part, then fails (even for root)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 20, resource.RLIM_INFINITY))
try:
    led.record_batch("p", 1, {"s": [{"txn": "b", "rows": 1}]})
    error = None
except OSError as e:
    error = e.errno
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
after = os.path.getsize(led._journal.path)
pending = {p: sorted(b) for p, b in led.pending().items()}
led.record_batch("p", 2, {"s": [{"txn": "c", "rows": 1}]})  # the ledger still works
print(json.dumps({"error": error, "size": size, "after": after, "pending": pending}))
"""


def test_failed_write_leaves_memory_and_disk_unchanged(tmp_path: Path) -> None:
    """A write that fails half-way (the file size limit) is undone on disk and in memory."""
    out = subprocess.run(
        [sys.executable, "-c", _FAILING_WRITER, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout
    got = json.loads(out)
    assert got["error"] is not None, "the write did not fail"
    assert got["after"] == got["size"], "the partial record was left in the journal"
    assert got["pending"] == {"p": [0]}
    assert FileLedger(tmp_path, "j").pending() == {"p": {0: {"s": [_c("a")]}, 2: {"s": [_c("c")]}}}


_WRITER = """
import sys
from lifecycle.ledger import open_ledger
location = sys.argv[2] or None
opts = {} if location else {"compact_bytes": 8192}  # compactions happen under the kill
if location == "store":  # a URI state_dir's ledger, on a local directory here
    from lifecycle.state.store import LocalStore
    from lifecycle.state.store_ledger import StoreLedger
    led = StoreLedger(LocalStore(sys.argv[1]), "j", compact_records=20)
else:
    led = open_ledger(location, sys.argv[1], "j", **opts)
b = 0
while True:
    led.record_batch("p", b, {"s": [{"txn": "t%d" % b, "rows": 1}] * 50})
    if b % 7 == 6:
        led.complete(led.decide("periodic", {"p": b - 3}, []), {"p/s": 1})
    print(b, flush=True)  # acknowledged: durable from here on
    b += 1
"""


@pytest.mark.parametrize("delay", [0.15, 0.4, 0.9])
def test_sigkill_at_any_instant_keeps_every_acknowledged_record(
    ledger_factory: LedgerBackend, delay: float
) -> None:
    """A real process writes the ledger in a loop and is SIGKILLed mid-stream."""
    where = "store" if ledger_factory.kind == "store" else ledger_factory.location or ""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(ledger_factory.state_dir), where],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # start-up done: the writer is writing now
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    acked = [int(x) for x in (first + out).split()]
    assert acked, "the writer acknowledged nothing before it was killed"
    deadline = time.monotonic() + 30
    while ledger_factory.locks and ledger_factory.locked():  # the server ends its sessions
        assert time.monotonic() < deadline, "the killed writer's lock was never released"
        time.sleep(0.05)
    led = ledger_factory.open()  # loads: never a torn record, never a part of a change
    last = acked[-1]
    pending = led.pending().get("p", {})
    committed_upto = max((cp.cut["p"] for cp in led.history()), default=-1)
    for b in range(committed_upto + 1, last + 1):
        assert b in pending, f"acknowledged batch {b} is missing after the crash"


# -- the journal: one record per change, a torn last record dropped ------------------


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _view(led: FileLedger) -> dict[str, Any]:
    """Everything the ledger answers, for comparisons."""
    pipelines = ["p", "q"]
    return {
        "incarnation": led.incarnation,
        "run": led.run,
        "pending": led.pending(),
        "owned": led.owned_txns(),
        "decided": led.decided(),
        "history": led.history(),
        "finished": led.finished(),
        "totals": led.totals(),
        "abandoned": led.abandoned(),
        "spark": {p: led.spark_completed(p) for p in pipelines},
        "cut": {p: led.committed_cut(p) for p in pipelines},
        "digests": {p: {b: led.committed_digest(p, b) for b in range(20)} for p in pipelines},
    }


def _some_changes(led: FileLedger) -> None:
    """Changes of every kind; replaying any of them twice would show."""
    led.begin_run()
    for b in range(4):
        led.record_batch("p", b, {"s": [_c(f"p{b}.{i}", 10) for i in range(3)]}, f"d{b}")
        led.record_spark_completed("p", b)
    led.record_batch("q", 0, {"s": [_c("q0", 5)], "t": []})
    led.complete(led.decide("periodic", {"p": 1}, []), {"p/s": 60})
    led.record_abandoned(1, ["p9.0"], "lost before its commit")
    led.begin_run()
    led.drop_batches("p", [3])
    led.complete(led.decide("periodic", {"q": 0}, ["q"]), {"q/s": 5})
    led.record_batch("p", 4, {"s": [_c("p4.0", 7)]}, "d4")


def test_a_change_appends_only_its_own_record(tmp_path: Path) -> None:
    """Invariant 10: a change costs its own record, however much is pending."""
    led = FileLedger(tmp_path, "j", compact_bytes=NEVER)
    for b in range(300):
        led.record_batch("p", b, {"s": [_c(f"t{b}.{i}") for i in range(20)]})
    snapshot = tmp_path / "snapshot.0.json"
    before = snapshot.stat()
    journal = tmp_path / "journal.0.log"
    size = journal.stat().st_size
    led.record_batch("p", 300, {"s": [_c("one")]})
    grown = journal.stat().st_size - size
    assert 0 < grown < 200, f"one small batch appended {grown} bytes"
    cp = led.decide("periodic", {"p": 0}, [])
    led.complete(cp, {"p/s": 20})
    assert journal.stat().st_size - size < 800
    after = snapshot.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_torn_last_record_is_dropped_at_every_byte(tmp_path: Path) -> None:
    """Cut the journal at every byte of its last record (what a crash mid-append
    leaves): the ledger opens without that change, and goes on."""
    src = tmp_path / "src"
    led = FileLedger(src, "j", compact_bytes=NEVER)
    _some_changes(led)
    without = _view(led)
    led.record_batch("p", 5, {"s": [_c("p5.0", 2), _c("p5.1", 2)]}, "d5")
    with_it = _view(led)
    led.close()
    data = (src / "journal.0.log").read_bytes()
    start = scan(data, src / "journal.0.log").records[-1][0]
    assert 50 < len(data) - start < 300
    work = tmp_path / "work"
    for cut in range(start, len(data) + 1):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(src, work)
        (work / "journal.0.log").write_bytes(data[:cut])
        led = FileLedger(work, "j")
        expected = with_it if cut == len(data) else without
        assert _view(led) == expected, f"cut at byte {cut}"
        assert (work / "journal.0.log").stat().st_size == (len(data) if cut == len(data) else start)
        led.record_batch("q", 7, {"s": [_c("q7")]})  # appends after the cut, not after junk
        led.close()
        again = FileLedger(work, "j")
        assert again.pending_batch("q", 7) == {"s": [_c("q7")]}
        assert again.is_owned("p5.0") == (cut == len(data))
        again.close()


def test_a_last_record_with_lost_bytes_is_dropped(tmp_path: Path) -> None:
    """A complete-looking last line whose bytes did not all reach the disk."""
    led = FileLedger(tmp_path, "j", compact_bytes=NEVER)
    led.record_batch("p", 0, {"s": [_c("a")]})
    led.record_batch("p", 1, {"s": [_c("b")]})
    led.close()
    journal = tmp_path / "journal.0.log"
    data = bytearray(journal.read_bytes())
    data[-5:-1] = b"\0\0\0\0"
    journal.write_bytes(bytes(data))
    assert FileLedger(tmp_path, "j").pending_batch_ids("p") == [0]


def test_damage_before_the_last_record_is_an_error_naming_file_and_offset(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    led = FileLedger(state / "ledger", "j", compact_bytes=NEVER)
    led.record_batch("p", 0, {"s": [_c("a")]})
    led.record_batch("p", 1, {"s": [_c("b")]})
    led.record_batch("p", 2, {"s": [_c("c")]})
    led.close()
    journal = state / "ledger" / "journal.0.log"
    data = journal.read_bytes()
    second = scan(data, journal).records[1][0]
    damaged = data[: second + 30] + b"X" + data[second + 31 :]
    journal.write_bytes(damaged)
    message = rf"{re.escape(str(journal))}: .* at byte offset {second}\b"
    with pytest.raises(CorruptLedgerError, match=message):
        FileLedger(state / "ledger", "j")
    with pytest.raises(CorruptLedgerError, match=message):
        read_ledger(state)
    assert journal.read_bytes() == damaged  # nothing was truncated


# -- compaction ----------------------------------------------------------------------


def test_compaction_preserves_the_state(tmp_path: Path) -> None:
    plain = FileLedger(tmp_path / "plain", "j", compact_bytes=NEVER)
    small = FileLedger(tmp_path / "small", "j", compact_bytes=600)
    for led in (plain, small):
        for _ in range(6):
            _some_changes(led)
            led.drop_batches("p", led.pending_batch_ids("p"))
            led.drop_batches("q", led.pending_batch_ids("q"))
        led.record_batch("p", 9, {"s": [_c("p9", 3)]}, "d9")
    assert plain.generation == 0 and small.generation > 5
    assert _files(tmp_path / "small") == [
        f"journal.{small.generation}.log",
        "lock",
        f"snapshot.{small.generation}.json",
    ]
    view = _view(small)
    timeless = ["run", "pending", "owned", "finished", "totals", "spark", "cut", "digests"]
    assert {k: view[k] for k in timeless} == {k: _view(plain)[k] for k in timeless}
    assert read_directory(tmp_path / "small") == read_directory(tmp_path / "small")
    small.close()
    assert _view(FileLedger(tmp_path / "small", "j")) == view


def _generations(tmp_path: Path) -> tuple[Path, Path, dict[str, Any], dict[str, Any]]:
    """Generation 0 of a ledger (a snapshot and a journal of changes) and the
    generation 1 its compaction writes, followed by one more change, as two
    directories; the state before and after that change."""
    g0, g1 = tmp_path / "g0", tmp_path / "g1"
    led = FileLedger(g1, "j", compact_bytes=NEVER)
    _some_changes(led)
    before = _view(led)
    shutil.copytree(g1, g0)  # a crash before the compaction
    led._compact()  # what the ledger does once the journal is large enough
    assert _view(led) == before
    led.record_spark_completed("q", 3)
    after = _view(led)
    led.close()
    assert _files(g0) == ["journal.0.log", "lock", "snapshot.0.json"]
    assert _files(g1) == ["journal.1.log", "lock", "snapshot.1.json"]
    assert after["spark"]["q"] == 3 and before["spark"]["q"] == -1
    return g0, g1, before, after


@pytest.mark.parametrize(
    ("window", "changed"),
    [
        ("snapshot written in part (not renamed)", False),
        ("snapshot written, not renamed", False),
        ("snapshot renamed, no new journal", False),
        ("new journal created, old generation not removed", False),
        ("new journal written to, old generation not removed", True),
        ("old snapshot removed, old journal not", True),
        ("done", True),
    ],
)
def test_a_crash_at_every_step_of_a_compaction(tmp_path: Path, window: str, changed: bool) -> None:
    g0, g1, before, after = _generations(tmp_path)
    snap1 = (g1 / "snapshot.1.json").read_bytes()
    crash = tmp_path / "crash"
    shutil.copytree(g0, crash)
    if window == "snapshot written in part (not renamed)":
        (crash / "snapshot.1.json.tmp").write_bytes(snap1[: len(snap1) // 2])
    elif window == "snapshot written, not renamed":
        (crash / "snapshot.1.json.tmp").write_bytes(snap1)
    else:
        (crash / "snapshot.1.json").write_bytes(snap1)
        if window == "new journal created, old generation not removed":
            (crash / "journal.1.log").write_bytes(b"")
        elif window != "snapshot renamed, no new journal":
            shutil.copy(g1 / "journal.1.log", crash / "journal.1.log")
        if window in ("old snapshot removed, old journal not", "done"):
            (crash / "snapshot.0.json").unlink()
        if window == "done":
            (crash / "journal.0.log").unlink()
    view = after if changed else before
    led = FileLedger(crash, "j")
    # neither the old journal replayed over the new snapshot, nor the new journal lost
    assert _view(led) == view
    gen = led.generation
    assert _files(crash) == [f"journal.{gen}.log", "lock", f"snapshot.{gen}.json"]
    led.begin_run()
    led.close()
    again = FileLedger(crash, "j")
    assert _view(again) == {**view, "run": view["run"] + 1}


def test_a_journal_without_its_snapshot_is_an_error(tmp_path: Path) -> None:
    led = FileLedger(tmp_path, "j")
    led.record_batch("p", 0, {"s": [_c("a")]})
    led.close()
    (tmp_path / "snapshot.0.json").unlink()
    with pytest.raises(CorruptLedgerError, match="journal without its snapshot"):
        FileLedger(tmp_path, "j")


# -- what the ledger holds -------------------------------------------------------------


def test_incarnation_is_drawn_once_and_kept(tmp_path: Path) -> None:
    led = FileLedger(tmp_path / "a", "j", compact_bytes=300)
    incarnation = led.incarnation
    assert re.fullmatch(r"[0-9a-f]{12}", incarnation)
    for b in range(30):
        led.record_batch("p", b, {"s": [_c(f"t{b}")]})
    assert led.generation > 0  # survived compactions
    led.close()
    assert FileLedger(tmp_path / "a", "j").incarnation == incarnation
    assert read_ledger_dir(tmp_path / "a")["incarnation"] == incarnation
    assert FileLedger(tmp_path / "b", "j").incarnation != incarnation


def test_incarnation_is_kept_and_another_ledger_draws_its_own(
    ledger_factory: LedgerBackend,
) -> None:
    led = ledger_factory.open()
    incarnation = led.incarnation
    assert re.fullmatch(r"[0-9a-f]{12}", incarnation)
    led.begin_run()
    led.close()
    assert ledger_factory.open().incarnation == incarnation
    assert ledger_factory.read()["incarnation"] == incarnation
    other = ledger_factory.other("other")
    assert other.open().incarnation != incarnation
    assert ledger_factory.read()["incarnation"] == incarnation


def test_batches_answered_one_at_a_time(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open()
    assert led.pending_pipelines() == [] and led.pending_batch_ids("p") == []
    assert led.pending_batch("p", 0) is None
    for b in (5, 1, 3):
        led.record_batch("p", b, {"s": [_c(f"p{b}")], "t": [_c(f"p{b}t")]})
    led.record_batch("a", 0, {"s": []})
    assert led.pending_pipelines() == ["a", "p"]
    assert led.pending_batch_ids("p") == [1, 3, 5]
    assert led.pending_batch("p", 3) == {"s": [_c("p3")], "t": [_c("p3t")]}
    assert led.pending_batch("a", 0) == {"s": []}
    assert led.pending_batch("p", 2) is None and led.pending_batch("x", 3) is None
    copy = led.pending_batch("p", 3)
    assert copy is not None
    copy["s"][0]["txn"] = "changed"
    copy["s"].append(_c("more"))
    assert led.pending_batch("p", 3) == {"s": [_c("p3")], "t": [_c("p3t")]}
    led.drop_batches("p", [3, 4])
    led.complete(led.decide("periodic", {"p": 1, "a": 0}, []), {})
    assert led.pending_pipelines() == ["p"] and led.pending_batch_ids("p") == [5]
    led.close()
    led = ledger_factory.open()
    assert led.pending_batch_ids("p") == [5]
    assert led.pending_batch("p", 5) == {"s": [_c("p5")], "t": [_c("p5t")]}


def test_ownership_follows_registration_replacement_drop_and_commit(
    ledger_factory: LedgerBackend,
) -> None:
    led = ledger_factory.open()
    led.record_batch("p", 0, {"s": [_c("a"), _c("b")], "t": [_c("c")]})
    led.record_batch("p", 1, {"s": [_c("d"), _c("d")]})
    assert all(led.is_owned(t) for t in "abcd") and not led.is_owned("e")
    led.record_batch("p", 0, {"s": [_c("e")]})  # a re-run replaces the first attempt
    assert not any(led.is_owned(t) for t in "abc") and led.is_owned("e")
    led.record_batch("p", 2, {"s": [_c("d")]})
    led.drop_batches("p", [1])
    assert led.is_owned("d")  # batch 2 still names it
    led.complete(led.decide("periodic", {"p": 2}, []), {})
    assert not led.is_owned("d") and not led.is_owned("e")
    led.record_batch("p", 3, {"s": [_c("f")]})
    led.close()
    led = ledger_factory.open()
    assert led.owned_txns() == {"f"} and led.is_owned("f") and not led.is_owned("d")


def test_digests_commit_with_their_batch_within_a_window(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open(digest_window=3)
    for b in range(6):
        led.record_batch("p", b, {"s": [_c(f"t{b}")]}, digest=f"offsets-{b}")
    led.record_batch("p", 6, {"s": [_c("t6")]})  # no digest
    led.record_batch("q", 0, {"s": [_c("q0")]}, digest="q-0")
    assert led.committed_digest("p", 0) is None  # pending, not committed
    assert led.committed_cut("p") == -1 and led.committed_cut("q") == -1
    led.complete(led.decide("periodic", {"p": 1}, []), {})
    assert [led.committed_digest("p", b) for b in range(3)] == ["offsets-0", "offsets-1", None]
    led.complete(led.decide("periodic", {"p": 6, "q": 0}, []), {})
    assert [led.committed_digest("p", b) for b in range(7)] == [
        None,
        None,
        None,
        "offsets-3",
        "offsets-4",
        "offsets-5",
        None,
    ]
    assert led.committed_digest("q", 0) == "q-0"
    assert (led.committed_cut("p"), led.committed_cut("q"), led.committed_cut("x")) == (6, 0, -1)
    led.close()
    led = ledger_factory.open(digest_window=2)  # a smaller window applies at once
    assert [led.committed_digest("p", b) for b in (3, 4, 5)] == [None, "offsets-4", "offsets-5"]
    assert led.committed_cut("p") == 6
    led.close()
    led = ledger_factory.open(digest_window=2)
    assert [led.committed_digest("p", b) for b in (3, 4, 5)] == [None, "offsets-4", "offsets-5"]
    led.close()
    doc = ledger_factory.read()
    assert doc["committed_digests"] == {
        "p": {"4": "offsets-4", "5": "offsets-5"},
        "q": {"0": "q-0"},
    }


def read_ledger_dir(directory: Path) -> dict[str, Any]:
    doc = read_directory(directory)
    assert doc is not None
    return doc


def test_a_digest_is_replaced_with_its_batch(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open()
    led.record_batch("p", 0, {"s": [_c("a")]}, digest="first")
    led.record_batch("p", 0, {"s": [_c("b")]}, digest="again")
    led.record_batch("p", 1, {"s": [_c("c")]}, digest="one")
    led.record_batch("p", 1, {"s": [_c("d")]})
    led.complete(led.decide("periodic", {"p": 1}, []), {})
    assert (led.committed_digest("p", 0), led.committed_digest("p", 1)) == ("again", None)
    with pytest.raises(TypeError):
        led.record_batch("p", 2, {"s": [_c("e")]}, digest=7)  # type: ignore[arg-type]
    assert led.pending_batch_ids("p") == []


def test_spark_progress_only_goes_up(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open(compact_bytes=NEVER)
    assert led.spark_completed("p") == -1
    led.record_spark_completed("p", 4)
    written = ledger_factory.footprint()
    led.record_spark_completed("p", 2)  # lower: nothing happens, nothing is written
    led.record_spark_completed("p", 4)
    assert ledger_factory.footprint() == written
    assert led.spark_completed("p") == 4 and led.spark_completed("q") == -1
    led.record_spark_completed("p", 9)
    assert ledger_factory.footprint() != written
    led.close()
    assert ledger_factory.open().spark_completed("p") == 9


def test_abandonments_are_kept(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open(compact_bytes=300)
    t0 = time.time()
    led.record_abandoned(3, ["x", "y"], "the transactions were gone")
    for b in range(20):  # compactions
        led.record_batch("p", b, {"s": [_c(f"t{b}")]})
    led.record_abandoned(4, [], "nothing")
    got = led.abandoned()
    assert [(a["checkpoint"], a["txns"], a["note"]) for a in got] == [
        (3, ["x", "y"], "the transactions were gone"),
        (4, [], "nothing"),
    ]
    assert t0 <= got[0]["at"] <= got[1]["at"] <= time.time()
    got[0]["txns"].append("z")  # a copy
    assert led.abandoned()[0]["txns"] == ["x", "y"]
    doc = ledger_factory.read()
    assert doc["abandoned"] == led.abandoned()
    led.close()
    assert ledger_factory.open().abandoned() == doc["abandoned"]


def test_abandoned_txns_are_indexed_per_checkpoint(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open()
    assert led.abandoned_txns(3) == set()
    led.record_abandoned(3, ["x", "y"], "gone")
    led.record_abandoned(3, ["z"], "gone too")
    led.record_abandoned(4, ["w"], "another")
    assert led.abandoned_txns(3) == {"x", "y", "z"} and led.abandoned_txns(4) == {"w"}
    led.abandoned_txns(3).add("q")  # a copy
    assert led.abandoned_txns(3) == {"x", "y", "z"} and led.abandoned_txns(5) == set()
    led.close()
    led = ledger_factory.open()
    assert led.abandoned_txns(3) == {"x", "y", "z"} and led.abandoned_txns(4) == {"w"}


def test_sink_settings_are_recorded_replaced_and_kept(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open(compact_bytes=NEVER)
    assert led.sinks_settings() == {} and ledger_factory.read()["sinks"] == {}
    first = {"p/a": {"kind": "postgres", "sink_id": "a", "dsn": "host=h", "key": ["id"]}}
    assert led.record_sinks(first) is True
    written = ledger_factory.footprint()
    assert led.record_sinks(json.loads(json.dumps(first))) is False  # unchanged: no record
    assert ledger_factory.footprint() == written
    second = {"p/b": {"kind": "delta", "sink_id": "b", "table_uri": "/t"}, "q/c": {"kind": "x"}}
    assert led.record_sinks(second) is True
    assert led.sinks_settings() == second  # replaced, not merged
    led.sinks_settings()["p/b"]["table_uri"] = "/elsewhere"  # a copy
    assert led.sinks_settings() == second
    changed = ledger_factory.footprint()
    with pytest.raises(TypeError):
        led.record_sinks({"p/d": {"password": object()}})  # JSON values only
    with pytest.raises(TypeError):
        led.record_sinks({"p/d": "not settings"})  # type: ignore[dict-item]
    assert led.sinks_settings() == second and ledger_factory.footprint() == changed != written
    assert ledger_factory.read()["sinks"] == second
    led.close()
    led = ledger_factory.open()
    assert led.sinks_settings() == second
    assert led.record_sinks({}) is True and led.sinks_settings() == {}
    led.close()
    assert ledger_factory.open().sinks_settings() == {} and ledger_factory.read()["sinks"] == {}


def test_sink_settings_survive_a_compaction(tmp_path: Path) -> None:
    settings = {"p/b": {"kind": "delta", "sink_id": "b", "table_uri": "/t"}}
    led = FileLedger(tmp_path / "ledger", "j", compact_bytes=1)
    assert led.record_sinks(settings) is True
    for b in range(100):  # until the journal outgrows the snapshot: a compaction
        led.record_batch("p", b, {"b": [_c(f"t{b}")]})
        if led.generation:
            break
    assert led.generation > 0 and led.sinks_settings() == settings
    doc = read_ledger(tmp_path)
    assert doc is not None and doc["sinks"] == settings
    led.close()
    assert FileLedger(tmp_path / "ledger", "j").sinks_settings() == settings


def test_history_length_is_configurable(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open(history=3)
    for b in range(5):
        led.record_batch("p", b, {"s": [_c(f"t{b}")]})
        led.complete(led.decide("periodic", {"p": b}, []), {"p/s": 1})
    assert [cp.id for cp in led.history()] == [3, 4, 5]
    assert led.totals() == {"p/s": 5} and led.committed_cut("p") == 4
    led.close()
    led = ledger_factory.open(history=3)
    assert [cp.id for cp in led.history()] == [3, 4, 5]
    led.close()
    led = ledger_factory.open(history=2)
    assert [cp.id for cp in led.history()] == [4, 5]
    led.close()
    assert [cp["id"] for cp in ledger_factory.read()["history"]] == [4, 5]
    led = ledger_factory.open(history=0)
    assert led.history() == [] and led.totals() == {"p/s": 5}
    led.record_batch("p", 5, {"s": [_c("t5")]})
    led.complete(led.decide("periodic", {"p": 5}, []), {"p/s": 1})
    assert led.history() == [] and led.committed_cut("p") == 5
    led.close()
    assert ledger_factory.open(history=0).history() == []


def test_a_change_that_does_not_fit_writes_nothing(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open(compact_bytes=NEVER)
    led.record_batch("p", 0, {"s": [_c("a")]})
    written = ledger_factory.footprint()
    with pytest.raises(TypeError):
        led.record_batch("p", 1, {"s": [{"txn": "b", "rows": object()}]})  # not JSON
    with pytest.raises(TypeError):
        led.record_batch("p", 1, {"s": {"txn": "b"}})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        led.decide("sometime", {"p": 0}, [])
    with pytest.raises(RuntimeError):
        led.complete(Checkpoint(id=7, kind="periodic", cut={"p": 0}), {})
    assert ledger_factory.footprint() == written
    led.record_batch("p", 1, {"s": [_c("b")]})  # the ledger still works
    led.close()
    assert ledger_factory.open().pending() == {"p": {0: {"s": [_c("a")]}, 1: {"s": [_c("b")]}}}


# -- format 1 ------------------------------------------------------------------------


# tests/fixtures/ledger_v1/ledger.json was written by the previous version's ledger
# code (lifecycle/ledger.py at e43e90d): two runs, batches 0..3 of "load" and 0 of
# "audit", checkpoints 1 (load <= 1) and 2 (audit, finished) committed, savepoint 3
# (load <= 2) decided and not committed.
V1 = FIXTURES / "ledger_v1"


def test_a_format_1_ledger_is_converted_on_open(tmp_path: Path) -> None:
    shutil.copytree(V1, tmp_path / "ledger")
    old = json.loads((V1 / "ledger.json").read_text())
    led = FileLedger(tmp_path / "ledger", "orders")
    assert led.run == 2
    assert led.pending() == {
        "load": {b: old["pending"]["load"][str(b)] for b in (2, 3)},
    }
    assert led.is_owned("tp1.orders.load.s.r2.b3.p1.a31")
    assert not led.is_owned("tp1.orders.load.s.r2.b1.p1.a11")
    assert led.decided() == Checkpoint.from_json(old["decided"])
    assert led.history() == [Checkpoint.from_json(cp) for cp in old["history"]]
    assert [cp.id for cp in led.history()] == [1, 2]
    assert led.totals() == {"load/s": 40, "audit/s": 3}
    assert led.finished() == {"audit"}
    assert (led.committed_cut("load"), led.committed_cut("audit")) == (1, 0)
    incarnation = led.incarnation
    assert re.fullmatch(r"[0-9a-f]{12}", incarnation)
    assert _files(tmp_path / "ledger") == [
        "journal.0.log",
        "ledger.json.v1",
        "lock",
        "snapshot.0.json",
    ]
    cp = led.decided()
    assert cp is not None
    led.complete(cp, {"load/s": 20})  # it goes on where the old version stopped
    assert led.decide("periodic", {"load": 3}, []).id == 4
    led.close()
    led = FileLedger(tmp_path / "ledger", "orders")
    assert led.incarnation == incarnation and led.pending_batch_ids("load") == [3]
    assert led.totals() == {"load/s": 60, "audit/s": 3}


def test_a_crash_in_the_middle_of_the_conversion(tmp_path: Path) -> None:
    # before the new snapshot is in place: converted again, from the old document
    first = tmp_path / "first"
    shutil.copytree(V1, first)
    (first / "snapshot.0.json.tmp").write_bytes(b"0000")
    led = FileLedger(first, "orders")
    assert led.pending_batch_ids("load") == [2, 3] and led.run == 2
    converted = _view(led)
    led.close()
    # after the snapshot, before the old document was moved aside: the snapshot wins
    second = tmp_path / "second"
    shutil.copytree(first, second)
    shutil.copy(V1 / "ledger.json", second / "ledger.json")
    (second / "ledger.json.v1").unlink()
    led = FileLedger(second, "orders")
    assert _view(led) == converted  # same incarnation: not converted a second time
    assert "ledger.json" not in _files(second) and "ledger.json.v1" in _files(second)


def test_read_ledger_of_a_format_1_directory_changes_nothing(tmp_path: Path) -> None:
    shutil.copytree(V1, tmp_path / "ledger")
    doc = read_ledger(tmp_path)
    assert doc is not None
    assert doc["pending"]["load"].keys() == {"2", "3"} and doc["run"] == 2
    assert doc["incarnation"] is None
    assert "savepoint" in format_status(doc)
    assert _files(tmp_path / "ledger") == ["ledger.json"]


def test_a_format_1_ledger_of_another_job_is_refused(tmp_path: Path) -> None:
    shutil.copytree(V1, tmp_path / "ledger")
    with pytest.raises(ConfigError, match="belongs to job 'orders'"):
        FileLedger(tmp_path / "ledger", "other")
    assert _files(tmp_path / "ledger") == ["ledger.json", "lock"]


# -- reading while a job runs ----------------------------------------------------------


def test_read_ledger_while_a_job_holds_the_lock(ledger_factory: LedgerBackend) -> None:
    state = ledger_factory.state_dir
    led = ledger_factory.open(compact_bytes=NEVER)
    led.begin_run()
    led.record_batch("p", 0, {"s": [_c("a", 4)]})
    led.record_batch("p", 1, {"s": [_c("b", 5)]})
    led.complete(led.decide("periodic", {"p": 0}, []), {"p/s": 4})
    led.record_abandoned(1, ["z"], "gone")
    if ledger_factory.locks:
        assert is_locked(state)
        with pytest.raises(LedgerLockedError):
            ledger_factory.open()
    doc = ledger_factory.read()
    assert doc is not None
    assert doc["job"] == "j" and doc["run"] == 1 and doc["next_checkpoint"] == 2
    assert doc["pending"] == {"p": {"1": {"s": [_c("b", 5)]}}}
    assert doc["decided"] is None and doc["finished"] == [] and doc["totals"] == {"p/s": 4}
    assert [cp["id"] for cp in doc["history"]] == [1] and doc["incarnation"] == led.incarnation
    assert [a["txns"] for a in doc["abandoned"]] == [["z"]]
    assert "p: batches 1..1 (1)" in format_status(doc)
    assert is_locked(state) or not ledger_factory.locks


def test_read_ledger_does_not_see_an_append_in_progress(tmp_path: Path) -> None:
    state = tmp_path / "state"
    led = FileLedger(state / "ledger", "j", compact_bytes=NEVER)
    led.begin_run()
    led.record_batch("p", 0, {"s": [_c("a", 4)]})
    doc = read_ledger(state)
    journal = state / "ledger" / "journal.0.log"
    with open(journal, "ab") as f:
        f.write(b'000000ff 12345678 {"op":"run"')
    assert read_ledger(state) == doc
    assert journal.stat().st_size > 0 and is_locked(state)


def test_read_ledger_follows_compactions(tmp_path: Path) -> None:
    led = FileLedger(tmp_path / "ledger", "j", compact_bytes=200)
    seen = []
    for b in range(40):
        led.record_batch("p", b, {"s": [_c(f"t{b}")]})
        doc = read_ledger(tmp_path)
        assert doc is not None
        seen.append(sorted(int(x) for x in doc["pending"]["p"]))
    assert seen == [list(range(b + 1)) for b in range(40)]
    assert led.generation > 3
    assert read_ledger(tmp_path / "nothing") is None
    assert not os.path.exists(tmp_path / "nothing")


def test_owed_batches_are_recorded_paid_and_kept(ledger_factory: LedgerBackend) -> None:
    led = ledger_factory.open(compact_bytes=300)
    led.record_owed("p", {4: {"kafka": 10}, 5: {"kafka": 7}})
    led.record_owed("p", {5: {"pg": 7}})  # another sink owed the same batch
    for b in range(20):  # compactions
        led.record_batch("q", b, {"s": [_c(f"t{b}")]})
    assert led.owed() == {"p": {4: {"kafka": 10}, 5: {"kafka": 7, "pg": 7}}}
    led.owed()["p"].clear()  # a copy
    led.record_repaid("p", 5, {"kafka": 7})
    assert led.owed() == {"p": {4: {"kafka": 10}, 5: {"pg": 7}}}
    assert led.totals() == {"p/kafka": 7}  # what was written again counts
    assert ledger_factory.read()["owed"] == {
        "p": {"4": {"kafka": {"rows": 10}}, "5": {"pg": {"rows": 7}}}
    }
    work = [_c("again", 7)]
    led.record_repaying("p", 5, {"pg": work})  # the work paying it, before it commits
    assert led.owed_work("p", 5) == {"pg": work} and led.is_owned("again")
    with pytest.raises(RuntimeError, match="not owed"):
        led.record_repaying("p", 5, {"kafka": work})
    led.close()
    led = ledger_factory.open()
    assert led.owed() == {"p": {4: {"kafka": 10}, 5: {"pg": 7}}}
    assert led.owed_work("p", 5) == {"pg": work} and led.is_owned("again")
    led.record_repaid("p", 4, {"kafka": 10})
    led.record_repaid("p", 5, {"pg": 7})
    assert led.owed() == {} and led.totals() == {"p/kafka": 17, "p/pg": 7}
    assert not led.is_owned("again")
    led.close()
    assert ledger_factory.open().owed() == {}


def _as_format_2(backend: LedgerBackend) -> None:
    """Make the closed ledger of job ``j`` look as a format-2 version left it."""
    if backend.location is None:
        directory = backend.state_dir / "ledger"
        gen = generations(directory)[0]
        doc = read_snapshot(directory, gen)
        doc["format"] = 2
        del doc["owed"]
        write_snapshot(directory, gen, doc)
        return
    where = PgLocation.parse(backend.location)
    with psycopg.connect(where.conninfo(), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(where.schema, "owed")))
        table = sql.Identifier(where.schema, "ledgers")
        conn.execute(sql.SQL("UPDATE {} SET format = 2").format(table))


def test_a_partial_debt_names_the_spark_partitions_owed(ledger_factory: LedgerBackend) -> None:
    """Format 4: a sink may owe only the lost tasks' share of a batch (the rest
    of its work of it committed); the debt names their Spark partitions, and
    reads back so after the ledger is opened again."""
    led = ledger_factory.open()
    led.record_owed("p", {1: {"s": 5, "t": 9}, 2: {"s": 7}}, {1: {"s": [3, 1]}})
    led.close()
    led = ledger_factory.open()
    assert led.owed() == {"p": {1: {"s": 5, "t": 9}, 2: {"s": 7}}}
    assert led.owed_parts("p", 1) == {"s": [1, 3]} and led.owed_parts("p", 2) == {}
    led.close()
    assert ledger_factory.read()["owed"]["p"]["1"]["s"] == {"rows": 5, "parts": [1, 3]}


def test_a_format_2_ledger_opens_as_format_4_and_an_older_version_then_refuses_it(
    ledger_factory: LedgerBackend,
) -> None:
    """Format 3 added the owed batches (recovery rule 5), format 4 the partial
    ones. A ledger of format 2 reads as owing nothing; opening it for writing
    makes it format 4, so a version that knows only format 2 refuses it
    instead of skipping a debt."""
    led = ledger_factory.open()
    led.record_batch("p", 1, {"s": [_c("t1")]})
    led.close()
    _as_format_2(ledger_factory)
    assert ledger_factory.read()["owed"] == {}  # readable as it is
    led = ledger_factory.open()
    assert led.pending_batch_ids("p") == [1] and led.owed() == {}
    led.record_owed("p", {1: {"s": 3}})
    led.close()
    doc = ledger_factory.read()
    assert doc["format"] == FORMAT == 4 and doc["owed"] == {"p": {"1": {"s": {"rows": 3}}}}
    assert 2 not in _formats_on_disk(ledger_factory)
    if ledger_factory.location is None:  # the last format-2 version itself refuses it
        old = tree_at(LAST_FORMAT_2, ledger_factory.state_dir.parent / "format2")
        opening = (
            "from lifecycle.state.file_ledger import FileLedger; "
            f"FileLedger({str(ledger_factory.state_dir / 'ledger')!r}, 'j')"
        )
        refused = subprocess.run(
            [sys.executable, "-c", opening],
            cwd=old,
            env={**os.environ, "PYTHONPATH": str(old)},
            capture_output=True,
            text=True,
        )
        assert refused.returncode != 0 and "unknown ledger format 4" in refused.stderr, (
            refused.stderr[-2000:]
        )


LAST_FORMAT_2 = "9e4b99a"
"""the last commit whose ledger is of format 2"""


def _formats_on_disk(backend: LedgerBackend) -> set[int]:
    """The formats the stored ledger says it has: its snapshots', or its row's."""
    if backend.location is None:
        directory = backend.state_dir / "ledger"
        return {int(read_snapshot(directory, g)["format"]) for g in generations(directory)}
    where = PgLocation.parse(backend.location)
    with psycopg.connect(where.conninfo(), autocommit=True) as conn:
        table = sql.Identifier(where.schema, "ledgers")
        return {r[0] for r in conn.execute(sql.SQL("SELECT format FROM {}").format(table))}
