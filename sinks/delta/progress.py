"""The Delta sink's memory of its own progress (see :mod:`sinks.progress`).

Everything lives in Delta **app transactions** (``txn`` actions), which are
part of the table's state: every Delta checkpoint carries the latest ``txn`` of
each app id, so they survive log cleanup, unlike commit info. (A table
property ``delta.setTransactionRetentionDuration`` would expire them; preflight
refuses such a table.) Per scope (job, pipeline, sink):

* ``tp2.<job>.<pipeline>.<sink>.owner``: its version is the owner incarnation
  (12 hex digits read as a 48-bit number);
* ``tp2.<job>.<pipeline>.<sink>.previous``: the incarnation a start-over took
  the claim from;
* ``tp2.<job>.<pipeline>.<sink>.i<incarnation>`` (:func:`progress_app`): its
  version is the highest batch that incarnation committed. It is written by the
  very commit that adds the batch's files, so the table holds the rows and the
  record of them, or neither.

A claim and every data commit are compare-and-set: the commit is built on the
snapshot that was checked and made with ``max_commit_retries=0``, so when
another writer committed in between, delta-rs does not rebase it: it fails,
and the check runs again on the new snapshot. Two jobs claiming at the same
instant both try to create the same log version; one wins, the other re-reads
and finds the winner's claim.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Protocol

from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.transaction import AddAction

from sinks.base import JobScope
from sinks.naming import scope_prefix
from sinks.progress import SinkProgress

RETENTION_PROPERTY = "delta.setTransactionRetentionDuration"


def _base(scope: JobScope) -> str:
    return f"tp2.{scope.job}.{scope.pipeline}.{scope.sink_id}"


def owner_app(scope: JobScope) -> str:
    return _base(scope) + ".owner"


def previous_app(scope: JobScope) -> str:
    return _base(scope) + ".previous"


def progress_app(scope: JobScope) -> str:
    """The app id under which ``scope.incarnation``'s commits are recorded
    (``tp1.<job>.<pipeline>.<sink>`` for first-format work)."""
    return scope_prefix(scope.job, scope.pipeline, scope.sink_id, scope.incarnation).rstrip(".")


def user_metadata(app: str, batch: int) -> str:
    """The ``userMetadata`` of a data commit: the column of delta-spark's
    ``DESCRIBE HISTORY`` that shows a user which app transaction it is."""
    return f"twophase {app} batch {batch}"


def parse_user_metadata(text: str | None) -> tuple[str, int] | None:
    """``(app, batch)`` of :func:`user_metadata`'s text, else ``None``."""
    parts = (text or "").split(" ")
    if len(parts) == 4 and parts[0] == "twophase" and parts[2] == "batch" and parts[3].isdigit():
        return parts[1], int(parts[3])
    return None


def added_totals(adds: Sequence[AddAction]) -> tuple[int, int]:
    """Rows (the files' ``numRecords``) and bytes of ``adds``: what a commit's
    history metrics say it added."""
    rows = sum(int(json.loads(a.stats or "{}").get("numRecords", 0)) for a in adds)
    return rows, sum(int(a.size) for a in adds)


def history_metadata(
    app: str,
    batch: int,
    adds: Sequence[AddAction],
    *,
    removed_files: int = 0,
    removed_bytes: int = 0,
) -> dict[str, Any]:
    """What a delta-rs data commit's ``commitInfo`` carries besides delta-rs's
    own fields: the app transaction for the sink's audit, ``userMetadata``
    (delta-spark's commits carry only that), and ``operationMetrics`` under
    delta-spark's names and as its strings, so that ``DESCRIBE HISTORY`` shows
    them (delta-rs's own are numbers under other names, which delta-spark's
    history reads as none)."""
    rows, size = added_totals(adds)
    metrics = {
        "numFiles": len(adds),
        "numOutputRows": rows,
        "numOutputBytes": size,
        "numRemovedFiles": removed_files,
        "numRemovedBytes": removed_bytes,
    }
    return {
        "twophaseApp": app,
        "twophaseBatch": batch,
        "userMetadata": user_metadata(app, batch),
        "operationMetrics": {k: str(v) for k, v in metrics.items()},
    }


def _number(incarnation: str) -> int:
    return int(incarnation, 16)


def _incarnation(number: int | None) -> str | None:
    return None if number is None else format(number, "012x")


class AppVersions(Protocol):
    """A snapshot's app transactions: a delta-rs ``DeltaTable`` or a delta-spark
    transaction (:class:`~sinks.delta.spark_txn.SparkTxn`)."""

    def transaction_version(self, app_id: str) -> int | None: ...


def read(dt: AppVersions, scope: JobScope) -> SinkProgress:
    """The progress record of ``scope`` in the snapshot ``dt``."""
    owner = _incarnation(dt.transaction_version(owner_app(scope)))
    if owner is None:
        return SinkProgress(owner=None)
    mine = JobScope(scope.job, scope.pipeline, scope.sink_id, owner)
    batch = dt.transaction_version(progress_app(mine))
    return SinkProgress(
        owner=owner,
        batch=-1 if batch is None else batch,
        previous=_incarnation(dt.transaction_version(previous_app(scope))),
    )


def claim_transactions(scope: JobScope, previous: str | None) -> list[Transaction]:
    """The ``txn`` actions that make ``scope.incarnation`` the owner."""
    assert scope.incarnation is not None
    now = int(time.time() * 1000)
    txns = [Transaction(owner_app(scope), _number(scope.incarnation), now)]
    if previous is not None:
        txns.append(Transaction(previous_app(scope), _number(previous), now))
    return txns


def commit_claim(dt: DeltaTable, scope: JobScope, previous: str | None) -> None:
    """Commit a claim on top of exactly the snapshot ``dt`` (raises
    ``CommitFailedError`` when another commit came first)."""
    dt.create_write_transaction(
        [],
        mode="append",
        schema=dt.schema(),
        partition_by=dt.metadata().partition_columns or None,
        commit_properties=CommitProperties(
            app_transactions=claim_transactions(scope, previous),
            custom_metadata={"twophaseClaim": scope.key(), "twophaseOwner": scope.incarnation},
            max_commit_retries=0,
        ),
    )
