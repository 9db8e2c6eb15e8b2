"""Adopting a streaming query's Spark checkpoint: moving a ``foreachBatch`` job
that wrote Delta with delta-spark's idempotent writes (``txnAppId`` and
``txnVersion`` = the batch id) to a :class:`~lifecycle.Job` with
:class:`~sinks.DeltaSink` on the same table, without writing a batch twice or
skipping one.

The old query wrote batch ``b`` in a Delta version carrying
``txn(txnAppId, b)``, then Spark wrote ``commits/b``. :func:`adopt_checkpoint`
copies its Spark checkpoint (offsets, commits, sources, metadata, state) to
the pipeline's Spark checkpoint in the job's ``state_dir``, so the job's query
resumes exactly where the old one stopped. The rules, applied to the old
checkpoint's last planned batch ``n`` (the highest ``offsets/n``):

1. ``commits/n`` exists: every planned batch is done; Spark plans ``n + 1``
   next, with the offsets the old query ended at. Nothing is written twice or
   skipped.
2. ``commits/n`` is missing (the old query stopped or crashed inside batch
   ``n``) and the table's ``txnVersion`` of the app id is ``n``: the write
   landed and Spark did not record it. Adopting records ``commits/n`` as Spark
   would have (the content of the batch before, i.e. the same watermark), so
   the job does not write the batch again.
3. ``commits/n`` is missing and the table's ``txnVersion`` is below ``n``: the
   write did not land. Spark replays batch ``n`` with the same offsets, now
   through the job's sinks.
4. Refused (:class:`AdoptionRefusedError`, nothing copied):

   * the table's ``txnVersion`` is above ``n`` (it holds batches the
     checkpoint never planned: another query under the same app id, or a
     checkpoint older than the table), or below the last batch the checkpoint
     recorded done, or absent while it recorded some (a wrong table or app
     id: deciding rule 3 on it would write a landed batch twice);
   * ``commits/n`` is missing and no table and app id were given to decide 2
     or 3, or ``commits/n-1`` is missing too (a log Spark would not leave);
   * rule 2 on a stateful query (a ``state/`` directory) or a commit log in
     another format than ``v1``: the entry Spark would write carries the
     state's versions and watermark of batch ``n``, which only Spark knows.
     Run the old query to the end of that batch instead;
   * the pipeline already has a Spark checkpoint (adopting is for a job's
     first start), the job's ``state_dir`` is a URI (adopt into a local
     directory; copy a remote checkpoint down first), or the old checkpoint
     has no ``offsets``.

The copy is atomic: it is assembled (with the recorded commit) in a sibling
directory, flushed, and renamed into place, so a crash leaves either no
checkpoint (adopt again) or the whole one.

Stop the old query before adopting, and never start it again: the two would
write the same batches. The job's pipeline must read the same source the same
way (Spark checks the checkpoint against the query: the same sources in the
same order, the same stateful operators); its sinks may differ.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from lifecycle.state.files import atomic_write, fsync_dir
from lifecycle.state.store_interface import scheme_of
from sinks.errors import ConfigError

_EMPTY_COMMIT = 'v1\n{"nextBatchWatermarkMs":0}'


class AdoptionRefusedError(ConfigError):
    """A Spark checkpoint that cannot be adopted as it is (nothing was copied)."""


@dataclass(frozen=True)
class Adopted:
    """What :func:`adopt_checkpoint` did."""

    location: Path
    """the pipeline's Spark checkpoint in the job's ``state_dir``"""
    last_batch: int
    """the old query's last planned batch"""
    recorded: bool
    """whether that batch's commit was recorded (rule 2): the table held it"""
    replays: bool
    """whether the job's query writes that batch again (rule 3)"""


def adopt_checkpoint(
    state_dir: str | os.PathLike[str],
    pipeline: str,
    checkpoint: str | os.PathLike[str],
    *,
    delta_table: str | os.PathLike[str] | None = None,
    txn_app_id: str | None = None,
    storage_options: dict[str, str] | None = None,
) -> Adopted:
    """Copy the Spark checkpoint at ``checkpoint`` (the old query's
    ``checkpointLocation``) to ``pipeline``'s in the job's ``state_dir``, after
    settling its last batch against the Delta table the old query wrote
    (``delta_table``, under ``txn_app_id``). Local directories (copy a remote
    checkpoint down first). See the module's rules."""
    if scheme_of(state_dir) is not None:
        raise AdoptionRefusedError(
            f"state_dir {os.fspath(state_dir)!r} is a URI; adopt into a local state_dir (copy "
            "it up afterwards with the job stopped), or copy the checkpoint by hand"
        )
    old = Path(checkpoint)
    offsets = _batches(old / "offsets")
    if not offsets:
        raise AdoptionRefusedError(
            f"{old} has no offsets/: not the checkpointLocation of a streaming query that ran"
        )
    last = max(offsets)
    commits = _batches(old / "commits")
    committed = last in commits
    if not committed and last > 0 and last - 1 not in commits:
        raise AdoptionRefusedError(
            f"{old} planned batch {last} but recorded neither it nor batch {last - 1} done: "
            "not a log Spark leaves; run the old query again until it settles"
        )
    target = Path(state_dir) / "pipelines" / pipeline / "spark"
    if target.exists() and any(target.iterdir()):
        raise AdoptionRefusedError(
            f"pipeline {pipeline!r} of {state_dir} already has a Spark checkpoint ({target}); "
            "adopting is for a job's first start"
        )
    landed: int | None = None
    if delta_table is not None or txn_app_id is not None:
        if delta_table is None or txn_app_id is None:
            raise AdoptionRefusedError("give both delta_table and txn_app_id, or neither")
        landed = _txn_version(os.fspath(delta_table), txn_app_id, storage_options)
        done = max(commits, default=None)
        if done is not None and (landed is None or landed < done):
            raise AdoptionRefusedError(
                f"{delta_table} holds txnVersion {landed} of {txn_app_id!r}, but {old} recorded "
                f"batch {done} done: is this the table and app id the old query wrote? "
                "(Deciding on it could write a batch that landed twice)"
            )
        if landed is not None and landed > last:
            raise AdoptionRefusedError(
                f"{delta_table} holds txnVersion {landed} of {txn_app_id!r}, past the last batch "
                f"{last} that {old} planned: the table has batches this checkpoint never "
                "planned (another query under the same app id, or an older checkpoint); "
                "adopting it would write them again"
            )
    if not committed and landed is None and delta_table is None:
        raise AdoptionRefusedError(
            f"{old} planned batch {last} and did not record it done (the query stopped or "
            "crashed inside it): give delta_table and txn_app_id so that the table tells "
            "whether its write landed, or run the old query to the end of that batch first"
        )
    record = not committed and landed == last
    if record:
        _check_recordable(old, last)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.adopting")
    shutil.rmtree(staging, ignore_errors=True)  # an adoption that crashed half-way
    shutil.copytree(old, staging)
    if record:
        _record_commit(staging / "commits", last)
    _fsync_tree(staging)
    if target.exists():
        target.rmdir()  # empty (checked above)
    os.replace(staging, target)
    fsync_dir(target.parent)
    return Adopted(target, last, recorded=record, replays=not committed and not record)


def _check_recordable(old: Path, batch: int) -> None:
    """Refuse to record ``batch`` done where Spark's entry would carry more than
    the entry before it (state versions, a watermark only batch ``batch`` sets)."""
    commits = old / "commits"
    before = sorted(b for b in _batches(commits) if b < batch)
    header = (commits / str(before[-1])).read_text().split("\n", 1)[0] if before else "v1"
    if (old / "state").exists() or header != "v1":
        raise AdoptionRefusedError(
            f"{old}: batch {batch} landed in the table but Spark did not record it done, and "
            "the query is stateful (or its commit log is not v1): the entry Spark would write "
            "carries state versions and a watermark only Spark knows. Run the old query until "
            f"batch {batch} is recorded done (it skips the write: txnVersion), then adopt"
        )


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def _batches(directory: Path) -> set[int]:
    if not directory.is_dir():
        return set()
    return {int(n) for n in os.listdir(directory) if n.isdigit()}


def _txn_version(table: str, app: str, storage_options: dict[str, str] | None) -> int | None:
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        dt = DeltaTable(table, storage_options=storage_options or None)
    except TableNotFoundError:
        return None
    return dt.transaction_version(app)


def _record_commit(commits: Path, batch: int) -> None:
    """Write ``commits/<batch>`` as Spark writes it: the entry of the batch
    before (same watermark), or an empty one."""
    before = sorted(b for b in _batches(commits) if b < batch)
    content = (commits / str(before[-1])).read_text() if before else _EMPTY_COMMIT
    commits.mkdir(parents=True, exist_ok=True)
    atomic_write(commits / str(batch), content.encode())
