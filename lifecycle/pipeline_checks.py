"""The refusals of ``Job.add_pipeline``: the arguments a pipeline cannot run
exactly once with (a DataFrame that is not streaming, no sinks or a sink id
twice, a replacing sink in an unbounded pipeline or beside one that holds its
work open, an ``event_time`` without its ``transform``, a
``source_offsets_group`` that is no group name, ``source_offsets_config``
keys kafka-python's consumer does not take), each a
:class:`~sinks.errors.ConfigError` raised before anything runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pyspark.sql import DataFrame

from lifecycle.pipeline import Transform
from sinks.base import Sink
from sinks.capabilities import ExpiringWork, HoldsPreparedWork
from sinks.errors import ConfigError


def check_pipeline(
    name: str,
    df: DataFrame,
    sinks: Sequence[Sink],
    *,
    bounded: bool,
    trigger_interval: float,
    transform: Transform | None,
    event_time: str | None,
    source_offsets: tuple[str | bool, Mapping[str, Any] | None] = (True, None),
) -> None:
    """Raise :class:`ConfigError` when pipeline ``name`` cannot run as given
    (the arguments of :meth:`lifecycle.job.Job.add_pipeline`)."""
    if not df.isStreaming:
        raise ConfigError(
            f"pipeline {name!r}: the DataFrame is not streaming; build it with "
            "spark.readStream (for a bounded input, with bounded=True)"
        )
    if not sinks:
        raise ConfigError(f"pipeline {name!r} has no sinks")
    ids = [s.sink_id for s in sinks]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise ConfigError(
            f"pipeline {name!r}: sink id(s) {sorted(dup)} used twice; pass sink_id= to tell "
            "them apart"
        )
    if trigger_interval <= 0:
        raise ConfigError("trigger_interval must be > 0 seconds")
    replacing = [s for s in sinks if s.commits_at_finish]
    if replacing and not bounded:
        raise ConfigError(
            f"pipeline {name!r}: {replacing[0].describe()} replaces (replace_where), which "
            "commits once, when the pipeline finishes: pass bounded=True (a backfill)"
        )
    holding = [s for s in sinks if isinstance(s, HoldsPreparedWork) and s.holds_prepared_work()]
    if replacing and holding:
        why = (
            "they expire"
            if isinstance(holding[0], ExpiringWork)
            else "their row locks block the pipeline's next batches, and a long backfill "
            "runs out of max_prepared_transactions"
        )
        raise ConfigError(
            f"pipeline {name!r}: {replacing[0].describe()} replaces (replace_where), so "
            "every sink of the pipeline commits only when it finishes, and "
            f"{holding[0].describe()} would hold its transactions open that long ({why}); "
            "write to it from a pipeline of its own (reading the same input), or make it "
            "replace too (replace_where=)"
        )
    if event_time is not None and transform is None:
        raise ConfigError(
            f"pipeline {name!r}: event_time needs transform= (the end-of-input marker is "
            "fed into the source, before the transform)"
        )
    group, config = source_offsets
    if not isinstance(group, bool) and not (isinstance(group, str) and group.strip()):
        raise ConfigError(
            f"pipeline {name!r}: source_offsets_group must be a consumer group's name, True "
            f"(twophase.<job>.<pipeline>) or False, not {group!r}"
        )
    if config:
        from kafka import KafkaConsumer

        unknown = sorted(set(config) - set(KafkaConsumer.DEFAULT_CONFIG))
        fixed = sorted({"group_id", "enable_auto_commit"} & set(config))
        if unknown or fixed:
            raise ConfigError(
                f"pipeline {name!r}: source_offsets_config takes kafka-python KafkaConsumer "
                f"settings other than group_id and enable_auto_commit, not {unknown + fixed}"
            )
