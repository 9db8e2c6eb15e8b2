"""A keyed write inside a task's transaction: a staging table, then one merge.

The task COPYs its rows into a private staging table that holds only the
columns the DataFrame feeds (so the target's identity, serial and default
columns keep their defaults), and with ``delete_when`` a flag that marks
deletes, then merges it into the target with ``INSERT ... ON CONFLICT (key)``
and ``DELETE ... USING``, following the rules of :mod:`sinks.keys`:

* without ``order_by``, the staged rows are inserted as they are: PostgreSQL
  itself refuses a statement that would update one row twice, which is how
  different rows of one key are found at no cost when there are none. Then,
  under a savepoint, rows equal in every column are merged as one, and a key
  with rows that differ raises :class:`sinks.keys.DuplicateKeyError`;
* with ``order_by``, a tie at the greatest value between different rows raises
  the same error; else the greatest row of each key is inserted.
* deletes of one key agree whatever else they hold, a delete and a write of
  one key differ. A key whose winning row is a delete is deleted, after the
  task waited for the sink's earlier batches (a delete does not wait for an
  uncommitted insert of its key, see ``PostgresWriter``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from sinks.keys import KeyedWrite

_RANK = "_twophase_rank"
DELETE_COLUMN = "_twophase_delete"
"""the staging table's column that marks a delete"""


@dataclass(frozen=True)
class Upsert:
    """The merge of one staging table into one target table."""

    target: sql.Composable
    stage: sql.Composable
    columns: Sequence[str]
    """the target's columns the DataFrame feeds"""
    rules: KeyedWrite
    batch_id: int
    deletes: bool = False
    """whether the staging table has the delete flag (``delete_when``)"""

    @property
    def key(self) -> Sequence[str]:
        return self.rules.key

    @property
    def order_by(self) -> str | None:
        return self.rules.order_by

    def create_stage(self, conn: psycopg.Connection) -> None:
        """An unlogged table of the fed columns (types and modifiers of the
        target's, no constraints, no defaults). A regular table: ``PREPARE
        TRANSACTION`` refuses temporary objects; it is created and dropped in
        the task's transaction, so no one else ever sees it."""
        flag = (
            sql.SQL(", NULL::boolean AS {}").format(sql.Identifier(DELETE_COLUMN))
            if self.deletes
            else sql.SQL("")
        )
        conn.execute(
            sql.SQL("CREATE UNLOGGED TABLE {} AS SELECT {}{} FROM {} WITH NO DATA").format(
                self.stage, self._cols(), flag, self.target
            )
        )

    def merge(
        self, conn: psycopg.Connection, wait_for_earlier: Callable[[psycopg.Connection], None]
    ) -> None:
        """Merge the staged rows into the target, then drop the staging table.
        ``wait_for_earlier`` runs before a delete (see the module docstring)."""
        if self.order_by is None:
            if self.deletes:
                self._raise_on_duplicate(conn, self._write_and_delete_query())
            self._merge_unordered(conn)
            if self.deletes:
                self._delete(conn, wait_for_earlier, self._deleted_keys())
        elif not self.deletes:
            self._raise_on_duplicate(conn, self._tie_query())
            conn.execute(self._insert(distinct=True))
        else:
            self._raise_on_duplicate(conn, self._tie_query())
            winners = self._winners()
            conn.execute(self._insert(distinct=True, source=winners))
            self._delete(conn, wait_for_earlier, winners)
        conn.execute(sql.SQL("DROP TABLE {}").format(self.stage))

    def _delete(
        self,
        conn: psycopg.Connection,
        wait_for_earlier: Callable[[psycopg.Connection], None],
        rows: sql.Composable,
    ) -> None:
        """Delete the target's rows of the keys whose winner is a delete."""
        found = conn.execute(
            sql.SQL("SELECT 1 FROM {} WHERE {} LIMIT 1").format(
                self.stage, sql.Identifier(DELETE_COLUMN)
            )
        ).fetchone()
        if found is None:
            return
        wait_for_earlier(conn)
        match = sql.SQL(" AND ").join(
            sql.SQL("t.{0} = d.{0}").format(sql.Identifier(k)) for k in self.key
        )
        conn.execute(
            sql.SQL("DELETE FROM {} t USING ({}) d WHERE d.{} AND {}").format(
                self.target, rows, sql.Identifier(DELETE_COLUMN), match
            )
        )

    def _merge_unordered(self, conn: psycopg.Connection) -> None:
        conn.execute("SAVEPOINT twophase_upsert")
        try:
            conn.execute(self._insert(distinct=False))
        except psycopg.errors.CardinalityViolation:
            # "ON CONFLICT DO UPDATE command cannot affect row a second time"
            conn.execute("ROLLBACK TO SAVEPOINT twophase_upsert")
            self._raise_on_duplicate(conn, self._duplicate_query())
            conn.execute(self._insert(distinct=True))
        conn.execute("RELEASE SAVEPOINT twophase_upsert")

    def _raise_on_duplicate(self, conn: psycopg.Connection, query: sql.Composed) -> None:
        row = conn.execute(query).fetchone()
        if row is not None:
            raise self.rules.duplicate_error(row, self.batch_id)

    # -- statements -------------------------------------------------------------------

    def _cols(self) -> sql.Composable:
        return sql.SQL(", ").join(map(sql.Identifier, self.columns))

    def _keys(self, alias: str | None = None) -> sql.Composable:
        return sql.SQL(", ").join(
            sql.Identifier(*((alias, k) if alias else (k,))) for k in self.key
        )

    def _only_writes(self, alias: str | None = None) -> sql.Composable:
        """A ``WHERE`` that keeps the staged writes (all rows without deletes)."""
        if not self.deletes:
            return sql.SQL("")
        flag = sql.Identifier(*((alias, DELETE_COLUMN) if alias else (DELETE_COLUMN,)))
        return sql.SQL(" WHERE NOT {}").format(flag)

    def _duplicate_query(self) -> sql.Composed:
        """A key with staged writes that differ (rows compared as their text)."""
        return sql.SQL(
            "SELECT {keys} FROM {stage} s{writes} GROUP BY {keys} "
            "HAVING count(DISTINCT s::text) > 1 LIMIT 1"
        ).format(keys=self._keys("s"), stage=self.stage, writes=self._only_writes("s"))

    def _write_and_delete_query(self) -> sql.Composed:
        """A key with a staged delete and a staged write (they differ)."""
        flag = sql.Identifier(DELETE_COLUMN)
        return sql.SQL(
            "SELECT {keys} FROM {stage} s GROUP BY {keys} "
            "HAVING bool_or(s.{flag}) AND NOT bool_and(s.{flag}) LIMIT 1"
        ).format(keys=self._keys("s"), stage=self.stage, flag=flag)

    def _deleted_keys(self) -> sql.Composed:
        """Every key with a staged delete (no key has a write too, then)."""
        return sql.SQL("SELECT DISTINCT {keys}, true AS {flag} FROM {stage} WHERE {flag}").format(
            keys=self._keys(), flag=sql.Identifier(DELETE_COLUMN), stage=self.stage
        )

    def _tie_query(self) -> sql.Composed:
        """A key whose greatest ``order_by`` value is held by rows that differ
        (deletes of one key are one row, whatever else they hold)."""
        assert self.order_by is not None
        row = (
            sql.SQL("CASE WHEN t.{} THEN '' ELSE t::text END").format(sql.Identifier(DELETE_COLUMN))
            if self.deletes
            else sql.SQL("t::text")
        )
        return sql.SQL(
            "SELECT {tkeys} FROM (SELECT s.*, rank() OVER (PARTITION BY {skeys} ORDER BY "
            "{ord} DESC) AS {rank} FROM {stage} s) t WHERE {rank} = 1 GROUP BY {tkeys} "
            "HAVING count(DISTINCT {row}) > 1 LIMIT 1"
        ).format(
            tkeys=self._keys("t"),
            skeys=self._keys("s"),
            ord=sql.Identifier("s", self.order_by),
            rank=sql.Identifier(_RANK),
            stage=self.stage,
            row=row,
        )

    def _winners(self) -> sql.Composed:
        """The greatest staged row of each key, with its delete flag."""
        assert self.order_by is not None
        return sql.SQL(
            "SELECT DISTINCT ON ({keys}) {cols}, {flag} FROM {stage} ORDER BY {keys}, {ord} DESC"
        ).format(
            keys=self._keys(),
            cols=self._cols(),
            flag=sql.Identifier(DELETE_COLUMN),
            stage=self.stage,
            ord=sql.Identifier(self.order_by),
        )

    def _insert(self, *, distinct: bool, source: sql.Composable | None = None) -> sql.Composed:
        """The upsert of the staged writes (``source``: of these rows, the
        writes among them)."""
        others = [n for n in self.columns if n not in self.key]
        action = (
            sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(
                    sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in others
                )
            )
            if others
            else sql.SQL("DO NOTHING")
        )
        cols, keys_, stage, writes = self._cols(), self._keys(), self.stage, self._only_writes()
        if source is not None:
            rows = sql.SQL("SELECT {} FROM ({}) w{}").format(cols, source, self._only_writes("w"))
        elif not distinct:
            rows = sql.SQL("SELECT {} FROM {}{}").format(cols, stage, writes)
        elif self.order_by is None:
            rows = sql.SQL("SELECT DISTINCT ON ({0}) {1} FROM {2}{3} ORDER BY {0}").format(
                keys_, cols, stage, writes
            )
        else:
            rows = sql.SQL("SELECT DISTINCT ON ({0}) {1} FROM {2} ORDER BY {0}, {3} DESC").format(
                keys_, cols, stage, sql.Identifier(self.order_by)
            )
        return sql.SQL("INSERT INTO {} ({}) {} ON CONFLICT ({}) {}").format(
            self.target, cols, rows, keys_, action
        )
