"""A run's start, before its first query: what ``Job.run()`` does, in this
order, between opening the ledger and starting the queries.

1. :func:`refuse_speculation` (before the ledger is opened): with
   ``spark.speculation`` on, sinks whose task retries cannot tell a failed
   attempt from a speculative one are refused.
2. :func:`preflight`, before any data moves: a pipeline whose Spark checkpoint
   vanished after it committed output is refused; every sink checks the
   checkpoint interval and the pipeline's schema, and learns the load it may
   prepare between checkpoints; the ledger records the sinks' settings (what
   the ``twophase`` commands rebuild them from).
3. :func:`recover`: the start-over choice, the claims on the sinks, the
   recovery rules (:mod:`lifecycle.coordinator`), the sinks' schema evolution,
   and the owed batches written again (:mod:`lifecycle.replay`).
4. :func:`prepare_pipelines`: a stop request made while the job was not
   running is dropped, and each pipeline gets the state it starts in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from pyspark.sql import SparkSession

from lifecycle import control, replay
from lifecycle.coordinator import Coordinator
from lifecycle.errors import RecoveryRefusedError
from lifecycle.job_sinks import sink_label
from lifecycle.ledger import Ledger
from lifecycle.pipeline import Pipeline, PipelineState
from lifecycle.spark_log import SparkCommitLog
from lifecycle.state.store_interface import StateStore
from sinks.base import Sink
from sinks.capabilities import ExpectedLoad, HoldsPreparedWork
from sinks.errors import ConfigError

log = logging.getLogger("lifecycle.job")  # the job's own messages


def refuse_speculation(sinks: list[Sink]) -> None:
    """Raise :class:`ConfigError` (with ``spark.speculation`` on) naming the
    sinks whose retries cannot tell a failed attempt from a speculative one."""
    unsafe = sorted({s.describe() for s in sinks if not s.speculation_safe})
    if unsafe:
        raise ConfigError(
            "spark.speculation is on, and a task retry of these sinks cannot tell a failed "
            "attempt from a speculative one still running (it rolls the earlier attempt's "
            f"prepared work back): {', '.join(unsafe)}; set spark.speculation=false for this "
            "job (the Kafka sink alone allows it: each attempt has its own transactional id)"
        )


def preflight(
    spark: SparkSession,
    store: StateStore,
    ledger: Ledger,
    pipelines: Mapping[str, Pipeline],
    *,
    checkpoint_interval: float,
    new_state: str,
) -> None:
    """Step 2 (module docstring): refuse what cannot run exactly once, before
    any data moves, and record the sinks' settings. ``new_state``: how the
    job gets a new state (:func:`lifecycle.ledger.new_state_advice`)."""
    check_spark_state(store, ledger, pipelines, new_state)
    for p in pipelines.values():
        for s in p.sinks:
            s.check_checkpoint_interval(checkpoint_interval)
            s.preflight(p.schema)
            if isinstance(s, HoldsPreparedWork):
                s.expect_load(expected_load(spark, p, s, checkpoint_interval))
    # what the `twophase` commands rebuild the sinks from (no secrets)
    ledger.record_sinks(
        {sink_label(p.name, s.sink_id): s.settings() for p in pipelines.values() for s in p.sinks}
    )


def check_spark_state(
    store: StateStore, ledger: Ledger, pipelines: Mapping[str, Pipeline], new_state: str
) -> None:
    """Refuse to start a pipeline whose Spark checkpoint vanished after it
    committed output: Spark would read its input again from the start."""
    totals = ledger.totals()
    for p in pipelines.values():
        committed = any(k.startswith(p.name + "/") for k in totals)
        if committed and not SparkCommitLog(store, p.spark_location).exists():
            raise RecoveryRefusedError(
                f"pipeline {p.name!r} committed output in earlier runs, but its Spark "
                f"checkpoint {store.uri(p.spark_location)} is missing: starting over "
                "would write its input twice. Restore the directory, or use "
                f"{new_state} (and an empty target) to start afresh."
            )


def expected_load(
    spark: SparkSession, p: Pipeline, sink: Sink, checkpoint_interval: float
) -> ExpectedLoad:
    """What ``sink`` may prepare between two checkpoints in pipeline ``p``:
    a keyed sink's tasks are Spark's shuffle partitions, others follow the
    source (the default parallelism is the guess); an available-now batch
    is taken to last a second at least."""
    if sink.partition_columns():
        tasks = int(spark.conf.get("spark.sql.shuffle.partitions") or 200)
    else:
        tasks = spark.sparkContext.defaultParallelism
    batch_s = 1.0 if p.bounded else p.trigger_interval
    return ExpectedLoad(tasks, 1 + math.ceil(checkpoint_interval / batch_s))


def recover(
    job: str,
    store: StateStore,
    coord: Coordinator,
    pipelines: dict[str, Pipeline],
    *,
    start_over_from: str | None,
) -> None:
    """Step 3 (module docstring): claim the sinks (starting over from the
    incarnation :func:`start_over_choice` names), apply the recovery rules,
    evolve the sinks' schemas, and write the owed batches again."""
    start_over = start_over_choice(store, coord.ledger, start_over_from, coord.new_state)
    coord.claim_sinks(start_over)
    control.clear_start_over(store)
    coord.recover()
    coord.check_sinks_behind_ledger()
    for p in pipelines.values():
        for s in p.sinks:
            s.evolve_schema(p.schema)
    replay.pay_owed(job, coord, pipelines)  # recovery rule 5


def start_over_choice(
    store: StateStore, ledger: Ledger, start_over_from: str | None, new_state: str
) -> str | None:
    """The incarnation to start over from: ``start_over_from`` (the job's
    argument), or a ``twophase start-over`` request for this state_dir."""
    requested = control.start_over_request(store)
    if requested and start_over_from and requested != start_over_from:
        raise ConfigError(
            f"Job(start_over_from={start_over_from!r}) and `twophase start-over "
            f"--from {requested}` disagree: keep one"
        )
    choice = start_over_from or requested
    if choice == ledger.incarnation:
        raise ConfigError(
            f"start_over_from={choice!r} is this state's own incarnation: starting over "
            f"from it needs {new_state}"
        )
    return choice


def prepare_pipelines(store: StateStore, ledger: Ledger, pipelines: Mapping[str, Pipeline]) -> None:
    """Step 4 (module docstring): drop a stop request made while the job was
    not running, and give each pipeline the state it starts in."""
    stale = control.take_request(store)
    if stale is not None:
        log.warning("ignoring a stop request made while the job was not running")
    finished = ledger.finished()
    for p in pipelines.values():
        p.query = None
        p.input_done_at = None
        if p.name in finished:
            log.info("pipeline %s finished in an earlier run: not run again", p.name)
            p.state = PipelineState.FINISHED
        elif p.ending_input():
            log.info("pipeline %s was ending its input: resuming that", p.name)
            p.state = PipelineState.ENDING_INPUT
        else:
            p.state = PipelineState.RUNNING
