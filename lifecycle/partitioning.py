"""Whether Spark's plan already keeps every key of a batch in one partition.

A keyed sink has its batch repartitioned by its key (``Sink.partition_columns``,
done in :func:`lifecycle.binding.precommit`) so that one key is written by one
task: two tasks' prepared work holding one key would wait for each other until
the checkpoint. Spark itself drops that shuffle only when the batch is
hash-partitioned by exactly those columns; a batch hash-partitioned by a
*subset* of them (an aggregation, window or join upstream by ``customer``, a
sink keyed by ``customer, order``) has every row of one key in one partition
already, and would be shuffled again for nothing.

:func:`clustered_by` reads the batch's physical plan and answers yes only when
its output partitioning is a hash partitioning on a non-empty subset of the
key columns, compared by Spark's attribute identity (expression ids: a renamed
column stays itself, another column of the same name does not); anything it
cannot read for sure is a no, and the batch is shuffled as before.

The batch ``foreachBatch`` hands over is a ``LogicalRDD`` over the micro-batch's
own plan, and Spark 4.2 gives it that plan's partitioning without moving it to
its own attributes (``hashpartitioning(name#12)`` over an output ``name#1``): the
same columns at the same positions, under other expression ids. That is why
Spark does not skip even ``repartition(key)`` there, and why, for such a batch
only, a partitioning attribute that is not among the output is matched by its
name (unique in the output) and type. A stateful streaming query (an
aggregation) runs its micro-batches without adaptive execution, and its
batches show their partitioning; a stateless one runs them with it (Spark's
default), and the batch it hands over says ``UnknownPartitioning``: such a
batch is shuffled, unless the sink is told (``PostgresSink(partitioned_by_key=True)``).
Two rules keep the answer true at run time, when adaptive execution may
re-plan:

* coalescing shuffle partitions joins whole partitions, which keeps a key in
  one of them;
* splitting a skewed partition (a skewed join, a ``REBALANCE``) does not: with
  adaptive execution on, a plan that holds a shuffled join or a rebalance is
  answered no.

A wrong answer would not corrupt a table silently: the PostgreSQL sink's tasks
watch their lock waits (:mod:`sinks.postgres.lock_watch`) and fail with the
batch named when one waits for another task of its own batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from py4j.protocol import Py4JError
from pyspark.sql import DataFrame

log = logging.getLogger("lifecycle.partitioning")

_SPLITTABLE = ("SortMergeJoin", "ShuffledHashJoin", "REBALANCE_PARTITIONS")
"""Plan nodes whose partitions adaptive execution may split when skewed."""


def clustered_by(df: DataFrame, columns: Sequence[str]) -> bool:
    """Whether every row of one value of ``columns`` is in one partition of
    ``df`` (its output partitioning hashes a non-empty subset of them)."""
    if not columns:
        return False
    try:
        return _clustered_by(df, columns)
    except Py4JError as e:  # a plan this code cannot read: shuffle, as always
        log.debug("could not read the batch's partitioning: %s", e)
        return False


def _clustered_by(df: DataFrame, columns: Sequence[str]) -> bool:
    plan = df._jdf.queryExecution().executedPlan()
    if plan.getClass().getSimpleName() == "AdaptiveSparkPlanExec":
        plan = plan.executedPlan()  # the plan adaptive execution starts from
    adaptive = (df.sparkSession.conf.get("spark.sql.adaptive.enabled") or "").lower() == "true"
    if adaptive:
        tree = plan.treeString()
        if any(node in tree for node in _SPLITTABLE):
            return False
    out = _Output(plan.output(), by_name=_handed_over(df))
    keys = out.ids_of(columns)
    if keys is None:
        return False
    return any(_hashes_subset(p, out, keys) for p in _partitionings(plan.outputPartitioning()))


def _handed_over(df: DataFrame) -> bool:
    """Whether ``df`` is a batch as ``foreachBatch`` hands it over (persisted or not)."""
    return bool(df._jdf.queryExecution().analyzed().getClass().getSimpleName() == "LogicalRDD")


class _Output:
    """A plan's output attributes: expression id to name and type, name to ids."""

    def __init__(self, output: Any, by_name: bool) -> None:
        self.by_name = by_name
        self.types: dict[int, str] = {}
        self.names: dict[str, list[int]] = {}
        for i in range(output.size()):
            attr = output.apply(i)
            eid = attr.exprId().id()
            self.types[eid] = attr.dataType().json()
            self.names.setdefault(attr.name(), []).append(eid)

    def ids_of(self, columns: Sequence[str]) -> set[int] | None:
        """The ids of ``columns`` (exact names); None when one is missing or ambiguous."""
        found: set[int] = set()
        for name in columns:
            match = self.names.get(name, [])
            if len(match) != 1:
                return None
            found.add(match[0])
        return found

    def id_of(self, attr: Any) -> int | None:
        """The output attribute ``attr`` is: by id, or for a handed-over batch
        (module docstring) by its unique name and type; None if none."""
        eid = attr.exprId().id()
        if eid in self.types:
            return int(eid)
        if not self.by_name:
            return None
        match = self.names.get(attr.name(), [])
        if len(match) == 1 and self.types[match[0]] == attr.dataType().json():
            return match[0]
        return None


def _partitionings(partitioning: Any) -> list[Any]:
    """The partitionings a plan's output satisfies (a join's are several)."""
    if partitioning.getClass().getSimpleName() == "PartitioningCollection":
        seq = partitioning.partitionings()
        return [q for i in range(seq.size()) for q in _partitionings(seq.apply(i))]
    return [partitioning]


def _hashes_subset(partitioning: Any, out: _Output, keys: set[int]) -> bool:
    if partitioning.getClass().getSimpleName() != "HashPartitioning":
        return False
    exprs = partitioning.expressions()
    if exprs.size() == 0:
        return False
    for i in range(exprs.size()):
        e = exprs.apply(i)
        if e.getClass().getSimpleName() != "AttributeReference" or out.id_of(e) not in keys:
            return False
    return True
