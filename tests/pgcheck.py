"""Assertions on PostgreSQL state shared by the tests."""

from __future__ import annotations

import psycopg
from psycopg import sql

from sinks.naming import TxnName


def job_prepared(dsn: str, job: str) -> list[str]:
    """Prepared transactions of ``job`` left in the database of ``dsn``."""
    with psycopg.connect(dsn) as c:
        rows = c.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            " AND (starts_with(gid, %s) OR starts_with(gid, %s))",
            TxnName.job_prefixes(job),
        ).fetchall()
    return [r[0] for r in rows]


def rollback_prepared(dsn: str, job: str) -> None:
    """Roll back every prepared transaction of ``job``: someone else's hand,
    for tests of a transaction lost before its commit."""
    with psycopg.connect(dsn, autocommit=True) as c:
        for gid in job_prepared(dsn, job):
            c.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def assert_exactly_once(dsn: str, table: str, n: int, start: int = 0) -> None:
    """Every id in [start, start+n) is in ``table`` exactly once, and nothing else."""
    with psycopg.connect(dsn) as c:
        total, distinct, lo, hi = c.execute(
            sql.SQL("SELECT count(*), count(DISTINCT id), min(id), max(id) FROM {}").format(
                sql.Identifier(table)
            )
        ).fetchone()
        dups = c.execute(
            sql.SQL("SELECT id, count(*) FROM {} GROUP BY id HAVING count(*) > 1 LIMIT 5").format(
                sql.Identifier(table)
            )
        ).fetchall()
    assert dups == [], f"duplicated ids (id, copies): {dups}"
    assert (total, distinct) == (n, n), f"{total} rows, {distinct} distinct ids; expected {n}"
    if n:
        assert (lo, hi) == (start, start + n - 1)
