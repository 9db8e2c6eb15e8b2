"""Reading and preparing the target: catalog look-ups, preflight, table creation.

The sink's preflight of its table is :func:`check_target`: the table found (or
created), the DataFrame's columns matched to its columns, and from them the
schema the writers COPY.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psycopg
import pyarrow as pa
from psycopg import sql

from sinks.errors import PreflightError
from sinks.keys import KeyedWrite
from sinks.postgres.types import PgColumn, ddl_type, incompatibility, unsupported, wire_type
from sinks.postgres.values import PG_TYPE_KEY
from sinks.postgres.writer import DELETE_FLAG
from sinks.predicates import changes_between_evaluations, time_words

log = logging.getLogger("sinks.postgres")

MARKER_DDL = """
CREATE TABLE IF NOT EXISTS {marker} (
    gid text PRIMARY KEY,
    job text NOT NULL,
    prepared_at timestamptz NOT NULL DEFAULT now(),
    batch bigint,
    rows bigint
)
"""

MARKER_LATER_COLUMNS = ("batch", "rows")
"""marker columns an earlier version did not create (both bigint)"""


def table_columns(conn: psycopg.Connection, schema: str, table: str) -> list[PgColumn] | None:
    """The table's columns in order, or None when it does not exist."""
    rows = conn.execute(
        """
        SELECT a.attname, t.typname, format_type(a.atttypid, a.atttypmod),
               a.attnotnull, a.atthasdef OR a.attidentity <> '' OR a.attgenerated <> ''
          FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace
          JOIN pg_attribute a ON a.attrelid = c.oid
          JOIN pg_type t ON t.oid = a.atttypid
         WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
           AND a.attnum > 0 AND NOT a.attisdropped
         ORDER BY a.attnum
        """,
        (schema, table),
    ).fetchall()
    if not rows:
        exists = conn.execute(
            "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relname = %s",
            (schema, table),
        ).fetchone()
        if exists:
            raise PreflightError(f"{schema}.{table} exists but is not a table")
        return None
    return [PgColumn(r[0], r[1], r[2], bool(r[3]), bool(r[4])) for r in rows]


def unique_keys(conn: psycopg.Connection, schema: str, table: str) -> list[set[str]]:
    """Column sets of the table's unique indexes (usable by ON CONFLICT)."""
    rows = conn.execute(
        """
        SELECT array_agg(a.attname::text)
          FROM pg_index i
          JOIN pg_class c ON c.oid = i.indrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
          JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(i.indkey)
         WHERE n.nspname = %s AND c.relname = %s AND i.indisunique AND i.indpred IS NULL
           AND i.indexprs IS NULL
         GROUP BY i.indexrelid
        """,
        (schema, table),
    ).fetchall()
    return [set(r[0]) for r in rows]


NAMEDATALEN = 64
"""PostgreSQL keeps the first ``NAMEDATALEN - 1`` bytes of an identifier."""


def create_table(
    conn: psycopg.Connection, ident: sql.Composable, schema: pa.Schema, key: list[str], where: str
) -> None:
    """Create the table ``ident`` (``where`` in messages) with a column for every
    field of ``schema`` and a primary key on ``key``. Every field that has no
    faithful column is reported at once, before anything is created."""
    problems = _ddl_problems(schema, key)
    if problems:
        raise PreflightError(
            f"cannot create {where} from the DataFrame (create_table=True):\n  - "
            + "\n  - ".join(problems)
        )
    cols = [
        sql.SQL("{} {}{}").format(
            sql.Identifier(f.name),
            sql.SQL(ddl_type(f.type) or ""),
            sql.SQL(" NOT NULL" if f.name in key else ""),
        )
        for f in schema
    ]
    if key:
        keys = sql.SQL(", ").join(map(sql.Identifier, key))
        cols.append(sql.SQL("PRIMARY KEY ({})").format(keys))
    conn.execute(
        sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(ident, sql.SQL(", ").join(cols))
    )


def add_columns(
    conn: psycopg.Connection, ident: sql.Composable, fields: list[pa.Field], where: str
) -> None:
    """Add ``fields`` to the table as nullable columns, in one ``ALTER TABLE``
    that waits at most half a second for its lock, several times over: an
    ``ALTER`` queued behind a long holder (a prepared transaction, a long query)
    blocks every reader that comes after it for as long as it waits."""
    problems = _ddl_problems(pa.schema(fields), [])
    if problems:
        raise PreflightError(
            f"cannot add the DataFrame's new columns to {where} (add_columns=True):\n  - "
            + "\n  - ".join(problems)
        )
    change = sql.SQL("ALTER TABLE {} ").format(ident) + sql.SQL(", ").join(
        sql.SQL("ADD COLUMN IF NOT EXISTS {} {}").format(
            sql.Identifier(f.name), sql.SQL(ddl_type(f.type) or "")
        )
        for f in fields
    )
    for attempt in range(_ALTER_ATTEMPTS):
        try:
            with conn.transaction():
                conn.execute("SET LOCAL lock_timeout = '500ms'")
                conn.execute(change)
            return
        except psycopg.errors.LockNotAvailable:
            if attempt + 1 == _ALTER_ATTEMPTS:
                holders = conn.execute(
                    "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                    " WHERE c.oid = %s::regclass AND l.granted",
                    (ident.as_string(conn),),
                ).fetchone()
                raise PreflightError(
                    f"{where}: could not add the columns "
                    f"{', '.join(repr(f.name) for f in fields)} (add_columns=True): "
                    f"{holders[0] if holders else 'some'} lock(s) on the table were held for "
                    f"{_ALTER_ATTEMPTS} tries (a long query, or prepared transactions "
                    "of another job: see pg_locks and pg_prepared_xacts). Nothing was written; "
                    "start the job again when the table is free, or add the columns yourself"
                ) from None
            time.sleep(1.0)


_ALTER_ATTEMPTS = 10


def _ddl_problems(schema: pa.Schema, key: list[str]) -> list[str]:
    """Why a table cannot be created with exactly the fields of ``schema``."""
    problems: list[str] = []
    if not schema.names:
        problems.append("the DataFrame has no columns")
    seen: set[str] = set()
    for f in schema:
        if f.name in seen:
            problems.append(f"column {f.name!r} appears more than once")
        seen.add(f.name)
        if not f.name:
            problems.append("a column has an empty name, which PostgreSQL does not allow")
        elif "\0" in f.name:
            problems.append(f"column {f.name!r}: PostgreSQL names cannot contain NUL (\\x00)")
        elif len(f.name.encode()) >= NAMEDATALEN:
            problems.append(
                f"column {f.name!r} is {len(f.name.encode())} bytes long; PostgreSQL would cut "
                f"it to {NAMEDATALEN - 1} bytes (rename it)"
            )
        if ddl_type(f.type) is None:
            problems.append(f"column {f.name!r}: {unsupported(f.type)}")
    problems += [f"key column {k!r} is not a column of the DataFrame" for k in key if k not in seen]
    return problems


def check_columns(
    where: str, columns: list[PgColumn], schema: pa.Schema, key: list[str]
) -> list[PgColumn]:
    """Match DataFrame fields to table columns; return the target column of each
    field in DataFrame order. Every problem found is reported at once."""
    by_name = {c.name: c for c in columns}
    problems: list[str] = []
    targets: list[PgColumn] = []
    for f in schema:
        col = by_name.get(f.name)
        if col is None:
            hint = next((c.name for c in columns if c.name.lower() == f.name.lower()), None)
            problems.append(
                f"column {f.name!r} is missing from {where}"
                + (f" (the table has {hint!r}: names are case-sensitive)" if hint else "")
            )
            continue
        why = incompatibility(f.type, col)
        if why:
            problems.append(f"column {f.name!r}: {why}")
        targets.append(col)
    fed = set(schema.names)
    for c in columns:
        if c.name not in fed and c.not_null and not c.has_default:
            problems.append(
                f"column {c.name!r} of {where} is NOT NULL without a default, "
                "and the DataFrame has no such column"
            )
    for k in key:
        if k not in fed:
            problems.append(f"key column {k!r} is not a column of the DataFrame")
    if problems:
        raise PreflightError(
            f"the DataFrame cannot be written to {where}:\n  - " + "\n  - ".join(problems)
        )
    return targets


def check_replace_predicate(
    conn: psycopg.Connection, table: sql.Composable, predicate: str, where: str
) -> None:
    """Refuse a ``replace_where`` that is not valid SQL over the table's columns,
    or whose value may change between evaluations (:mod:`sinks.predicates`).
    PostgreSQL says which: an index predicate must be IMMUTABLE (``now()``,
    ``current_date`` and ``random()`` are not), so a partial index of a scratch
    copy of the table (with a column of its own to index) is built with it, then
    rolled back. A check that cannot run (no TEMP privilege, say) is logged."""
    words = time_words(predicate)
    if words:
        raise PreflightError(changes_between_evaluations(", ".join(words), predicate, where))
    try:
        with conn.transaction(force_rollback=True):
            conn.execute(
                sql.SQL(
                    "CREATE TEMP TABLE _twophase_predicate (LIKE {}, _twophase_probe int) "
                    "ON COMMIT DROP"
                ).format(table)
            )
            conn.execute(
                sql.SQL("CREATE INDEX ON _twophase_predicate (_twophase_probe) WHERE {}").format(
                    sql.SQL(predicate)
                )
            )
    except psycopg.Error as e:
        first = (e.diag.message_primary or str(e)).strip().splitlines()[0]
        if "IMMUTABLE" in first:
            raise PreflightError(
                changes_between_evaluations(f"a function ({first})", predicate, where)
            ) from e
        if isinstance(e, _NOT_A_PREDICATE):
            raise PreflightError(
                f"{where}: replace_where {predicate!r} is not a predicate over the table's "
                f"columns ({first})"
            ) from e
        log.warning(
            "%s: could not check replace_where %r for functions whose value changes (%s)",
            where,
            predicate,
            first,
        )


_NOT_A_PREDICATE = (
    psycopg.errors.SyntaxError,
    psycopg.errors.UndefinedColumn,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.DatatypeMismatch,
    psycopg.errors.InvalidTextRepresentation,
    psycopg.errors.FeatureNotSupported,  # a subquery, an aggregate
    psycopg.errors.GroupingError,
)


@dataclass(frozen=True)
class Target:
    """What preflight found of the target table, for one DataFrame schema."""

    wire: pa.Schema | None
    """what the writers COPY: each written field with the binary type of its
    column (and the delete flag of ``delete_when``); None while the table lacks
    columns that ``add_columns`` adds first"""
    new_columns: list[pa.Field]
    """the DataFrame's columns the table lacks, to add (``add_columns``)"""


def check_target(
    conn: psycopg.Connection,
    schema: pa.Schema,
    *,
    table_schema: str,
    table: str,
    ident: sql.Composable,
    key: list[str],
    rules: KeyedWrite,
    create_missing: bool,
    add_missing: bool,
    replace_where: str | None,
    sink: str,
) -> Target:
    """Check the table ``table_schema.table`` (``ident``, quoted) for writing
    ``schema`` with ``rules``: create it when missing and ``create_missing``
    (``create_table``), match the DataFrame's columns to the table's
    (:func:`check_columns`), note the columns to add with ``add_missing``
    (``add_columns``), check ``replace_where`` and the unique index an upsert
    by ``key`` needs. ``sink`` names the sink in messages."""
    where = f"{table_schema}.{table}"
    columns = table_columns(conn, table_schema, table)
    if columns is None:
        if not create_missing:
            raise PreflightError(
                f"table {where} does not exist ({sink}); create it, "
                "or pass create_table=True to PostgresSink"
            )
        create_table(conn, ident, rules.written(schema), key, where)
        columns = table_columns(conn, table_schema, table)
        assert columns is not None
    rules.preflight(schema)
    written = rules.written(schema)
    have = {c.name for c in columns}
    new_columns = [f for f in written if add_missing and f.name not in have and f.name not in key]
    if new_columns:  # evolve_schema adds them, then comes back here
        written = pa.schema([f for f in written if f not in new_columns])
    targets = check_columns(where, columns, written, key)
    if replace_where is not None and not new_columns:
        # (with new columns to add, the pass after evolve_schema checks it)
        check_replace_predicate(conn, ident, replace_where, where)
    if key and set(key) not in unique_keys(conn, table_schema, table):
        raise PreflightError(
            f"upsert by key {key} needs a unique index or primary key on exactly "
            f"those columns of {where} (INSERT ... ON CONFLICT uses it); create one, "
            "e.g. ALTER TABLE ... ADD PRIMARY KEY (...)"
        )
    if new_columns:
        return Target(None, new_columns)
    wire = pa.schema(
        [
            pa.field(f.name, wire_type(f.type, c), metadata={PG_TYPE_KEY: c.formatted})
            for f, c in zip(written, targets, strict=True)
        ]
    )
    if rules.delete_when is not None:
        wire = wire.append(DELETE_FLAG)
    return Target(wire, new_columns)
