"""The driver's connections for a PostgreSQL sink's commits, kept between uses.

A checkpoint's commit opens a connection to find its prepared transactions,
then more to spread ``COMMIT PREPARED`` over (``commit_connections``), and the
sweep after it one more: each a new server process, about 5 ms on an idle
machine and several times that under load, on the path from a batch's end to
its rows being readable and from the end of input to the job's exit.
:class:`KeptConnections` hands out an idle connection of an earlier use
instead, when there is one. The rules:

* a connection goes back only when its user returned without an error and it
  sits idle (no transaction open, not closed); any other is closed, so a
  connection in doubt is never used again;
* at most ``most`` wait idle; the rest are closed;
* a connection handed out again takes the new user's ``application_name``
  (what ``pg_stat_activity`` shows operators);
* a kept connection the server dropped meanwhile (a restart) fails its first
  statement like any dropped connection, and every idle one is closed with it
  (they are most likely gone too): the commit's retry opens a new one;
* :meth:`KeptConnections.close` closes every idle connection (the sink's
  ``close``), and every connection handed out before it when it comes back
  (a commit thread given up on may return one late).

Only the driver keeps connections; the sink's executor side never does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
from psycopg.pq import TransactionStatus


class KeptConnections:
    """Connections from ``connect(application_name)``, reused (module docstring)."""

    def __init__(self, connect: Callable[[str], psycopg.Connection], most: int) -> None:
        self._connect = connect
        self._most = most
        self._idle: list[psycopg.Connection] = []
        self._lock = threading.Lock()
        self._generation = 0  # moved on by close()

    @contextmanager
    def connection(self, application_name: str) -> Iterator[psycopg.Connection]:
        """An autocommit connection for one use (a ``with`` block)."""
        generation = self._generation
        conn = self._take()
        if conn is None:
            conn = self._connect(application_name)
        elif conn.info.parameter_status("application_name") != application_name:
            try:
                conn.execute("SELECT set_config('application_name', %s, false)", [application_name])
            except BaseException:
                conn.close()
                self._drop_idle()
                raise
        returned = False
        try:
            yield conn
            returned = True
        finally:
            if returned and self._reusable(conn):
                with self._lock:
                    if len(self._idle) < self._most and generation == self._generation:
                        self._idle.append(conn)
                        conn = None
            elif conn.broken or conn.closed:
                self._drop_idle()  # the server went away: the idle ones are gone too
            if conn is not None:
                conn.close()

    def close(self) -> None:
        """Close every idle connection, and those in use when they come back."""
        with self._lock:
            self._generation += 1
        self._drop_idle()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self) -> psycopg.Connection | None:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if self._reusable(conn):
                    return conn
                conn.close()
        return None

    @staticmethod
    def _reusable(conn: psycopg.Connection) -> bool:
        return not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE
