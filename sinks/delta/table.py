"""The Delta table through deltalake (delta-rs): load, check, create, list files.

delta-rs validates nothing when files are committed with
``create_write_transaction``, so everything this sink relies on about a table is
checked here: that the sink can write it faithfully (no identity columns or
writer features it does not know; appends to a column-mapped table by physical
names, :mod:`sinks.delta.column_mapping`; the features only delta-spark's
commit honours, and rewrites of tables with deletion vectors, the change data
feed or column mapping, need a session with delta-spark,
:mod:`sinks.delta.spark_txn` and :mod:`sinks.delta.spark_rewrite`; CHECK
constraints, invariants and generated columns are enforced on the rows,
:mod:`sinks.delta.constraints`), and what its columns and partition columns are.
The sink's preflight is :func:`check_target`: the table created when missing,
then checked against the sink's options and the DataFrame's schema.
"""

from __future__ import annotations

import dataclasses
import logging
from urllib.parse import unquote

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Schema
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from sinks.delta import progress, replace, spark_features, spark_txn
from sinks.delta.column_mapping import MODE_KEY, ColumnMapping
from sinks.delta.constraints import RowRules
from sinks.delta.layout import DeltaSchemaError, Layout
from sinks.delta.storage import TableStorage
from sinks.keys import KeyedWrite

log = logging.getLogger("sinks.delta")

# Writer features whose data files and add actions need nothing from a plain
# append beyond what this sink writes (the rows of invariants, constraints and
# generated columns are checked and computed in Spark; identity columns and
# column mapping are refused below when they are in use).
_WRITER_FEATURES = frozenset(
    {
        "appendOnly",
        "invariants",
        "checkConstraints",
        "changeDataFeed",
        "generatedColumns",
        "columnMapping",
        "identityColumns",
        "timestampNtz",
        "deletionVectors",
        "domainMetadata",
        "vacuumProtocolCheck",
    }
)


def load(table_uri: str, storage_options: dict[str, str] | None) -> DeltaTable | None:
    """The table's latest snapshot, or ``None`` when there is no Delta table."""
    try:
        return DeltaTable(table_uri, storage_options=storage_options or None)
    except TableNotFoundError:
        return None


def layout_of(dt: DeltaTable) -> Layout:
    """Columns and partition columns of the table, and its column mapping."""
    schema = pa.schema(dt.schema().to_arrow())
    layout = Layout.of(schema, dt.metadata().partition_columns)
    mode = (dt.metadata().configuration or {}).get(MODE_KEY)
    mapping = ColumnMapping.of(dt.schema().to_json(), layout.schema, mode)
    return dataclasses.replace(layout, mapping=mapping) if mapping is not None else layout


def check_writable(
    dt: DeltaTable, where: str, *, removes: bool = False, spark_blocked: str | None
) -> RowRules:
    """Refuse a table whose protocol or metadata asks writers for more than this
    sink does (it appends plain Parquet files whose columns carry logical names).

    ``removes``: the sink's commits also remove files (a keyed merge, a
    partition replace), which reads the files it replaces and asks more of the
    table (:func:`check_rewritable`). ``spark_blocked``: what the driver lacks
    to commit through delta-spark (:mod:`sinks.delta.spark_txn`, which honours
    the features delta-rs cannot write,
    :data:`~sinks.delta.spark_features.DELTA_SPARK_FEATURES`), worded as what
    it needs (:meth:`~sinks.delta.spark_features.SparkRoute.blocked`); ``None``
    when it can.
    Returns the table's row rules (:class:`~sinks.delta.constraints.RowRules`),
    which the rows must satisfy."""
    proto = dt.protocol()
    through_spark = spark_features.needed(dt)
    unknown = sorted(set(proto.writer_features or ()) - _WRITER_FEATURES - set(through_spark))
    if proto.min_writer_version > 7 or unknown:
        raise DeltaSchemaError(
            f"{where} needs writer protocol {proto.min_writer_version} with features "
            f"{unknown}, which DeltaSink does not implement; write to a table without them"
        )
    if through_spark and spark_blocked is not None:
        raise DeltaSchemaError(
            f"{where} has the table feature(s) {through_spark}, which delta-rs cannot write; "
            f"DeltaSink commits such a table through delta-spark, which needs {spark_blocked}"
        )
    if removes:  # after the appends' needs: its advice to append holds only then
        check_rewritable(dt, where, spark_blocked=spark_blocked)
    return RowRules.of(dt, where)  # refuses identity columns and nested rules


def check_rewritable(dt: DeltaTable, where: str, *, spark_blocked: str | None) -> None:
    """Refuse a table whose files a keyed merge or a replace cannot remove.

    * **``delta.appendOnly``**: Delta forbids removing files (delta-rs refuses
      the commit), so the rewrite could never commit.
    * **Deletion vectors, the change data feed, column mapping** while
      ``spark_blocked`` (what the driver lacks to commit through delta-spark,
      :func:`check_writable`): the rewrite reads the files it replaces, removes
      them and writes change data through delta-spark's transaction
      (:mod:`sinks.delta.spark_rewrite`); delta-rs would read a file's deleted
      rows back, keep a file with a deletion vector live, write no change data
      and read physical names as missing columns.

    Appends need none of this: an add names no deletion vector."""
    config = dt.metadata().configuration or {}
    if spark_features.property_on(config, "delta.appendOnly"):
        raise DeltaSchemaError(
            f"{where} is append-only (delta.appendOnly=true): a keyed DeltaSink (key=) or a "
            "replace (replace_where=) removes files, which Delta forbids there. Append (no "
            "key=, no replace_where=), or unset the property"
        )
    needs = sorted(set(spark_features.needed(dt, rewrites=True)) - set(spark_features.needed(dt)))
    if needs and spark_blocked is not None:
        raise DeltaSchemaError(
            f"{where} has the table feature(s) {needs}: a keyed DeltaSink (key=) or a replace "
            "(replace_where=) reads, removes and writes such a table's files through "
            "delta-spark (deleted rows stay deleted, files are removed with their deletion "
            f"vectors, change data is written, columns are read by physical name), which "
            f"needs {spark_blocked}. Or append (no key=, no replace_where=): appends are "
            "honoured without it"
        )


def create(table_uri: str, storage_options: dict[str, str] | None, layout: Layout) -> bool:
    """Create the table with version 0 only; ``False`` when it exists already.

    ``DeltaTable.create`` alone is not safe against a concurrent creator: when
    version 0 appears while it commits, delta-rs rebases and writes a second
    CREATE as version 1 (a new table id, which breaks streaming readers). With
    ``max_commit_retries=0`` the losing commit fails instead; the caller then
    reads and validates the winner's table."""
    try:
        DeltaTable.create(
            table_uri,
            Schema.from_arrow(layout.schema),
            mode="error",
            partition_by=list(layout.partition_by) or None,
            storage_options=storage_options or None,
            commit_properties=CommitProperties(max_commit_retries=0),
        )
        return True
    except (CommitFailedError, DeltaError):
        if DeltaTable.is_deltatable(table_uri, storage_options or None):
            return False  # created by someone else since we looked
        raise


def committed_paths(dt: DeltaTable) -> set[str]:
    """Relative paths (as stored, not URI-encoded) of the files in the snapshot."""
    paths = pa.table(dt.get_add_actions(flatten=False)).column("path").to_pylist()
    return {unquote(p) for p in paths}


def add_columns(
    dt: DeltaTable, fields: list[pa.Field], spark_uri: str | None = None, where: str = ""
) -> None:
    """Add nullable columns to the table, in one version (schema evolution):
    through delta-spark when the table's commits go through it (a table it
    reaches at ``spark_uri`` with :func:`~sinks.delta.spark_features.needed`
    features), else through deltalake."""
    from deltalake.schema import Schema as DeltaSchema

    missing = [f for f in fields if f.name not in {x.name for x in dt.schema().fields}]
    if not missing:
        return
    if spark_uri is not None and spark_features.needed(dt):
        spark_txn.add_columns(spark_uri, missing, where)
    else:
        dt.alter.add_columns(list(DeltaSchema.from_arrow(pa.schema(missing)).fields))


@dataclasses.dataclass(frozen=True)
class Target:
    """What preflight found of the table, for one DataFrame schema."""

    layout: Layout
    """the table's columns and partition columns, with the digest of its row rules"""
    row_rules: RowRules
    """the rules the rows must satisfy (:func:`check_writable`)"""
    new_columns: list[pa.Field]
    """the DataFrame's columns the table lacks, to add (``schema_mode="merge"``)"""
    table: DeltaTable
    """the table as checked"""


def check_target(
    storage: TableStorage,
    schema: pa.Schema,
    where: str,
    *,
    rules: KeyedWrite,
    partition_by: list[str] | None,
    create_missing: bool,
    replace_where: str | None,
    merge_schema: bool,
    spark_writes: bool,
    spark_route: spark_features.SparkRoute,
) -> Target:
    """Check (or create, with ``create_missing``) the table of ``storage`` for
    writing ``schema`` with the sink's options: writable by this sink, the
    same columns as ``schema`` with compatible types (columns to add with
    ``merge_schema``), the expected partition columns (``partition_by``; None:
    whatever the table has), ``replace_where`` over them, and no column
    mapping where the sink would write logical names (``spark_writes``:
    ``write_with="spark"``) or add columns. ``spark_route``: how delta-spark
    reaches the table; when the sink's commits go through it, it must find the
    table deltalake reads (:func:`~sinks.delta.spark_txn.check_reaches`).
    ``where`` names the sink in messages."""
    if rules.keyed:
        rules.preflight(schema)
        schema = rules.written(schema)
    missing = [c for c in partition_by or () if c not in schema.names]
    if missing:
        raise DeltaSchemaError(
            f"{where}: partition column(s) {missing} are not columns of the DataFrame "
            f"({schema.names})"
        )
    dt = load(storage.table_uri, storage.storage_options)
    if dt is None:
        if not create_missing:
            raise DeltaSchemaError(
                f"{where} does not exist; create it, or pass create_table=True to DeltaSink"
            )
        try:
            wanted = Layout.of(schema, partition_by or ())
        except DeltaSchemaError as e:
            raise DeltaSchemaError(f"{where} cannot be created from the DataFrame: {e}") from e
        wanted.check_partitioning(where)
        if not create(storage.table_uri, storage.storage_options, wanted):
            log.info("%s was created concurrently by another writer; checking it", where)
        dt = load(storage.table_uri, storage.storage_options)
        if dt is None:
            raise DeltaSchemaError(f"{where} vanished right after it was created")
    removes = rules.keyed or replace_where is not None
    blocked = spark_route.blocked()
    row_rules = check_writable(dt, where, removes=removes, spark_blocked=blocked)
    through_spark = spark_features.needed(dt, rewrites=removes)
    if through_spark and blocked is None and spark_route.uri is not None:
        spark_txn.check_reaches(dt, spark_route.uri, where)
    retention = dt.metadata().configuration.get(progress.RETENTION_PROPERTY)
    if retention is not None:
        raise DeltaSchemaError(
            f"{where} sets {progress.RETENTION_PROPERTY}={retention}: Delta would expire "
            "the app transactions in which this sink remembers what it committed, and "
            "then a replayed batch could be committed twice. Unset the property "
            "(ALTER TABLE ... UNSET TBLPROPERTIES)"
        )
    layout = dataclasses.replace(layout_of(dt), checked=row_rules.digest)
    if partition_by is not None and list(layout.partition_by) != partition_by:
        raise DeltaSchemaError(
            f"{where} is partitioned by {list(layout.partition_by)}, but DeltaSink was "
            f"given partition_by={partition_by}; pass the table's partition columns "
            "(in that order) or partition_by=None"
        )
    layout.check_partitioning(where)
    new_columns = layout.check_input(
        schema,
        where,
        merge=merge_schema,
        derived=row_rules.generated_columns,
    )
    if replace_where is not None:
        replace.check_predicate(replace_where, layout, where)
    if layout.mapping is not None and (new_columns or spark_writes):
        raise DeltaSchemaError(
            f"{where} uses column mapping ({layout.mapping.mode} mode): "
            + (
                "schema_mode='merge' would add columns, which need new physical names "
                "and ids; add them with delta-spark (ALTER TABLE ... ADD COLUMNS) first"
                if new_columns
                else "write_with='spark' writes logical names; use 'auto' or 'arrow'"
            )
        )
    return Target(layout, row_rules, new_columns, dt)
