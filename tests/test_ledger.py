"""The ledger: persistence, crash atomicity, locking, compaction."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lifecycle.ledger import HISTORY, FileLedger, LedgerLockedError
from sinks.errors import ConfigError


def _c(name: str, rows: int = 1) -> dict[str, object]:
    return {"txn": name, "rows": rows}


def test_round_trip_and_runs(tmp_path: Path) -> None:
    led = FileLedger(tmp_path, "j")
    assert led.begin_run() == 1
    led.record_batch("p", 0, {"s": [_c("a"), _c("b")]})
    led.record_batch("p", 1, {"s": []})
    led.close()
    led = FileLedger(tmp_path, "j")
    assert led.begin_run() == 2
    assert led.pending() == {"p": {0: {"s": [_c("a"), _c("b")]}, 1: {"s": []}}}
    assert led.owned_txns() == {"a", "b"}


def test_decide_complete_moves_batches_to_history(tmp_path: Path) -> None:
    led = FileLedger(tmp_path, "j")
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


def test_a_decision_survives_reopening(tmp_path: Path) -> None:
    led = FileLedger(tmp_path, "j")
    led.record_batch("p", 0, {"s": [_c("a")]})
    cp = led.decide("periodic", {"p": 0}, [])
    led.close()
    assert FileLedger(tmp_path, "j").decided() == cp


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


def test_second_opener_is_refused(tmp_path: Path) -> None:
    led = FileLedger(tmp_path, "j")
    with pytest.raises(LedgerLockedError, match="in use by another process"):
        FileLedger(tmp_path, "j")
    led.close()
    FileLedger(tmp_path, "j").close()


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
from lifecycle.ledger import FileLedger
led = FileLedger(sys.argv[1], "j", compact_bytes=8192)  # compactions happen under the kill
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
    tmp_path: Path, delay: float
) -> None:
    """A real process writes the ledger in a loop and is SIGKILLed mid-stream."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)],
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
    led = FileLedger(tmp_path, "j")  # loads: never a torn record
    last = acked[-1]
    pending = led.pending().get("p", {})
    committed_upto = max((cp.cut["p"] for cp in led.history()), default=-1)
    for b in range(committed_upto + 1, last + 1):
        assert b in pending, f"acknowledged batch {b} is missing after the crash"
