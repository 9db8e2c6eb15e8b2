"""What the PostgreSQL ledger's role must be allowed, and the check of it
when the ledger opens.

The ledger's role (the ledger URI's user) needs, with its tables created
beforehand by an admin (:func:`setup_sql` gives the statements):

* the database: CONNECT;
* the ledger's schema (``twophase_ledger``, ``?schema=`` for another): USAGE;
* on its tables, what the ledger's statements (:class:`~lifecycle.state.pg_schema.Statements`)
  do to each (:data:`TABLES`): SELECT on all of them (the ledger is loaded
  when it opens), INSERT on all, UPDATE where a row changes in place
  (``ledgers``: the fencing token, ``SELECT ... FOR UPDATE``; pending
  batches, checkpoints, pipelines, totals, digests, debts) and DELETE where
  rows go (committed batches, trimmed history and digests, replaced sink
  settings, paid debts).

Foreign keys and identity columns need nothing more (PostgreSQL checks the
former as the tables' owner; the latter's sequences are the tables' own),
and neither do advisory locks or ``pg_locks``. Without an admin, the ledger
creates its tables itself when missing: it needs CREATE on its schema (then
the role owns them), and on the database when the schema is missing too.

:func:`check` runs when the ledger opens, before it creates or reads
anything (:mod:`lifecycle.state.pg_ledger`), in one query
(:func:`sinks.postgres.grants.check`): a missing privilege is a
:class:`~sinks.errors.ConfigError` naming each one with its ``GRANT``.
"""

from __future__ import annotations

import getpass

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from lifecycle.state.pg_location import PgLocation
from lifecycle.state.pg_schema import DDL
from sinks.errors import ConfigError
from sinks.postgres import grants
from sinks.postgres.grants import Grant

_ALL = ("SELECT", "INSERT", "UPDATE", "DELETE")
TABLES: dict[str, tuple[str, ...]] = {
    "ledgers": ("SELECT", "INSERT", "UPDATE"),
    "pending": _ALL,
    "checkpoints": _ALL,
    "pipelines": ("SELECT", "INSERT", "UPDATE"),
    "finished": ("SELECT", "INSERT"),
    "totals": ("SELECT", "INSERT", "UPDATE"),
    "committed_digests": _ALL,
    "abandoned": ("SELECT", "INSERT"),
    "sinks": ("SELECT", "INSERT", "DELETE"),
    "owed": _ALL,
}
"""The privileges the ledger's statements need on each of its tables."""


def required(schema: str, database: str) -> list[Grant]:
    """The least privileges of the ledger's role, for the ledger in ``schema``
    of ``database``, its tables created by an admin (module docstring)."""
    needs = [
        Grant("CONNECT", "database", (database,), "every connection of the ledger"),
        Grant("USAGE", "schema", (schema,), "the ledger's tables are in it", created=True),
    ]
    for table, privileges in TABLES.items():
        why = f"the ledger's {table}"
        needs += [
            Grant(p, "table", (schema, table), why, created=True, schema_created=True)
            for p in privileges
        ]
    return needs


def _database(where: PgLocation) -> str:
    return grants.database(where.conninfo())


def setup_sql(location: str, role: str) -> list[str]:
    """What an admin runs so that ``role`` keeps the ledger of ``location``
    (a ledger URI) with the least privileges: the schema and tables, then the
    grants (:func:`required`)."""
    where = PgLocation.parse(location)
    s = grants.quote(where.schema)
    ddl = [" ".join(sql.SQL(d).format(s=sql.SQL(s)).as_string().split()) + ";" for d in DDL]
    return ddl + grants.statements(required(where.schema, _database(where)), role)


def _where(where: PgLocation) -> str:
    return f"the ledger at {where.display()}"


def connect_refused(where: PgLocation) -> ConfigError:
    """The error of a connection refused for want of CONNECT on the database."""
    role = conninfo_to_dict(where.conninfo()).get("user") or getpass.getuser()
    grant = required(where.schema, _database(where))[:1]
    found = grants.denied(_where(where), grant, str(role), what="the ledger", error=ConfigError)
    assert isinstance(found, ConfigError)
    return found


def check(conn: psycopg.Connection, where: PgLocation) -> None:
    """Raise :class:`ConfigError` naming every privilege of :func:`required`
    the connected role lacks (module docstring)."""
    grants.check(
        conn,
        _where(where),
        required(where.schema, _database(where)),
        what="the ledger",
        error=ConfigError,
    )
