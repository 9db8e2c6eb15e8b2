"""What ``Job.run()`` returns (:class:`JobResult`), assembled when a run ends
from the checkpoints it committed, the states its pipelines ended in and what
the ledger leaves undecided; and the warning a run logs when it exits with
pre-committed work undecided."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from lifecycle.job_sinks import sink_label
from lifecycle.ledger import Checkpoint, Ledger
from lifecycle.pipeline import Pipeline, PipelineState

log = logging.getLogger("lifecycle.job")  # the job's own messages


@dataclass
class JobResult:
    """What ``Job.run()`` returns."""

    checkpoints: int
    """checkpoints that committed during this run (recovery included)"""
    rows_committed: dict[str, int]
    """rows committed during this run, per ``pipeline/sink_id``"""
    pipelines: dict[str, PipelineState]
    final_checkpoint: int | None = None
    """id of the final checkpoint, when every pipeline finished"""
    stopped: bool = False
    """True when the run ended by a stop without drain (a savepoint)"""
    drained: bool = False
    """True when the run ended by a stop with drain"""
    committed: bool = False
    """True when the run ended with its final (or savepoint) checkpoint committed
    and nothing pre-committed left undecided: the exit status of a job script"""
    end_of_input_to_exit: float | None = None
    """seconds from the moment the last pipeline had consumed its input to the end
    of the run (final checkpoint committed)"""
    checkpoint_ids: list[int] = field(default_factory=list)


def last_final(taken: list[Checkpoint]) -> Checkpoint | None:
    """The last final checkpoint among ``taken`` (None: there is none)."""
    return next((cp for cp in reversed(taken) if cp.kind == "final"), None)


def job_result(
    taken: list[Checkpoint],
    pipelines: Iterable[Pipeline],
    ledger: Ledger,
    outcome: str,
    end: float | None,
) -> JobResult:
    """The result of a run that committed the checkpoints ``taken`` and ended
    with ``outcome`` (``""``, ``"drained"`` or ``"stopped"``); ``end``: the
    monotonic time the last pipeline consumed its input (None: none did)."""
    pipelines = list(pipelines)
    rows: dict[str, int] = {sink_label(p.name, s.sink_id): 0 for p in pipelines for s in p.sinks}
    for cp in taken:
        for k, n in cp.rows.items():
            rows[k] = rows.get(k, 0) + n
    final = last_final(taken)
    states = {p.name: p.state for p in pipelines}
    all_finished = all(s is PipelineState.FINISHED for s in states.values())
    return JobResult(
        checkpoints=len(taken),
        rows_committed=rows,
        pipelines=states,
        final_checkpoint=final.id if final is not None else None,
        stopped=outcome == "stopped",
        drained=outcome == "drained",
        committed=not ledger.pending_pipelines()
        and ledger.decided() is None
        and (all_finished or outcome == "stopped"),
        end_of_input_to_exit=(time.monotonic() - end) if end is not None else None,
        checkpoint_ids=[cp.id for cp in taken],
    )


def warn_undecided(job: str, state_dir: str, ledger: Ledger) -> None:
    """Warn when job ``job`` exits with pre-committed batches or a decided
    checkpoint left for its next start."""
    pending = ledger.pending_pipelines()
    decided = ledger.decided()
    if pending or decided:
        batches = sum(len(ledger.pending_batch_ids(p)) for p in pending)
        log.warning(
            "job %s exits with %d pre-committed batch(es)%s undecided; the next start "
            "with state_dir %s commits or rolls them back (twophase status shows them)",
            job,
            batches,
            f" and checkpoint {decided.id} half-committed" if decided else "",
            state_dir,
        )
