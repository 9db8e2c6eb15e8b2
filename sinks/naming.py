"""Deterministic transaction names.

Every sink transaction is named from (job, pipeline, sink, run, batch,
partition, task attempt)::

    tp1.<job>.<pipeline>.<sink_id>.r<run>.b<batch>.p<partition>.a<attempt>

The name is a PostgreSQL gid, a Kafka ``transactional.id`` prefix and a Delta
staged-file prefix. Names are parseable so that recovery can tell, for any
lingering transaction, which pipeline, batch and run it belongs to. Job,
pipeline and sink ids are restricted to ``[A-Za-z0-9_-]`` so the separator is
unambiguous and the name is safe in SQL literals and file names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sinks.errors import ConfigError

_ID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_NAME = re.compile(
    r"^tp1\.(?P<job>[A-Za-z0-9_-]+)\.(?P<pipeline>[A-Za-z0-9_-]+)\.(?P<sink>[A-Za-z0-9_-]+)"
    r"\.r(?P<run>\d+)\.b(?P<batch>\d+)\.p(?P<partition>\d+)\.a(?P<attempt>\d+)$"
)


def check_id(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid job, pipeline or sink id, else raise."""
    if not isinstance(value, str) or not _ID.match(value):
        raise ConfigError(
            f"{kind} {value!r} is not a valid id: use 1 to 40 characters from "
            "A-Z a-z 0-9 _ - (it becomes part of transaction names)"
        )
    return value


@dataclass(frozen=True, order=True)
class TxnName:
    """A parsed transaction name."""

    job: str
    pipeline: str
    sink_id: str
    run: int
    batch_id: int
    partition: int
    attempt: int

    def __str__(self) -> str:
        return (
            f"{self.scope_prefix(self.job, self.pipeline, self.sink_id)}"
            f"r{self.run}.b{self.batch_id}.p{self.partition}.a{self.attempt}"
        )

    def partition_prefix(self) -> str:
        """The prefix shared by every attempt of this (run, batch, partition)."""
        return str(self)[: -len(str(self.attempt))]

    @staticmethod
    def scope_prefix(job: str, pipeline: str, sink_id: str) -> str:
        return f"tp1.{job}.{pipeline}.{sink_id}."

    @staticmethod
    def job_prefix(job: str) -> str:
        return f"tp1.{job}."

    @classmethod
    def parse(cls, text: str) -> TxnName | None:
        """Parse a name; ``None`` when ``text`` is not a name of this scheme."""
        m = _NAME.match(text)
        if m is None:
            return None
        return cls(
            job=m["job"],
            pipeline=m["pipeline"],
            sink_id=m["sink"],
            run=int(m["run"]),
            batch_id=int(m["batch"]),
            partition=int(m["partition"]),
            attempt=int(m["attempt"]),
        )
