"""Privileges a role needs in PostgreSQL, and the check of them in one query.

A :class:`Grant` is one privilege on a database, a schema or a table, with why
it is needed and the ``GRANT`` statement that gives it. :func:`check` asks the
server what the connected role may do (``has_database_privilege``,
``has_schema_privilege``, ``has_table_privilege``, objects looked up in the
catalogs, which need no privilege) and raises an error naming every missing
one at once. An object the job creates when it is missing (a table of the
sink's markers, the ledger's tables, their schema) needs CREATE where it will
be instead. The sink's list is :mod:`sinks.postgres.access`; the PostgreSQL
ledger's, :mod:`lifecycle.state.pg_access`.
"""

from __future__ import annotations

import getpass
from collections.abc import Sequence
from dataclasses import dataclass, replace

import psycopg
from psycopg.conninfo import conninfo_to_dict

from sinks.errors import PreflightError

DOCS = "docs/sinks/postgres.md, 'Least grants and TLS'"
_KINDS = {"database": "DATABASE", "schema": "SCHEMA", "table": "TABLE"}


def quote(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True)
class Grant:
    """One privilege the role needs: ``privilege`` on the ``kind``
    (``database``, ``schema`` or ``table``) named ``name`` (``(database,)``,
    ``(schema,)`` or ``(schema, table)``)."""

    privilege: str
    kind: str
    name: tuple[str, ...]
    why: str
    created: bool = False
    """the job creates the object when it is missing (then it needs CREATE
    on where it lives instead: :meth:`creator`)"""
    schema_created: bool = False
    """(a table the job creates) the job creates its schema too when missing"""

    @property
    def object(self) -> str:
        """The object, quoted: ``"twophase"."progress"``."""
        return ".".join(map(quote, self.name))

    def statement(self, role: str) -> str:
        """The ``GRANT`` statement that gives it to ``role``."""
        return f"GRANT {self.privilege} ON {_KINDS[self.kind]} {self.object} TO {quote(role)};"

    def creator(self) -> Grant:
        """What creating the object needs: CREATE on its schema (a table) or
        on the database (a schema)."""
        what = ".".join(self.name)
        if self.kind == "table":
            why = f"the job creates the table {what} when it is missing"
            return Grant("CREATE", "schema", self.name[:1], why, created=self.schema_created)
        return Grant("CREATE", "database", ("",), f"the job creates the schema {what}")

    def __str__(self) -> str:
        return f"{self.privilege} on {self.kind} {'.'.join(self.name)}"


def database(dsn: str) -> str:
    """The database a DSN names (libpq's default: the user's name)."""
    info = conninfo_to_dict(dsn)
    return str(info.get("dbname") or info.get("user") or "")


def statements(grants: Sequence[Grant], role: str) -> list[str]:
    """``GRANT`` statements giving ``grants`` to ``role``, one per object."""
    by_object: dict[tuple[str, str], list[str]] = {}
    for g in grants:
        privileges = by_object.setdefault((g.kind, g.object), [])
        if g.privilege not in privileges:
            privileges.append(g.privilege)
    return [
        f"GRANT {', '.join(p)} ON {_KINDS[kind]} {name} TO {quote(role)};"
        for (kind, name), p in by_object.items()
    ]


_QUERY = """
SELECT current_user, current_database(), u.i, CASE u.kind
    WHEN 'database' THEN has_database_privilege(current_database(), u.privilege)
    WHEN 'schema' THEN (SELECT has_schema_privilege(n.oid, u.privilege)
                          FROM pg_namespace n WHERE n.nspname = u.s)
    WHEN 'table' THEN (SELECT has_table_privilege(c.oid, u.privilege)
                         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                        WHERE n.nspname = u.s AND c.relname = u.t)
  END
  FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[])
       WITH ORDINALITY AS u(kind, s, t, privilege, i)
"""
"""Whether the role holds each privilege; NULL when the object does not exist
(looked up in the catalogs, which need no privilege on the schema)."""


def check(
    conn: psycopg.Connection,
    where: str,
    grants: Sequence[Grant],
    *,
    what: str = "the sink",
    error: type[Exception] = PreflightError,
) -> None:
    """Raise ``error`` naming every privilege of ``grants`` the connected
    role lacks, each with the ``GRANT`` statement that gives it (one query).
    An object the job creates when missing needs CREATE where it will be
    (:meth:`Grant.creator`) instead; one it does not create is left to the
    checks that say it is missing."""
    asked: list[Grant] = []
    for g in grants:
        asked.append(g)
        while asked[-1].created:
            asked.append(asked[-1].creator())
    rows = conn.execute(
        _QUERY,
        (
            [g.kind for g in asked],
            [g.name[0] for g in asked],
            [g.name[-1] for g in asked],
            [g.privilege for g in asked],
        ),
    ).fetchall()
    if not rows:
        return
    role, db = rows[0][0], rows[0][1]
    held = {int(r[2]) - 1: r[3] for r in rows}

    def named(g: Grant) -> Grant:
        return replace(g, name=(db,)) if g.kind == "database" else g

    missing: dict[tuple[str, str, tuple[str, ...]], Grant] = {}
    i = 0
    for g in grants:
        chain = [g]
        while chain[-1].created:
            chain.append(chain[-1].creator())
        for step, need in enumerate(chain):
            state = held[i + step]
            if state is None:
                continue  # missing: what creates it is next in the chain
            if not state:
                need = named(need)
                missing.setdefault((need.privilege, need.kind, need.name), need)
            break
        i += len(chain)
    if missing:
        raise denied(where, list(missing.values()), role, what=what, error=error)


def denied(
    where: str,
    missing: Sequence[Grant],
    role: str,
    *,
    what: str = "the sink",
    error: type[Exception] = PreflightError,
) -> Exception:
    """The error naming privileges ``role`` lacks, each with why and its ``GRANT``."""
    lines = [f"  - {g}: {g.why}\n      {g.statement(role)}" for g in missing]
    return error(
        f"{where}: role {role} lacks {len(missing)} privilege(s) {what} needs ({DOCS}):\n"
        + "\n".join(lines)
    )


def connect_denied(e: psycopg.OperationalError) -> bool:
    """Whether a failed connection was refused for want of CONNECT on the database."""
    return "CONNECT privilege" in str(e)


def connect_failed(
    e: psycopg.OperationalError, where: str, dsn: str, needs: Sequence[Grant]
) -> Exception:
    """The preflight error for a connection that failed: the missing CONNECT
    (the first of ``needs``) with its ``GRANT`` when that was the cause."""
    if connect_denied(e):
        role = conninfo_to_dict(dsn).get("user") or getpass.getuser()
        return denied(where, needs[:1], str(role))
    return PreflightError(f"cannot connect to {where}: {e}".strip())
