"""An upsert inside a task's transaction: a staging table, then one merge.

The task COPYs its rows into a private staging table that holds only the
columns the DataFrame feeds (so the target's identity, serial and default
columns keep their defaults), then merges it into the target with ``INSERT ...
ON CONFLICT (key)``, following the rules of :mod:`sinks.keys`:

* without ``order_by``, the staged rows are inserted as they are: PostgreSQL
  itself refuses a statement that would update one row twice, which is how
  different rows of one key are found at no cost when there are none. Then,
  under a savepoint, rows equal in every column are merged as one, and a key
  with rows that differ raises :class:`sinks.keys.DuplicateKeyError`;
* with ``order_by``, a tie at the greatest value between different rows raises
  the same error; else the greatest row of each key is inserted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from sinks import keys

_RANK = "_twophase_rank"


@dataclass(frozen=True)
class Upsert:
    """The merge of one staging table into one target table."""

    target: sql.Composable
    stage: sql.Composable
    columns: Sequence[str]
    key: Sequence[str]
    order_by: str | None
    sink: str
    """the sink's description, for errors"""
    batch_id: int

    def create_stage(self, conn: psycopg.Connection) -> None:
        """An unlogged table of the fed columns (types and modifiers of the
        target's, no constraints, no defaults). A regular table: ``PREPARE
        TRANSACTION`` refuses temporary objects; it is created and dropped in
        the task's transaction, so no one else ever sees it."""
        conn.execute(
            sql.SQL("CREATE UNLOGGED TABLE {} AS SELECT {} FROM {} WITH NO DATA").format(
                self.stage, self._cols(), self.target
            )
        )

    def merge(self, conn: psycopg.Connection) -> None:
        """Merge the staged rows into the target, then drop the staging table."""
        if self.order_by is None:
            self._merge_unordered(conn)
        else:
            self._raise_on_duplicate(conn, self._tie_query())
            conn.execute(self._insert(distinct=True))
        conn.execute(sql.SQL("DROP TABLE {}").format(self.stage))

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

    def _raise_on_duplicate(self, conn: psycopg.Connection, query: sql.Composable) -> None:
        row = conn.execute(query).fetchone()
        if row is not None:
            raise keys.duplicate_error(self.sink, self.key, row, self.batch_id, self.order_by)

    # -- statements -------------------------------------------------------------------

    def _cols(self) -> sql.Composable:
        return sql.SQL(", ").join(map(sql.Identifier, self.columns))

    def _keys(self, alias: str | None = None) -> sql.Composable:
        return sql.SQL(", ").join(
            sql.Identifier(*((alias, k) if alias else (k,))) for k in self.key
        )

    def _duplicate_query(self) -> sql.Composable:
        """A key with staged rows that differ (rows compared as their text)."""
        return sql.SQL(
            "SELECT {keys} FROM {stage} s GROUP BY {keys} HAVING count(DISTINCT s::text) > 1 "
            "LIMIT 1"
        ).format(keys=self._keys("s"), stage=self.stage)

    def _tie_query(self) -> sql.Composable:
        """A key whose greatest ``order_by`` value is held by rows that differ."""
        assert self.order_by is not None
        return sql.SQL(
            "SELECT {tkeys} FROM (SELECT s.*, rank() OVER (PARTITION BY {skeys} ORDER BY "
            "{ord} DESC) AS {rank} FROM {stage} s) t WHERE {rank} = 1 GROUP BY {tkeys} "
            "HAVING count(DISTINCT t::text) > 1 LIMIT 1"
        ).format(
            tkeys=self._keys("t"),
            skeys=self._keys("s"),
            ord=sql.Identifier("s", self.order_by),
            rank=sql.Identifier(_RANK),
            stage=self.stage,
        )

    def _insert(self, *, distinct: bool) -> sql.Composable:
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
        cols, keys_, stage = self._cols(), self._keys(), self.stage
        if not distinct:
            source = sql.SQL("SELECT {} FROM {}").format(cols, stage)
        elif self.order_by is None:
            source = sql.SQL("SELECT DISTINCT ON ({0}) {1} FROM {2} ORDER BY {0}").format(
                keys_, cols, stage
            )
        else:
            source = sql.SQL("SELECT DISTINCT ON ({0}) {1} FROM {2} ORDER BY {0}, {3} DESC").format(
                keys_, cols, stage, sql.Identifier(self.order_by)
            )
        return sql.SQL("INSERT INTO {} ({}) {} ON CONFLICT ({}) {}").format(
            self.target, cols, source, keys_, action
        )
