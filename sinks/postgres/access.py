"""What the PostgreSQL sink's role must be allowed, and the preflight check of it.

The sink's role (the DSN's user: the driver and every executor connect as
it) needs these privileges and no others (:func:`required`, for a sink's
:meth:`~sinks.postgres.sink.PostgresSink.settings`), with the marker and
progress tables created beforehand by an admin (:func:`setup_sql` gives the
statements):

* the database: CONNECT;
* the target's schema: USAGE; the target table: INSERT (an append's binary
  COPY); a keyed write: SELECT (``ON CONFLICT`` reads the key columns),
  INSERT and UPDATE, and DELETE with ``delete_when``; a replace: SELECT (its
  ``DELETE ... WHERE replace_where`` reads the predicate's columns), INSERT
  and DELETE;
* the marker schema (``twophase``): USAGE, and CREATE for a keyed write or a
  replace: each upsert task creates its staging table there inside its
  transaction (and drops it), a replace stages its rows in a table it
  creates there;
* the commit markers (``twophase.committed_txns``): SELECT (the driver
  settles commits and audits by them), INSERT (each task writes its marker
  inside its prepared transaction), DELETE (markers past the audit window);
* the progress rows (``twophase.progress``): SELECT, INSERT (the claim of a
  scope) and UPDATE (claims, the committed batch; ``SELECT ... FOR UPDATE``);
* ``pg_catalog.pg_prepared_xacts``: SELECT (every role has it unless an
  admin revoked it from PUBLIC).

Prepared transactions need no privilege, but a server with
``max_prepared_transactions > 0`` (:mod:`sinks.postgres.capacity`), and only
the role that prepared a transaction (or a superuser) may ``COMMIT
PREPARED`` or ``ROLLBACK PREPARED`` it: the driver, the executors and the
``twophase`` commands must connect as one role. Advisory locks need nothing.

Instead of an admin, the job may create what is missing: a table it creates
needs CREATE on its schema (then the role owns it and needs no grant on it),
a schema it creates (the marker schema) CREATE on the database, and
``create_table=True`` CREATE on the target's schema. ``add_columns=True``
alters the target: the role must own it.

The sink's preflight checks them in one query
(:func:`sinks.postgres.grants.check`) and raises
:class:`~sinks.errors.PreflightError` naming every missing privilege with
the ``GRANT`` statement that gives it, all at once. The PostgreSQL ledger
lists its own (:mod:`lifecycle.state.pg_access`) and is checked the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sinks.postgres.catalog import MARKER_DDL
from sinks.postgres.grants import Grant, database, quote, statements
from sinks.postgres.progress import PROGRESS_DDL


def required(settings: Mapping[str, Any]) -> list[Grant]:
    """The least privileges of a sink's role, for the sink's ``settings()``
    (module docstring), its marker and progress tables created by an admin."""
    target = (settings["schema"], settings["table"])
    markers = tuple(str(settings["marker_table"]).rsplit(".", 1))
    keyed, replaces = bool(settings.get("key")), settings.get("replace_where") is not None
    created = bool(settings.get("create_table"))
    into = f"the target table {'.'.join(target)}"
    grants = [
        Grant("CONNECT", "database", (database(settings["dsn"]),), "every connection"),
        Grant("USAGE", "schema", target[:1], f"{into} is in it"),
    ]
    if keyed:
        grants += [
            Grant("SELECT", "table", target, "upserts: ON CONFLICT reads the key", created),
            Grant("INSERT", "table", target, "upserts insert new keys", created),
            Grant("UPDATE", "table", target, "upserts update existing keys", created),
        ]
        if settings.get("delete_when"):
            grants.append(Grant("DELETE", "table", target, "delete_when deletes keys", created))
    elif replaces:
        grants += [
            Grant("SELECT", "table", target, "the replace reads replace_where's columns", created),
            Grant("INSERT", "table", target, "the replace inserts the staged rows", created),
            Grant("DELETE", "table", target, "the replace deletes the rows it replaces", created),
        ]
    else:
        grants.append(Grant("INSERT", "table", target, "tasks COPY their rows into it", created))
    grants.append(
        Grant("USAGE", "schema", markers[:1], "the commit markers and progress are in it", True)
    )
    if keyed or replaces:
        staging = "each upsert task creates" if keyed else "the replace stages its rows in"
        grants.append(
            Grant("CREATE", "schema", markers[:1], f"{staging} a staging table there", True)
        )
    progress = (markers[0], "progress")

    def ours(privilege: str, table: tuple[str, ...], why: str) -> Grant:
        return Grant(privilege, "table", table, why, created=True, schema_created=True)

    grants += [
        ours("SELECT", markers, "the driver settles commits and audits by them"),
        ours("INSERT", markers, "each task writes its marker as it prepares"),
        ours("DELETE", markers, "markers past the audit window are deleted"),
        ours("SELECT", progress, "the sink's claim and committed batch"),
        ours("INSERT", progress, "the claim of a new scope"),
        ours("UPDATE", progress, "claims and the committed batch (FOR UPDATE)"),
        Grant(
            "SELECT",
            "table",
            ("pg_catalog", "pg_prepared_xacts"),
            "commits, recovery and the capacity check list prepared transactions",
        ),
    ]
    return grants


def setup_sql(settings: Mapping[str, Any], role: str) -> list[str]:
    """What an admin runs so that ``role`` writes as the sink of ``settings``
    with the least privileges: the marker schema and tables, then the grants
    (:func:`required`). The target table is the admin's to create."""
    schema, name = str(settings["marker_table"]).rsplit(".", 1)
    markers = f"{quote(schema)}.{quote(name)}"
    ddl = [
        f"CREATE SCHEMA IF NOT EXISTS {quote(schema)};",
        " ".join(MARKER_DDL.format(marker=markers).split()) + ";",
        f"CREATE INDEX IF NOT EXISTS {quote(name + '_gid_prefix')} ON {markers} "
        "(gid text_pattern_ops);",
        " ".join(PROGRESS_DDL.format(progress=f"{quote(schema)}.{quote('progress')}").split())
        + ";",
    ]
    return ddl + statements(required(settings), role)
