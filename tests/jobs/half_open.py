"""A commit whose connection goes half-open (run in a private network namespace).

Run as ``unshare --net python -m tests.jobs.half_open COMMIT_TIMEOUT``. It
starts a PostgreSQL server on this namespace's loopback, prepares two
transactions of a PostgreSQL sink, and commits them. After the first ``COMMIT
PREPARED`` the loopback interface is taken down: the server and its sockets live
on, but no packet moves, as when a network cuts or a host vanishes. The second
``COMMIT PREPARED`` is then waiting on a connection whose peer never answers.
The loopback comes back up, and a second commit finishes the work.

Prints one JSON object: how the first commit ended and after how long, the
rows visible after the second commit, and what is left prepared.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psycopg
import pyarrow as pa

from lifecycle.testing.postgres_server import PostgresServer
from sinks import PostgresSink, _faults
from sinks.base import JobScope, WriteContext


def _loopback(state: str) -> None:
    subprocess.run(["ip", "link", "set", "lo", state], check=True)


def main() -> None:
    commit_timeout = float(sys.argv[1])
    _loopback("up")
    out: dict[str, object] = {}
    with PostgresServer() as server:
        dsn = server.dsn()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("CREATE TABLE t (id bigint PRIMARY KEY)")
        sink = PostgresSink(dsn, "t", commit_timeout=commit_timeout, connect_timeout=2)
        schema = pa.schema([("id", pa.int64())])
        sink.preflight(schema)
        scope = JobScope("halfopen", "p", sink.sink_id, "0123456789ab")
        sink.committer().claim(scope)
        committables = []
        for part in range(2):
            w = sink.open_writer(WriteContext(scope, 1, 0, part, part), schema)
            w.write(pa.RecordBatch.from_pydict({"id": [part]}, schema=schema))
            committables.append(w.prepare())
            w.close()
        cut: dict[str, float] = {}

        def cut_network() -> None:
            _loopback("down")
            cut["at"] = time.monotonic()

        _faults.register("driver.mid_commit", cut_network)
        try:
            sink.committer().commit(committables)
            out["first"] = "committed"
        except Exception as e:
            out["first"] = f"{type(e).__name__}: {e}"
        finally:
            _faults.clear()
        out["seconds"] = round(time.monotonic() - cut["at"], 1) if cut else None
        _loopback("up")
        sink.committer().commit(committables)
        with psycopg.connect(dsn) as c:
            out["rows"] = c.execute("SELECT count(*) FROM t").fetchone()[0]
            out["prepared"] = c.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()[0]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
