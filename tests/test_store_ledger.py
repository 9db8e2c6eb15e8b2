"""The store ledger (``lifecycle/state/store_ledger.py``) on the stores it runs
on: a local directory, ``file://`` through Hadoop, and HDFS (Hadoop's
minicluster). What every ledger answers, and its records surviving a SIGKILL
at any instant, are ``test_ledger.py``'s (its ``[store]`` cases); S3 is
``test_delta_s3.py``'s, in a driver with S3A's jars.

* A create is atomic and exclusive on each store: a second writer of a name is
  refused, a retry that finds its own bytes has succeeded.
* Fencing: of two drivers that opened the ledger, the first to change it keeps
  it; the other is refused at its next change, and stays refused.
* A compaction seals the generation before it starts the next: a driver still
  writing to the old journal is refused (its name taken, or its record void
  once the generation is gone); a crash between the seal and the new snapshot
  leaves a ledger that opens whole.
* A missing record is damage, named, not skipped.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lifecycle import cli
from lifecycle.ledger import locate, open_ledger, read_ledger
from lifecycle.state.frames import CorruptLedgerError
from lifecycle.state.protocol import LedgerLostError
from lifecycle.state.store import LocalStore, open_store
from lifecycle.state.store_interface import StateStore
from lifecycle.state.store_ledger import StoreLedger, read_store_ledger


@pytest.fixture(params=["local", "file", "hdfs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    """A fresh state directory on each store."""
    if request.param == "local":
        yield LocalStore(tmp_path / "state")
        return
    if request.param == "hdfs":
        hdfs = request.getfixturevalue("twophase_hdfs")
        uri = f"{hdfs.uri}/ledgers/{uuid.uuid4().hex[:10]}"
    else:
        uri = (tmp_path / "state").resolve().as_uri()
    yield open_store(uri, request.getfixturevalue("spark"))


def _batch(led: Any, b: int) -> None:
    led.record_batch("p", b, {"s": [{"txn": f"t{b}", "rows": 1}]})


def test_a_create_is_exclusive_and_a_retry_of_it_succeeds(store: StateStore) -> None:
    store.create("x/one", b"mine")
    store.create("x/one", b"mine")  # a retry whose first answer was lost
    with pytest.raises(FileExistsError):
        store.create("x/one", b"theirs")
    assert store.read("x/one") == b"mine"
    assert store.list("x") == ["one"]  # no temporary file left beside it


def test_the_first_driver_to_change_the_ledger_keeps_it(store: StateStore) -> None:
    first = StoreLedger(store, "j")
    second = StoreLedger(store, "j")  # a restarted driver, while the first lives on
    assert second.begin_run() == 1
    with pytest.raises(LedgerLostError, match="changed by another driver"):
        _batch(first, 0)
    with pytest.raises(RuntimeError, match="must be reopened"):
        _batch(first, 1)  # refused for good, even where no name is taken
    _batch(second, 0)
    doc = read_store_ledger(store)
    assert doc is not None and doc["run"] == 1 and list(doc["pending"]["p"]) == ["0"]


def test_a_compaction_fences_a_driver_on_the_old_generation(store: StateStore) -> None:
    first = StoreLedger(store, "j", compact_records=4)
    stale = StoreLedger(store, "j", compact_records=4)
    first.begin_run()
    for b in range(4):
        _batch(first, b)  # the fourth change seals generation 0 and starts 1
    assert first.generation >= 1
    names = store.list("ledger")
    assert "journal.0" not in names and "snapshot.0.json" not in names, names
    with pytest.raises(LedgerLostError, match="compacted by another driver"):
        stale.begin_run()  # its record 1 is free again, and void
    assert "journal.0" not in store.list("ledger") or store.list("ledger/journal.0") == []
    again = StoreLedger(store, "j")
    assert again.pending_batch_ids("p") == [0, 1, 2, 3] and again.run == 1


def test_a_crash_between_a_seal_and_the_next_snapshot_opens_whole(store: StateStore) -> None:
    led = StoreLedger(store, "j")
    led.begin_run()
    _batch(led, 0)
    # what a driver killed right after sealing generation 0 leaves behind
    store.create("ledger/journal.0/000000000003", _sealed(1))
    again = StoreLedger(store, "j")
    assert again.generation == 1 and again.run == 1 and again.pending_batch_ids("p") == [0]
    with pytest.raises(LedgerLostError):
        _batch(led, 1)  # the killed driver's zombie: the seal took its name
    _batch(again, 1)
    assert StoreLedger(store, "j").pending_batch_ids("p") == [0, 1]


def _sealed(gen: int) -> bytes:
    import json

    from lifecycle.state.frames import encode

    return encode(json.dumps({"writer": "killed", "seal": gen}).encode())


def test_a_missing_record_is_damage_named_not_skipped(store: StateStore) -> None:
    led = StoreLedger(store, "j")
    led.begin_run()
    _batch(led, 0)
    _batch(led, 1)
    store.delete("ledger/journal.0/000000000002")
    with pytest.raises(CorruptLedgerError, match=r"journal\.0: record 2 is missing"):
        StoreLedger(store, "j")


def test_a_uri_state_dir_keeps_its_ledger_and_twophase_finds_it(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``open_ledger`` with no location on a URI state_dir: the store ledger,
    found by ``locate``, read by ``read_ledger`` and ``twophase status``; a
    ledger elsewhere would ignore it and is refused."""
    uri = (tmp_path / "shared" / "state").resolve().as_uri()
    store = open_store(uri, spark)
    led = open_ledger(None, store, "j")
    assert isinstance(led, StoreLedger)
    led.begin_run()
    _batch(led, 0)
    assert locate(store) is store
    doc = read_ledger(store)
    assert doc is not None and doc["job"] == "j" and doc["run"] == 1
    from sinks.errors import ConfigError

    with pytest.raises(ConfigError, match="holds its own ledger"):
        open_ledger(tmp_path / "elsewhere", store, "j")
    capsys.readouterr()
    assert cli.main(["status", uri]) in (0, 3)
    out = capsys.readouterr().out
    assert "job j" in out and "p: batches 0..0 (1)" in out, out


def test_a_second_start_while_the_job_beats_is_refused(spark: Any, tmp_path: Path) -> None:
    """No lock file: a start while the job's heartbeat is alive (here, this
    very process's) is refused as a locked file ledger is, naming why; once
    the run has ended, the ledger opens."""
    from lifecycle import heartbeat
    from lifecycle.state.protocol import LedgerLockedError

    store = open_store((tmp_path / "state").resolve().as_uri(), spark)
    open_ledger(None, store, "j").begin_run()
    beat = heartbeat.Heartbeat(store, {"job": "j"}, lambda: "running", every=60)
    beat.start()
    try:
        with pytest.raises(
            LedgerLockedError, match=rf"in use: its job is running \(pid {os.getpid()}"
        ):
            open_ledger(None, store, "j")
    finally:
        beat.end("finished")
    assert open_ledger(None, store, "j").run == 1


def test_two_writers_of_each_name_leave_exactly_one_winner(store: StateStore) -> None:
    """Two threads create the same 20 names at once, each with its own bytes:
    for every name exactly one is told it created it, and the name holds that
    one's bytes (Hadoop's rename on ``file://`` replaces or checks, then
    renames: the create there is the local ``link(2)``; HDFS renames a try's
    own temporary file)."""
    import threading

    names = [f"race/{i:03d}" for i in range(20)]
    won: dict[str, list[str]] = {n: [] for n in names}
    start = threading.Barrier(2)

    def writer(me: str) -> None:
        start.wait()
        for name in names:
            try:
                store.create(name, me.encode())
                won[name].append(me)
            except FileExistsError:
                pass

    threads = [threading.Thread(target=writer, args=(w,)) for w in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for name in names:
        assert len(won[name]) == 1, (name, won[name])
        assert store.read(name) == won[name][0].encode()
    assert sorted(store.list("race")) == [n.split("/")[1] for n in names]


def test_a_state_dir_that_ran_without_its_own_ledger_is_not_given_a_new_one(
    spark: Any, tmp_path: Path
) -> None:
    """A URI state_dir whose earlier runs kept their ledger elsewhere (``ledger=``
    a directory: the URI records nothing of it) is refused a new ledger of
    its own: it would ignore what the other one recorded."""
    from sinks.errors import ConfigError

    store = open_store((tmp_path / "state").resolve().as_uri(), spark)
    elsewhere = open_ledger(tmp_path / "ledger-dir", store, "j")
    elsewhere.begin_run()
    elsewhere.close()
    store.write_atomic("pipelines/load/spark/commits/0", b"v1")  # Spark's checkpoint
    with pytest.raises(ConfigError, match=r"has run before .* but holds no ledger"):
        open_ledger(None, store, "j")
