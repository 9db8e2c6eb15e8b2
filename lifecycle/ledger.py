"""The ledger: durable, crash-atomic record of committables and checkpoints.

What it holds:

* ``incarnation``: a random id drawn when the ledger is created, never changed;
* ``run``: incremented at every start (part of transaction names, so a zombie
  task of an earlier run can never collide with a task of this run);
* ``pending``: committables of every pre-committed batch not yet committed,
  by pipeline, batch and sink, with each batch's offsets digest;
* ``decided``: the checkpoint whose commit is under way, if any. Once written,
  the decision is final: a restart finishes it before anything else;
* ``history``: the last checkpoints that committed (id, kind, cut per pipeline,
  finished pipelines, rows per sink, times), and ``finished`` pipelines;
* per pipeline, the highest batch Spark reported complete, the highest batch
  committed, and the digests of the last committed batches;
* ``totals``: rows committed per sink over the job's life; ``abandoned``:
  every abandonment recorded (``twophase abandon``), kept for the record;
* ``sinks``: every sink's non-secret settings, so that the ``twophase``
  commands can rebuild the sinks without the job's code (secrets come from the
  environment, see :mod:`sinks.settings`).

The embedded ledger (:class:`FileLedger`, in :mod:`lifecycle.state.file_ledger`)
is a snapshot and an append-only journal: each change appends one
self-checking record and fsyncs it before it takes effect, so a change costs
the same however many committables are pending, and after a crash at any
instant the ledger holds every change that returned. The journal is compacted
into a new snapshot as it grows; committed batches leave ``pending`` and the
history is trimmed, so the ledger stays small however long the job runs. A
lock file keeps a second job from opening the same ledger.
"""

from __future__ import annotations

from lifecycle.state.file_ledger import (
    FileLedger,
    LedgerLockedError,
    is_locked,
    read_ledger,
)
from lifecycle.state.files import atomic_write
from lifecycle.state.frames import CorruptLedgerError
from lifecycle.state.model import DIGEST_WINDOW, FORMAT, HISTORY, KINDS, Checkpoint, Pending

__all__ = [
    "DIGEST_WINDOW",
    "FORMAT",
    "HISTORY",
    "KINDS",
    "Checkpoint",
    "CorruptLedgerError",
    "FileLedger",
    "LedgerLockedError",
    "Pending",
    "atomic_write",
    "is_locked",
    "read_ledger",
]
