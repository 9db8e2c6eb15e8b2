"""Deterministic transaction names.

Every sink transaction is named from (job, pipeline, sink, incarnation, run,
batch, partition, task attempt)::

    tp2.<job>.<pipeline>.<sink_id>.i<incarnation>.r<run>.b<batch>.p<partition>.a<attempt>

The name is a PostgreSQL gid, a Kafka ``transactional.id`` suffix and a Delta
staged-file prefix. The **incarnation** is the random id of the job's ledger
(a new ``state_dir`` is a new incarnation), so two incarnations of one job
never create the same name, and the run number goes up at every start of one
incarnation, so a zombie task of an earlier run never collides with a task of
this one. Names are parseable so that recovery can tell, for any lingering
transaction, which incarnation, pipeline, batch and run it belongs to. Job,
pipeline and sink ids are restricted to ``[A-Za-z0-9_-]`` so the separator is
unambiguous and the name is safe in SQL literals and file names.

Names of the first format (``tp1.``, no incarnation) were written by versions
before incarnations existed; they still parse (``incarnation`` is ``None``), so
work prepared before an upgrade recovers after it. Every version that wrote
the second format made its incarnation 12 lowercase hex digits (6 random
bytes, since the format began), so a ``tp2.`` name with an incarnation of any
other length is none of ours and does not parse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sinks.errors import ConfigError

_ID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_INCARNATION = re.compile(r"^[0-9a-f]{12}$")
_NAME = re.compile(
    r"^tp(?P<format>[12])\.(?P<job>[A-Za-z0-9_-]+)\.(?P<pipeline>[A-Za-z0-9_-]+)"
    r"\.(?P<sink>[A-Za-z0-9_-]+)(?:\.i(?P<inc>[0-9a-f]{12}))?"
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


def check_incarnation(value: str) -> str:
    """Return ``value`` if it is a valid incarnation id (lowercase hex), else raise."""
    if not isinstance(value, str) or not _INCARNATION.match(value):
        raise ConfigError(
            f"{value!r} is not an incarnation id (12 lowercase hex digits, as "
            "`twophase status` and the error that named it print it)"
        )
    return value


def scope_prefix(job: str, pipeline: str, sink_id: str, incarnation: str | None) -> str:
    """The prefix of every name of (job, pipeline, sink) in ``incarnation``
    (``None``: the names of the first format, before incarnations)."""
    if incarnation is None:
        return f"tp1.{job}.{pipeline}.{sink_id}."
    return f"tp2.{job}.{pipeline}.{sink_id}.i{incarnation}."


def scope_prefixes(job: str, pipeline: str, sink_id: str) -> tuple[str, str]:
    """The prefixes of (job, pipeline, sink) names of every incarnation, both
    formats (a name of the scope starts with one of them)."""
    return (f"tp1.{job}.{pipeline}.{sink_id}.", f"tp2.{job}.{pipeline}.{sink_id}.i")


@dataclass(frozen=True)
class TxnName:
    """A parsed transaction name (``incarnation`` is None for first-format names)."""

    job: str
    pipeline: str
    sink_id: str
    run: int
    batch_id: int
    partition: int
    attempt: int
    incarnation: str | None = None

    def __str__(self) -> str:
        return (
            f"{scope_prefix(self.job, self.pipeline, self.sink_id, self.incarnation)}"
            f"r{self.run}.b{self.batch_id}.p{self.partition}.a{self.attempt}"
        )

    def partition_prefix(self) -> str:
        """The prefix shared by every attempt of this (run, batch, partition)."""
        return str(self)[: -len(str(self.attempt))]

    @staticmethod
    def job_prefixes(job: str) -> tuple[str, str]:
        """The prefixes of every name of ``job``, both formats."""
        return (f"tp1.{job}.", f"tp2.{job}.")

    @classmethod
    def require(cls, text: str) -> TxnName:
        """Parse a name that must be one of this scheme (a committable's)."""
        name = cls.parse(text)
        if name is None:
            raise ValueError(f"{text!r} is not a transaction name of this project")
        return name

    @classmethod
    def parse(cls, text: str) -> TxnName | None:
        """Parse a name; ``None`` when ``text`` is not a name of this scheme."""
        m = _NAME.match(text)
        if m is None or (m["format"] == "2") != (m["inc"] is not None):
            return None
        return cls(
            job=m["job"],
            pipeline=m["pipeline"],
            sink_id=m["sink"],
            run=int(m["run"]),
            batch_id=int(m["batch"]),
            partition=int(m["partition"]),
            attempt=int(m["attempt"]),
            incarnation=m["inc"],
        )
