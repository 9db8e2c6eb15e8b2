"""What a sink remembers of its own progress, and the claim that makes one
incarnation of a job the writer of a target.

Every sink keeps, in the target system itself, one **progress record** per
scope (job, pipeline, sink id, and the target: a table, a topic):

* ``owner``: the incarnation (random id of a job's ledger) that holds the
  claim. Only the owner commits; a start with another incarnation refuses
  before any data moves, unless the operator deliberately starts over from
  exactly that incarnation (``Job(start_over_from=...)``), which the record
  then remembers (``previous``), so that the old state, restored later, still
  refuses;
* ``batch``: the highest Spark batch the owner has committed (-1: none).

Claims are taken in one global order (:func:`claim_order`), so two copies of a
job starting at the same instant cannot each win a different sink: the first
contested sink decides, and the loser refuses there before it holds anything
the winner needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from sinks.errors import PreflightError


@dataclass(frozen=True)
class SinkProgress:
    """A sink's progress record for one scope, read from the target system."""

    owner: str | None
    """incarnation holding the claim; None: never claimed"""
    batch: int = -1
    """highest batch committed by ``owner``; -1: none"""
    previous: str | None = None
    """the incarnation a start-over took the claim from, if any"""

    def held_by(self, incarnation: str | None) -> bool:
        return self.owner is not None and self.owner == incarnation


class IncarnationConflictError(PreflightError):
    """A sink holds output of this job's scope written by another incarnation:
    the job's state was lost or reset, or another copy of the job writes the
    same target. Raised before any data moves; also when a commit finds that
    another incarnation took the claim over while this one ran."""

    def __init__(self, message: str, *, target: str, owner: str, ours: str) -> None:
        super().__init__(message)
        self.target = target
        self.owner = owner
        self.ours = ours


def conflict(
    target: str, scope_key: str, found: SinkProgress, ours: str, *, at_commit: bool = False
) -> IncarnationConflictError:
    """The error for a claim of ``target`` held by another incarnation."""
    assert found.owner is not None
    held = (
        f"committed output up to batch {found.batch}"
        if found.batch >= 0
        else "a claim (no committed batch yet)"
    )
    when = (
        "while this job was running, another start took the claim over: this copy stops "
        "without committing. "
        if at_commit
        else "Nothing was written. "
    )
    return IncarnationConflictError(
        f"{target} holds {held} of {scope_key} from incarnation {found.owner}, but this "
        f"job's state is incarnation {ours}. {when}Either this job's state (state_dir or "
        "ledger) was lost or reset since it last ran, or another copy of the job, with "
        "its own state, writes the same target. Ways out: restore the state of "
        f"incarnation {found.owner} and run again (it resumes exactly once); or, if that "
        "copy is stopped for good and you mean to start over, run with "
        f"Job(..., start_over_from={found.owner!r}) (or `twophase start-over STATE_DIR "
        f"--from {found.owner}`). Starting over aborts what incarnation {found.owner} left "
        "prepared and not committed, keeps what it committed, and is recorded in the "
        "target, so its old state can no longer write there.",
        target=target,
        owner=found.owner,
        ours=ours,
    )


def may_claim(found: SinkProgress, ours: str, start_over_from: str | None) -> bool:
    """Whether incarnation ``ours`` may hold a claim found as ``found``."""
    return found.owner is None or found.owner == ours or found.owner == start_over_from


def claim_order(target: str, scope_key: str) -> tuple[str, str]:
    """The global order in which a job claims its sinks."""
    return (target, scope_key)
