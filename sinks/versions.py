"""The version markers of what this project writes outside its ledger, and the
refusal of a marker newer than this version reads.

Records that outlive the version that wrote them carry a version number: the
Kafka sink's claim and progress records (``"v"``, :mod:`sinks.kafka.progress`),
its registry announcements (``"v"``, :mod:`sinks.kafka.registry`) and the
job's heartbeat (``"schema"``, :mod:`lifecycle.heartbeat`). A reader takes a
record without a marker as version 1 (what the first versions wrote), and any
version up to its own as it always did. A record of a later version was
written by a newer twophase, whose change of format this version cannot know:
read as if it were its own, it could be misread (an owner, a committed batch,
a transaction to sweep), so :func:`check_version` refuses it with
:class:`NewerVersionError`, naming the version and where the record was read.
That is what a downgrade meets: run the newer version (or a later one) again.
"""

from __future__ import annotations

from typing import Any

from sinks.errors import ConfigError


class NewerVersionError(ConfigError):
    """A record was written by a newer version of twophase than this one (a
    downgrade): it is refused rather than misread. The message names the
    record, where it was read, its version and the newest this one reads."""

    def __init__(self, message: str, *, version: int, known: int) -> None:
        super().__init__(message)
        self.version = version
        self.known = known


def version_of(marker: Any) -> int | None:
    """The version a record's marker says: 1 when it has none (the first
    versions wrote none, or wrote 1), the number when it is one, None when it
    is not a version number (a record of someone else)."""
    if marker is None:
        return 1
    if isinstance(marker, bool) or not isinstance(marker, int):
        return None
    return marker


def check_version(marker: Any, known: int, what: str) -> None:
    """Raise :class:`NewerVersionError` when ``marker`` (a record's version
    field, None when absent) is a version above ``known``, the newest this
    version reads; ``what`` names the record and where it was read."""
    version = version_of(marker)
    if version is not None and version > known:
        raise NewerVersionError(
            f"{what} is of version {version}, written by a newer version of twophase: "
            f"this one reads versions up to {known} and refuses it rather than misread it. "
            "Run the job and the twophase commands with the version that wrote it, or a "
            "later one",
            version=version,
            known=known,
        )
