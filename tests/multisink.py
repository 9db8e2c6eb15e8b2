"""A run of ``tests/jobs/multi_sink_job.py`` (one bounded pipeline writing the
same batches to Delta, PostgreSQL and Kafka) and its checks: every row exactly
once in every sink, nothing staged, prepared or open, one Delta version per
checkpoint. Used by the Delta crash tests and the cluster tests."""

from __future__ import annotations

import uuid
from pathlib import Path

from lifecycle.job_sinks import sink_label
from lifecycle.ledger import read_ledger
from lifecycle.state.pg_location import is_pg_location
from sinks.base import JobScope
from sinks.delta.sink import app_id
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
    ) -> None:
        """``state``: the job's state_dir (a URI: give ``ledger``, the job's
        ``ledger=``, too: a directory, or a PostgreSQL URI as a str);
        ``delta_write_with``: the Delta sink's ``write_with`` (None: its default)."""
        self.tmp = tmp
        self.dsn = dsn
        self.bootstrap = bootstrap
        self.topic = topic
        self.delta = tmp / "delta" / "orders"
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
    ) -> JobProcess:
        opts = {
            "dsn": self.dsn,
            "bootstrap": self.bootstrap,
            "topic": self.topic,
            "delta": str(self.delta),
            "state": str(self.state),
            "input": str(self.tmp / "in"),
            "job": self.job,
            "interval": str(interval),
            "files-per-batch": str(files_per_batch),
            "sinks": self.sinks,
            "ledger": str(self.ledger) if self.ledger else None,
            "delta-write-with": self.delta_write_with,
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
            timeout=240,
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
        uri = str(self.delta)
        if "delta" in self.sinks:
            deltacheck.assert_exactly_once(uri, n)
            deltacheck.assert_nothing_staged(uri)
            deltacheck.assert_created_once(uri)
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
