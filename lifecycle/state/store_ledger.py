"""The embedded ledger in a ``state_dir`` on HDFS or S3: snapshots and a journal
of one object per change, each created only if its name is free.

The file ledger (:mod:`lifecycle.state.file_ledger`) appends to a local file
under ``flock``; HDFS and S3 have no lock a crashed driver releases, and S3
cannot append. Here every write is a :meth:`StateStore.create
<lifecycle.state.store_interface.StateStore.create>` that fails when its name
exists (S3's conditional PUT; on HDFS, a rename the NameNode refuses; on a
local file system, ``link(2)``), so a name can be written once, by one
driver. Files of ``<state_dir>/ledger/``:

* ``snapshot.<g>.json``: the whole state as of generation ``g`` (one frame of
  :mod:`lifecycle.state.frames`);
* ``journal.<g>/<n>``: the ``n``-th change since that snapshot (``n`` from 1,
  twelve digits), one frame holding ``{"writer", "op"}``; the last may be a
  **seal** (``{"writer", "seal": g + 1}``) instead, which ends the generation.

**Fencing, the rules.**

1. A change is durable once record ``n`` is created and the generation is
   still the ledger's (rule 3); it is applied in memory only then. A driver
   writes ``n + 1`` after ``n``, never a name twice.
2. Two drivers that opened the ledger at the same record race for the next
   name: one creates it, the other is refused and stops
   (:class:`~lifecycle.state.protocol.LedgerLostError`): it writes nothing
   more, so a driver never acts on a state another driver changed. A job's
   first change after it opens (its ``run`` record) is this race, which is how
   a restarted driver fences a zombie of the previous one.
3. Compacting seals the journal first (the next name: it orders the
   compaction against any other writer of the generation, rule 2), then
   creates the next generation's snapshot (its name too), then removes the old
   generation. Once removed, its names are free again, so a driver that still
   writes to the old journal could create one: after every record it creates,
   a driver lists the ledger, and a snapshot later than its generation means
   the record may not be seen (it is if the newer driver read it before it
   compacted), so the driver stops with the change's fate unknown, as a
   driver that lost the ledger does (a later snapshot is only ever removed for
   a later one still). A crash after the seal leaves a sealed
   generation, which the next open compacts before anything else.
4. A create whose answer was lost (a NameNode restart, a dropped connection)
   is tried again; finding the name holding exactly its own bytes (the writer
   id makes them unique) it has succeeded. Any other failure of a change
   leaves the ledger unusable until it is opened again, so that no later
   change follows a record whose fate is unknown.

Opening reads the highest snapshot and its journal's records in order; a gap
or a damaged record is damage, not a crash (objects appear whole). There is no
lock file: ``twophase status`` tells a running job by its heartbeat.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import secrets
from typing import Any

from lifecycle.state.base import StateLedger
from lifecycle.state.frames import CorruptLedgerError, encode, scan
from lifecycle.state.model import DIGEST_WINDOW, FORMAT, HISTORY, READABLE_FORMATS, LedgerState, Op
from lifecycle.state.protocol import LedgerLostError, new_incarnation
from lifecycle.state.store_interface import StateStore
from sinks.errors import ConfigError

log = logging.getLogger("lifecycle.ledger")

DIR = "ledger"
COMPACT_BYTES = 256 << 10
"""The journal is never compacted below this size ..."""
COMPACT_RECORDS = 1000
"""... and always at this many records (opening reads each one)."""

_SNAPSHOT = re.compile(r"^snapshot\.(\d+)\.json$")
_JOURNAL = re.compile(r"^journal\.(\d+)$")
_RECORD = re.compile(r"^\d{12}$")

__all__ = ["StoreLedger", "holds_ledger", "read_store_ledger"]


def _snapshot(gen: int) -> str:
    return f"{DIR}/snapshot.{gen}.json"


def _journal(gen: int) -> str:
    return f"{DIR}/journal.{gen}"


def _record(gen: int, n: int) -> str:
    return f"{_journal(gen)}/{n:012d}"


def _numbered(store: StateStore, pattern: re.Pattern[str]) -> list[int]:
    found = (pattern.match(name) for name in store.list(DIR))
    return sorted((int(m[1]) for m in found if m is not None), reverse=True)


def holds_ledger(store: StateStore) -> bool:
    """Whether ``store`` holds a ledger of this kind (a snapshot or a journal)."""
    return bool(_numbered(store, _SNAPSHOT) or _numbered(store, _JOURNAL))


def _frame(store: StateStore, rel: str) -> dict[str, Any]:
    """The one frame of the object ``rel``, decoded."""
    data = store.read(rel)
    if data is None:
        raise FileNotFoundError(store.uri(rel))
    found = scan(data, store.uri(rel))
    if len(found.records) != 1 or found.end != len(data):
        raise CorruptLedgerError(store.uri(rel), found.end, "an incomplete record")
    doc: dict[str, Any] = json.loads(found.records[0][1])
    return doc


def _read_generation(store: StateStore, gen: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Generation ``gen``'s snapshot document and its journal's records, in order."""
    doc = _frame(store, _snapshot(gen))
    if doc.get("format") not in READABLE_FORMATS:
        where = store.uri(_snapshot(gen))
        raise ConfigError(f"{where}: unknown ledger format {doc.get('format')!r}")
    names = [n for n in store.list(_journal(gen)) if _RECORD.match(n)]
    records = []
    for expected, name in enumerate(names, start=1):
        if int(name) != expected:
            raise CorruptLedgerError(
                store.uri(_journal(gen)), expected, f"record {expected} is missing (found {name})"
            )
        records.append(_frame(store, _record(gen, expected)))
    for i, rec in enumerate(records[:-1]):
        if "seal" in rec:
            raise CorruptLedgerError(store.uri(_record(gen, i + 1)), 0, "a seal before the end")
    return doc, records


def _replay(state: LedgerState, records: list[dict[str, Any]]) -> bool:
    """Apply the records' operations; whether the last one is a seal."""
    for rec in records:
        if "seal" not in rec:
            state.apply(rec["op"])
    return bool(records) and "seal" in records[-1]


def read_store_ledger(store: StateStore) -> dict[str, Any] | None:
    """The ledger document in ``store`` for display, without writing (the job
    may be running); None when there is none. See
    :func:`lifecycle.ledger.read_ledger` for its keys."""
    for _ in range(50):
        gens = _numbered(store, _SNAPSHOT)
        if not gens:
            return None
        try:
            doc, records = _read_generation(store, gens[0])
        except (FileNotFoundError, CorruptLedgerError):
            if _numbered(store, _SNAPSHOT)[:1] == gens[:1]:
                raise  # damage, not a compaction under the read
            continue
        if _numbered(store, _SNAPSHOT)[:1] != gens[:1]:
            continue  # a newer generation began: its journal may be gone
        state = LedgerState.from_doc(doc)
        _replay(state, records)
        return state.to_doc()
    raise RuntimeError(f"{store.uri(DIR)}: the ledger changed generation under every read")


class StoreLedger(StateLedger):
    """The embedded ledger in ``<state_dir>/ledger/`` of a store with atomic
    creates (module docstring). Thread-safe within one process."""

    def __init__(
        self,
        store: StateStore,
        job: str,
        *,
        history: int = HISTORY,
        digest_window: int = DIGEST_WINDOW,
        compact_bytes: int = COMPACT_BYTES,
        compact_records: int = COMPACT_RECORDS,
    ) -> None:
        if history < 0 or digest_window < 0:
            raise ValueError("history and digest_window must not be negative")
        super().__init__()
        self.store = store
        self._writer = secrets.token_hex(8)
        self._compact_bytes = compact_bytes
        self._compact_records = compact_records
        self._unusable: str | None = None
        self._open(job, history, digest_window)

    @property
    def where(self) -> str:
        return self.store.uri(DIR)

    def _open(self, job: str, history: int, digest_window: int) -> None:
        gens = _numbered(self.store, _SNAPSHOT)
        if not gens:
            if _numbered(self.store, _JOURNAL):
                raise CorruptLedgerError(self.where, 0, "a journal without its snapshot")
            state = LedgerState(
                job, new_incarnation(), history=history, digest_window=digest_window
            )
            try:
                self.store.create(_snapshot(0), self._encode(state.to_doc()))
            except FileExistsError:  # another driver created it first: read theirs
                return self._open(job, history, digest_window)
            gens = [0]
        gen = gens[0]
        try:
            doc, records = _read_generation(self.store, gen)
        except (FileNotFoundError, CorruptLedgerError):
            if _numbered(self.store, _SNAPSHOT)[:1] == gens[:1]:
                raise  # damage, not another driver's compaction under the read
            return self._open(job, history, digest_window)
        if doc["job"] != job:
            raise ConfigError(
                f"{self.where} belongs to job {doc['job']!r}, not {job!r}: use another state_dir"
            )
        self._state = LedgerState.from_doc(doc)
        sealed = _replay(self._state, records)
        self._gen, self._next = gen, len(records) + 1
        self._snapshot_bytes = len(self._encode(doc))
        self._bytes = 0
        self._remove_older(gen)
        if sealed:  # a crash between a seal and the next snapshot (rule 3)
            self._start_generation(gen + 1)
        elif doc.get("format") != FORMAT:  # in the current format, which a version before refuses
            self._compact()
        if (self._state.history_limit, self._state.digest_window) != (history, digest_window):
            self._change({"op": "limits", "history": history, "digests": digest_window})

    def _encode(self, doc: dict[str, Any]) -> bytes:
        return encode(json.dumps(doc, separators=(",", ":")).encode())

    def _create(self, rel: str, doc: dict[str, Any]) -> int:
        """Create ``rel`` holding ``doc``; its size. The name taken: this driver
        lost the ledger (rule 2); any other failure: unusable (rule 4)."""
        data = self._encode(doc)
        try:
            self.store.create(rel, data)
        except FileExistsError:
            self._unusable = f"another driver wrote {self.store.uri(rel)} first"
            raise LedgerLostError(
                f"the ledger in {self.where} was changed by another driver ({self._unusable}): "
                "this one stops; is the job running twice on one state_dir?"
            ) from None
        except BaseException as e:
            self._unusable = f"writing {self.store.uri(rel)} failed ({e!r})"
            raise
        return len(data)

    def _append(self, doc: dict[str, Any]) -> int:
        """Create the next record holding ``doc``; its size (rules 1 to 4)."""
        rel = _record(self._gen, self._next)
        size = self._create(rel, doc)
        try:
            later = [g for g in _numbered(self.store, _SNAPSHOT) if g > self._gen]
        except BaseException as e:
            self._unusable = f"checking {self.store.uri(rel)} failed ({e!r}): its fate is unknown"
            raise
        if later:
            self._unusable = f"generation {self._gen} ended (snapshot {max(later)} exists)"
            with contextlib.suppress(OSError):
                self.store.delete(rel)  # nobody reads that generation any more
            raise LedgerLostError(
                f"the ledger in {self.where} was compacted by another driver "
                f"({self._unusable}; whether it saw this change is unknown): this one stops; "
                "is the job running twice on one state_dir?"
            )
        self._next += 1
        return size

    def _change(self, op: Op) -> None:
        """Create the next record holding ``op``, then apply it (rules 1 to 4)."""
        payload = json.dumps(op, separators=(",", ":"))
        with self._mutex:
            if self._unusable is not None:
                raise RuntimeError(f"the ledger in {self.where} must be reopened: {self._unusable}")
            record = json.loads(payload)  # exactly what a replay will apply
            self._bytes += self._append({"writer": self._writer, "op": record})
            try:
                self._state.apply(record)
            except BaseException as e:
                self._unusable = f"a recorded change did not apply in memory ({e!r})"
                raise
            full = self._bytes >= max(self._compact_bytes, self._snapshot_bytes)
            if full or self._next > self._compact_records:
                try:
                    self._compact()
                except Exception as e:  # the change itself is durable and applied
                    log.warning(
                        "could not compact the ledger in %s; it must be reopened before "
                        "the next change: %s",
                        self.where,
                        e,
                    )

    def _compact(self) -> None:
        """Seal this generation, then start the next (rule 3)."""
        self._append({"writer": self._writer, "seal": self._gen + 1})
        self._start_generation(self._gen + 1)

    def _start_generation(self, gen: int) -> None:
        """Create generation ``gen``'s snapshot of the state; remove the older."""
        self._snapshot_bytes = self._create(_snapshot(gen), self._state.to_doc())
        self._gen, self._next, self._bytes = gen, 1, 0
        self._remove_older(gen)

    def _remove_older(self, gen: int) -> None:
        """Remove the generations before ``gen`` (best effort: the next open
        tries again)."""
        try:
            for old in _numbered(self.store, _JOURNAL):
                if old < gen:
                    self.store.delete(_journal(old))
            for old in _numbered(self.store, _SNAPSHOT):
                if old < gen:
                    self.store.delete(_snapshot(old))
        except OSError as e:
            log.warning("could not remove an older generation of %s: %s", self.where, e)

    def close(self) -> None:
        """Nothing to release (no lock); the ledger cannot change afterwards."""
        self._unusable = self._unusable or "closed"

    @property
    def generation(self) -> int:
        """The current snapshot generation (grows at every compaction)."""
        return self._gen
