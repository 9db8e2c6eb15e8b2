"""The commit-marker and progress tables: created at preflight, and upgraded
when an earlier version of the sink created them (see
:mod:`sinks.postgres.progress` for what they hold)."""

from __future__ import annotations

import logging

import psycopg
from psycopg import sql

from sinks.errors import PreflightError
from sinks.postgres import catalog
from sinks.postgres.progress import PROGRESS_DDL

log = logging.getLogger("sinks.postgres")


_TABLE = (
    "EXISTS (SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
    " WHERE n.nspname = %(s)s AND c.relname = {})"
)
_FOUND = (
    "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = %(s)s), "
    + _TABLE.format("%(m)s")
    + ", "
    + _TABLE.format("'progress'")
)
"""whether the marker schema, the marker table and the progress table exist"""


def ensure(conn: psycopg.Connection, schema: str, name: str, where: str) -> bool:
    """Create the marker schema, the marker table ``schema.name`` and the
    progress table when missing (only those: ``CREATE ... IF NOT EXISTS`` would
    need CREATE on the database and the schema even when they exist, and an
    admin may have created them for a role without it); return whether the
    marker table has the audit columns (:func:`_upgrade`)."""
    markers = sql.Identifier(schema, name)
    found = conn.execute(_FOUND, {"s": schema, "m": name}).fetchone() or (False,) * 3
    statements = (
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)),
        sql.SQL(catalog.MARKER_DDL).format(marker=markers),
        sql.SQL(PROGRESS_DDL).format(progress=sql.Identifier(schema, "progress")),
    )
    for stmt in (stmt for stmt, there in zip(statements, found, strict=True) if not there):
        try:
            conn.execute(stmt)
        except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject):
            pass  # created concurrently by another job: that is fine
        except psycopg.errors.InsufficientPrivilege as e:
            raise PreflightError(
                f"{where}: cannot create the commit-marker table {schema}.{name} ({e}); create "
                "it as an admin or grant CREATE, or pass marker_table= naming a schema you "
                "may write"
            ) from e
    return _upgrade(conn, schema, name, where)


def _upgrade(conn: psycopg.Connection, schema: str, name: str, where: str) -> bool:
    """Whether the marker table has the audit columns (``batch``, ``rows``),
    adding them to a table an earlier version created, and the index that finds
    a scope's markers by gid prefix (they are kept for the audit window, so a
    scan would grow with it). Each change waits at most 2 s for its lock:
    prepared transactions of a crashed run hold the table until recovery
    settles them; then the table stays as it is (legacy paths, or a scan) until
    a later start."""
    markers = sql.Identifier(schema, name)
    have = {c.name for c in catalog.table_columns(conn, schema, name) or []}
    missing = [c for c in catalog.MARKER_LATER_COLUMNS if c not in have]
    changes: list[tuple[str, sql.Composed]] = []
    if missing:
        changes.append(
            (
                f"columns {missing} for audits",
                sql.SQL("ALTER TABLE {} ").format(markers)
                + sql.SQL(", ").join(
                    sql.SQL("ADD COLUMN IF NOT EXISTS {} bigint").format(sql.Identifier(c))
                    for c in missing
                ),
            )
        )
    index = f"{name}_gid_prefix"
    found = conn.execute(
        "SELECT 1 FROM pg_indexes WHERE schemaname = %s AND indexname = %s", (schema, index)
    ).fetchone()
    if found is None:
        changes.append(
            (
                f"the index {index}",
                sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (gid text_pattern_ops)").format(
                    sql.Identifier(index), markers
                ),
            )
        )
    complete = not missing
    for what, change in changes:
        try:
            with conn.transaction():
                conn.execute("SET LOCAL lock_timeout = '2s'")
                conn.execute(change)
            if what.startswith("columns"):
                complete = True
        except (psycopg.errors.LockNotAvailable, psycopg.errors.InsufficientPrivilege) as e:
            log.warning(
                "%s: could not add %s to the commit-marker table %s.%s (%s); the sink works "
                "without, and a later start tries again (as the table's owner: ALTER TABLE "
                "... ADD COLUMN batch bigint, ADD COLUMN rows bigint; CREATE INDEX ... (gid "
                "text_pattern_ops))",
                where,
                what,
                schema,
                name,
                str(e).strip(),
            )
        except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject):
            pass  # created concurrently by another job
    return complete
