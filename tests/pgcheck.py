"""Assertions on PostgreSQL state shared by the tests."""

from __future__ import annotations

import psycopg
from psycopg import sql

from lifecycle.testing import verify


def job_prepared(dsn: str, job: str) -> list[str]:
    """Prepared transactions of ``job`` left in the database of ``dsn``."""
    return verify.prepared_postgres(dsn, job)


def rollback_prepared(dsn: str, job: str) -> None:
    """Roll back every prepared transaction of ``job``: someone else's hand,
    for tests of a transaction lost before its commit."""
    with psycopg.connect(dsn, autocommit=True) as c:
        for gid in job_prepared(dsn, job):
            c.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def assert_exactly_once(dsn: str, table: str, n: int, start: int = 0) -> None:
    """Every id in [start, start+n) is in ``table`` exactly once, and nothing else."""
    with psycopg.connect(dsn) as c:
        ids = [r[0] for r in c.execute(sql.SQL("SELECT id FROM {}").format(sql.Identifier(table)))]
    verify.assert_keys_once(f"table {table}", ids, range(start, start + n))
