"""Where a keyed PostgreSQL write's time goes: the limit's statements against the
sink's, one step added at a time, without Spark.

Each step upserts ``--rows`` rows (half of them ids already in the target, as
``pg_throughput.py --upsert``) into a table with a primary key, staging them
first (filled by ``INSERT ... SELECT generate_series``, the same for every
step, standing in for the COPY):

* ``temp, autocommit``: the limit, a ``TEMP`` table, then ``INSERT ... ON
  CONFLICT (id) DO UPDATE`` from it;
* ``unlogged, one transaction``: an ``UNLOGGED`` table created, merged from
  and dropped in one transaction (what ``PREPARE TRANSACTION`` allows: it
  refuses temporary objects), committed;
* ``+ savepoint``: the merge under a savepoint, as :mod:`sinks.postgres.upsert`
  runs it (to tell two rows of one key from a conflict);
* ``+ prepare``: ``PREPARE TRANSACTION``, then ``COMMIT PREPARED`` (the sink's
  two phases).

Steps alternate; medians of ``--repeat`` runs, each on a fresh target.

    python benchmarks/pg_upsert_cost.py [--rows N] [--repeat R] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from benchmarks.pg_throughput import COLUMNS, KEYED_DDL, UPSERT, prefill  # noqa: E402

STEPS = ("temp, autocommit", "unlogged, one transaction", "+ savepoint", "+ prepare")
FILL = (
    "INSERT INTO {stage} ({cols}) SELECT i, 'customer-' || (i % 1000), i * 0.25, i % 50 "
    "FROM generate_series({first}, {last}) AS i"
)


def _target(conn: psycopg.Connection, rows: int) -> str:
    """A keyed table holding the first half of the ids, as ``pg_throughput --upsert``."""
    t = f"upsert_cost_{uuid.uuid4().hex[:8]}"
    conn.execute(KEYED_DDL.format(t=t))
    prefill(conn, t, rows, 0.5)
    return t


def _step(dsn: str, step: str, t: str, rows: int) -> float:
    fill = FILL.format(stage="stage", cols=COLUMNS, first=0, last=rows - 1)
    t0 = time.perf_counter()
    if step == STEPS[0]:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f"CREATE TEMP TABLE stage (LIKE {t})")
            c.execute(fill)
            c.execute(UPSERT.format(t=t, stage="stage"))
        return time.perf_counter() - t0
    gid = f"upsert-cost-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("BEGIN")
        c.execute(f"CREATE UNLOGGED TABLE stage AS SELECT {COLUMNS} FROM {t} WITH NO DATA")
        c.execute(fill)
        if step != STEPS[1]:
            c.execute("SAVEPOINT s")
        c.execute(UPSERT.format(t=t, stage="stage"))
        if step != STEPS[1]:
            c.execute("RELEASE SAVEPOINT s")
        c.execute("DROP TABLE stage")
        if step == STEPS[3]:
            c.execute(f"PREPARE TRANSACTION '{gid}'")
            c.execute(f"COMMIT PREPARED '{gid}'")
        else:
            c.execute("COMMIT")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000, help="rows a step (one task's share)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dsn", help="PostgreSQL DSN (default: start a private server)")
    args = ap.parse_args()
    server = None
    dsn = args.dsn
    if dsn is None:
        from lifecycle.testing.postgres_server import PostgresServer

        server = PostgresServer(settings={"max_prepared_transactions": "10"})
        server.start()
        dsn = server.dsn()
    try:
        times: dict[str, list[float]] = {s: [] for s in STEPS}
        with psycopg.connect(dsn, autocommit=True) as admin:
            for r in range(-1, args.repeat):  # round -1 warms the server up
                for step in STEPS:
                    t = _target(admin, args.rows)
                    secs = _step(dsn, step, t, args.rows)
                    n, ids = admin.execute(
                        f"SELECT count(*), count(DISTINCT id) FROM {t}"
                    ).fetchone()  # type: ignore[misc]
                    want = args.rows
                    assert (n, ids) == (want, want), f"{step}: {n} rows, {ids} ids, want {want}"
                    admin.execute(f"DROP TABLE {t}")
                    if r >= 0:
                        times[step].append(secs)
        print(f"{args.rows:,} rows a step (half new), median of {args.repeat}")
        print("| step | ms | vs the limit |")
        print("| --- | ---: | ---: |")
        limit = statistics.median(times[STEPS[0]])
        for step in STEPS:
            med = statistics.median(times[step])
            print(f"| {step} | {med * 1000:,.0f} | {limit / med:.2f} |")
        return 0
    finally:
        if server is not None:
            server.cleanup()


if __name__ == "__main__":
    sys.exit(main())
