"""A run of ``tests/jobs/multi_sink_job.py`` (one bounded pipeline writing the
same batches to Delta, PostgreSQL and Kafka) and its checks: every row exactly
once in every sink, nothing staged, prepared or open, one Delta version per
checkpoint. Used by the Delta crash tests and the cluster tests.

The table, the input and the state may be on stores (``s3://``, ``hdfs://``):
then the table is read through deltalake's store with its storage options,
and its ``_delta_log`` is copied to a local directory for the checks that
read the log's actions (:mod:`tests.deltacheck` reads local tables only)."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from lifecycle.job_sinks import sink_label
from lifecycle.ledger import read_ledger
from lifecycle.state.pg_location import is_pg_location
from lifecycle.testing import verify
from sinks.base import JobScope
from sinks.delta.committer import app_id
from tests import deltacheck
from tests.jobs.multi_sink_job import SINK_IDS
from tests.kafkacheck import assert_exactly_once as kafka_exactly_once
from tests.kafkacheck import assert_nothing_open
from tests.pgcheck import assert_exactly_once as pg_exactly_once
from tests.pgcheck import job_prepared
from tests.procs import JobProcess, run_job

ORDER = "delta,pg,kafka"
LABELS = {kind: sink_label("load", sid) for kind, sid in SINK_IDS.items()}


class Run:
    """One scenario: input, the three targets, state_dir, the job's command line."""

    def __init__(
        self,
        tmp: Path,
        dsn: str | None,
        bootstrap: str | None,
        topic: str | None,
        *,
        sinks: str | None = None,
        state: Path | str | None = None,
        env: dict[str, str] | None = None,
        ledger: Path | str | None = None,
        delta_write_with: str | None = None,
        delta: Path | str | None = None,
        delta_options: dict[str, str] | None = None,
        input: str | None = None,
    ) -> None:
        """``state``: the job's state_dir (a URI: give ``ledger``, the job's
        ``ledger=``, too: a directory, or a PostgreSQL URI as a str);
        ``delta_write_with``: the Delta sink's ``write_with`` (None: its default);
        ``delta``: the table (default ``tmp/delta/orders``; a URI such as
        ``s3://bucket/orders``, with deltalake's ``delta_options``); ``input``:
        where the job reads its JSON files (default ``tmp/in``; a URI such as
        ``hdfs://host:port/in``)."""
        self.tmp = tmp
        self.dsn = dsn
        self.bootstrap = bootstrap
        self.topic = topic
        self.delta: Path | str = delta if delta is not None else tmp / "delta" / "orders"
        self.delta_options = delta_options
        self.input = input if input is not None else str(tmp / "in")
        self.state = state or tmp / "state"
        self.job = f"dc{uuid.uuid4().hex[:8]}"  # the Kafka registry topic is shared
        self.sinks = sinks or (ORDER if dsn else "delta")
        self.env = env
        self.ledger = ledger
        self.delta_write_with = delta_write_with
        self.cwd: Path | None = None  # the jobs' working directory (None: the checkout)

    def start(
        self,
        fault: str | None = None,
        interval: float = 0.0,
        files_per_batch: int = 1,
        extra: list[str] | None = None,
        wait: bool = True,
        timeout: float = 240,
    ) -> JobProcess:
        """Start the job (``fault``: its ``TWOPHASE_FAULT``); with ``wait``, run it
        to its end, killed after ``timeout`` s."""
        opts = {
            "dsn": self.dsn,
            "bootstrap": self.bootstrap,
            "topic": self.topic,
            "delta": str(self.delta),
            "state": str(self.state),
            "input": self.input,
            "job": self.job,
            "interval": str(interval),
            "files-per-batch": str(files_per_batch),
            "sinks": self.sinks,
            "ledger": str(self.ledger) if self.ledger else None,
            "delta-write-with": self.delta_write_with,
            "delta-options": json.dumps(self.delta_options) if self.delta_options else None,
        }
        args = [a for k, v in opts.items() if v is not None for a in (f"--{k}", v)]
        log = self.tmp / f"job-{'fault' if fault else 'clean'}.log"
        if not wait:
            return JobProcess(
                "multi_sink_job.py", [*args, *(extra or [])], log, fault, self.env, cwd=self.cwd
            )
        return run_job(
            "multi_sink_job.py",
            [*args, *(extra or [])],
            log,
            fault,
            timeout=timeout,
            env=self.env,
            cwd=self.cwd,
        )

    def ledger_location(self) -> Path | str | None:
        """The job's ``ledger=`` as the checks read it: a PostgreSQL URI names the
        job (so no URI state_dir is read for its ``ledger.location``)."""
        if isinstance(self.ledger, str) and is_pg_location(self.ledger):
            return f"{self.ledger}{'&' if '?' in self.ledger else '?'}job={self.job}"
        return self.ledger

    def check(
        self, n: int, per_checkpoint: bool = True, owed: bool = False
    ) -> list[deltacheck.Version]:
        """Exactly once and nothing left behind in every sink; the ledger's
        checkpoints committed all three sinks together. Returns the Delta
        versions of the job (with ``per_checkpoint``, checked one to one against
        the ledger's checkpoints; off for a state an earlier version began,
        whose versions carry its own app id). ``owed``: a sink lost work that was
        written again (recovery rule 5), so the checkpoints' rows differ per sink."""
        uri = self._delta_checked(n) if "delta" in self.sinks else str(self.delta)
        labels = [LABELS[kind] for kind in self.sinks.split(",")]
        if self.dsn:
            pg_exactly_once(self.dsn, "orders", n)
            assert job_prepared(self.dsn, self.job) == []
        if self.bootstrap and self.topic:
            kafka_exactly_once(self.bootstrap, self.topic, n)
            assert_nothing_open(self.bootstrap, self.topic, self.job)

        doc = read_ledger(self.state, self.ledger_location())
        assert doc is not None and doc["pending"] == {} and doc["decided"] is None
        assert doc["finished"] == ["load"]
        assert doc["totals"] == {label: n for label in labels}
        assert doc.get("owed", {}) == {}
        for cp in [] if owed else doc["history"]:
            if cp["rows"]:
                assert sorted(cp["rows"]) == sorted(labels), cp
                assert len(set(cp["rows"].values())) == 1, f"sinks disagree: {cp}"
        if "delta" not in self.sinks or not per_checkpoint:
            return []
        app = app_id(JobScope(self.job, "load", SINK_IDS["delta"], doc["incarnation"]))
        return deltacheck.assert_one_version_per_checkpoint(uri, doc, "load", LABELS["delta"], app)

    def delta_on_a_store(self) -> bool:
        """Whether the table is on a store (a URI other than ``file://``)."""
        return "://" in str(self.delta) and not str(self.delta).startswith("file://")

    def _delta_checked(self, n: int) -> str:
        """Every row once in the table, nothing staged, created once; returns
        where :mod:`tests.deltacheck` reads its log (the table, or a local copy
        of the log of a table on a store)."""
        uri = str(self.delta)
        if not self.delta_on_a_store():
            deltacheck.assert_exactly_once(uri, n)
            deltacheck.assert_nothing_staged(uri)
            deltacheck.assert_created_once(uri)
            return uri
        options = self.delta_options
        verify.assert_exactly_once_delta(uri, range(n), storage_options=options)
        copy = copy_delta_log(uri, self.tmp / "delta-log-copy", options)
        deltacheck.assert_created_once(copy)
        return str(copy)


def copy_delta_log(uri: str, into: Path, storage_options: dict[str, str] | None) -> Path:
    """The commits of the table at ``uri`` (``_delta_log/*.json``) copied through
    deltalake's store into ``into/_delta_log``, replacing an earlier copy;
    returns ``into``."""
    import pyarrow.fs as pafs
    from deltalake.fs import DeltaStorageHandler

    fs = pafs.PyFileSystem(DeltaStorageHandler(uri, dict(storage_options or {}) or None))
    found = fs.get_file_info(pafs.FileSelector("_delta_log", allow_not_found=True))
    shutil.rmtree(into, ignore_errors=True)
    (into / "_delta_log").mkdir(parents=True)
    for info in found:
        name = info.path.rsplit("/", 1)[-1]
        if info.type == pafs.FileType.File and name.endswith(".json"):
            with fs.open_input_stream(info.path) as f:
                (into / "_delta_log" / name).write_bytes(f.read())
    return into
