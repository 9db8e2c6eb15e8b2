"""A keyed task's watch over its merge: a wait for its own batch fails in seconds.

One key of a batch is written by one task: the batch is repartitioned by the
key, or Spark's plan keeps each key in one partition already
(:mod:`lifecycle.partitioning`), or the user declares it does
(``PostgresSink(partitioned_by_key=True)``). When that is untrue, two tasks of
one batch write one key: the second one's merge waits for the first one's
prepared transaction, which commits only at the checkpoint, which waits for
the second task. Left alone it would hang until ``lock_timeout`` (minutes by
default) and fail retry after retry.

:class:`LockWatch` runs beside the merge in a thread. Once the merge has run
for :data:`FIRST_LOOK` seconds it asks the server, every :data:`EVERY` seconds,
which prepared transaction the task's backend waits for (its ungranted
``transactionid`` lock in ``pg_locks``, joined to ``pg_prepared_xacts``). When
that gid names another partition of the same run and batch of the same sink
(:mod:`sinks.naming`), no checkpoint can ever end the wait: the watch cancels
the task's statement and the writer raises
:class:`sinks.errors.KeySpansTasksError`, naming the sink, the batch, both
tasks and the declaration. Anything else is a wait that ends:

* a transaction of an *earlier* batch of the sink (it prepared the key and
  awaits the checkpoint, which comes: the batch's legitimate wait, bounded by
  ``lock_timeout``);
* another writer's transaction, or a running one (it either prepares, and the
  next look sees it, or ends; a cycle of running ones is PostgreSQL's deadlock
  to break).

The watch never fails a write by itself: if its own connection or query fails,
it logs that and stops, and the task waits as it would without it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

import psycopg

from sinks.naming import TxnName

log = logging.getLogger("sinks.postgres.lock_watch")

FIRST_LOOK = 1.0
"""seconds a merge runs before its watch first asks what it waits for"""
EVERY = 1.0
"""seconds between the watch's later looks"""

_WAITED_FOR = (
    "SELECT p.gid FROM pg_locks l JOIN pg_prepared_xacts p ON p.transaction = l.transactionid"
    " WHERE l.pid = %s AND l.locktype = 'transactionid' AND NOT l.granted"
)


def same_batch(mine: TxnName, other: TxnName) -> bool:
    """Whether ``other`` is another task's transaction of ``mine``'s batch
    (same sink scope, incarnation, run and batch; another partition)."""
    return (
        (other.job, other.pipeline, other.sink_id, other.incarnation)
        == (mine.job, mine.pipeline, mine.sink_id, mine.incarnation)
        and other.run == mine.run
        and other.batch_id == mine.batch_id
        and other.partition != mine.partition
    )


class LockWatch:
    """Watch ``conn``'s statements while the ``with`` block runs; ``holder`` is
    the gid of the same batch's transaction it waited for, when the watch
    cancelled the statement for that."""

    def __init__(
        self,
        conn: psycopg.Connection,
        name: TxnName,
        connect: Callable[[str], psycopg.Connection],
        first_look: float = FIRST_LOOK,
        every: float = EVERY,
    ) -> None:
        self._conn = conn
        self._pid = conn.info.backend_pid
        self._name = name
        self._connect = connect
        self._first_look = first_look
        self._every = every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.holder: str | None = None

    def __enter__(self) -> LockWatch:
        self._thread = threading.Thread(target=self._run, name="twophase-lock-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        if self._stop.wait(self._first_look):
            return  # the merge ended before its first look: the usual case
        try:
            with self._connect("twophase-lock-watch") as watch:
                while not self._stop.is_set():
                    gids = [g for (g,) in watch.execute(_WAITED_FOR, (self._pid,)).fetchall()]
                    for gid in gids:
                        other = TxnName.parse(gid)
                        if other is not None and same_batch(self._name, other):
                            self.holder = gid
                            self._conn.cancel_safe()
                            return
                    self._stop.wait(self._every)
        except Exception:
            log.warning("task %s: its lock watch stopped", self._name, exc_info=True)
