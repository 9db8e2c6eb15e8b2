"""The PostgreSQL sink's recorded settings (:mod:`sinks.settings`), both ways.

:func:`settings_of` is what a job records of its sink (never a password: the
DSN loses its ``password`` and ``sslpassword``); :func:`arguments` gives the
constructor's arguments back from a record, the password from the secrets
handed over (``TWOPHASE_<SINK>_PASSWORD`` or ``PGPASSWORD``), else wherever
libpq finds it (``~/.pgpass``, ...). Keys added after a format was first
written have defaults, so older records still build their sink.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sinks import settings
from sinks._parallel import COMMIT_CONNECTIONS

if TYPE_CHECKING:
    from sinks.postgres.sink import PostgresSink


def settings_of(sink: PostgresSink) -> dict[str, Any]:
    """The non-secret settings of ``sink``."""
    info = conninfo_to_dict(sink.dsn)
    for k in settings.DSN_SECRETS:
        info.pop(k, None)
    return {
        "kind": sink.kind,
        "v": settings.FORMAT,
        "sink_id": sink.sink_id,
        "dsn": make_conninfo("", **info),
        "schema": sink.schema,
        "table": sink.table,
        "key": list(sink.key),
        "order_by": sink.order_by,
        "delete_when": sink.rules.delete_when.settings() if sink.rules.delete_when else None,
        "partitioned_by_key": sink.partitioned_by_key,
        "create_table": sink.create_table,
        "add_columns": sink.add_columns,
        "replace_where": sink.replace_where,
        "marker_table": sink.marker_table,
        "commit_timeout": sink.commit_timeout,
        "commit_connections": sink.commit_connections,
        "connect_timeout": sink.connect_timeout,
        "lock_timeout": sink.lock_timeout_given,
    }


def arguments(s: Mapping[str, Any], secrets: Mapping[str, str]) -> tuple[str, str, dict[str, Any]]:
    """The DSN (with its password), the table and the keyword arguments that
    build the sink of the settings ``s`` again."""
    dsn = s["dsn"]
    password = settings.lookup(secrets, (settings.env_name(s["sink_id"], "password"), "PGPASSWORD"))
    if password is not None:
        dsn = make_conninfo(dsn, password=password)
    return (
        dsn,
        s["table"],
        {
            "schema": s["schema"],
            "key": s["key"],
            "order_by": s.get("order_by"),
            "delete_when": s.get("delete_when"),
            "partitioned_by_key": s.get("partitioned_by_key", False),
            "create_table": s["create_table"],
            "add_columns": s.get("add_columns", False),
            "replace_where": s.get("replace_where"),
            "sink_id": s["sink_id"],
            "marker_table": s["marker_table"],
            "commit_timeout": s["commit_timeout"],
            "commit_connections": s.get("commit_connections", COMMIT_CONNECTIONS),
            "connect_timeout": s["connect_timeout"],
            "lock_timeout": s["lock_timeout"],
        },
    )
