"""How long a connection to PostgreSQL may take to notice that its peer is gone.

A server that vanishes without closing its sockets (host down, network cut,
firewall dropping packets) leaves a half-open connection: a call waiting for a
reply (``COMMIT PREPARED``, a ``COPY`` chunk, the ledger's write) would block for
the operating system's TCP timeout, about 15 minutes, and no retry deadline can
interrupt a blocked call. Every connection this project opens therefore asks
libpq for TCP keepalives (an idle connection whose peer does not answer three
probes fails) and ``tcp_user_timeout`` (data sent and not acknowledged fails the
connection). Both are answered by a live server's kernel, so a slow statement is
never cut short, only a dead peer is noticed.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

DEFAULT_BOUND = 30.0
"""seconds within which a dead peer is noticed, at most"""


def dead_peer_options(conninfo: str, within: float = DEFAULT_BOUND) -> dict[str, Any]:
    """libpq connection options that notice a dead peer in about ``within``
    seconds (at least 3, at most :data:`DEFAULT_BOUND`); any of them that
    ``conninfo`` sets itself is left to it."""
    bound = max(3.0, min(DEFAULT_BOUND, within))
    idle = max(1, int(bound / 3))
    interval = max(1, int((bound - idle) / 4))
    given = conninfo_to_dict(conninfo)
    options = {
        "keepalives": 1,
        "keepalives_idle": idle,
        "keepalives_interval": interval,
        "keepalives_count": 3,
        "tcp_user_timeout": int(bound * 1000),
    }
    return {k: v for k, v in options.items() if k not in given}


def connect(
    dsn: str, application_name: str, *, connect_timeout: float, commit_timeout: float
) -> psycopg.Connection:
    """An autocommit connection that notices a dead server within a third of
    ``commit_timeout`` (at most :data:`DEFAULT_BOUND`), so a half-open
    connection cannot outlast a commit's retries."""
    return psycopg.connect(
        dsn,
        autocommit=True,
        connect_timeout=max(1, int(connect_timeout)),
        application_name=application_name,
        **dead_peer_options(dsn, commit_timeout / 3),
    )
