"""Say why a sink write failed in the user's terms, in one line.

An executor's exception reaches the driver as text (the Python worker's
traceback inside Spark's error), so errors are described by :class:`Raised`:
the exception's qualified type name and its message. :func:`explain` walks a
chain of them from the outermost exception inwards and returns the first
translation it finds:

* known errors of the target systems (:data:`TRANSLATORS`): PostgreSQL
  ``NotNullViolation``, ``StringDataRightTruncation``, ``NumericValueOutOfRange``
  and ``UniqueViolation`` name the column and the *target* table (never an
  upsert's private staging table); Kafka ``MessageSizeTooLargeError`` names the
  record size, the limit and the settings that change it;
* this project's own errors (:class:`sinks.errors.TwoPhaseError` and its
  subclasses) pass through with their message;
* anything else: the last exception line (type and first message line).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sinks.base import Sink
from sinks.errors import TwoPhaseError
from sinks.kafka.sink import KafkaSink
from sinks.postgres.sink import PostgresSink
from sinks.postgres.writer import STAGE_NAME

MAX_CAUSE = 400  # characters of an untranslated message kept in the one-line cause


@dataclass(frozen=True)
class Raised:
    """One exception of a chain, as printed in a traceback."""

    type: str
    """qualified type name, e.g. ``psycopg.errors.NotNullViolation``"""
    message: str
    """the message (may span lines: PostgreSQL's DETAIL and CONTEXT)"""

    @property
    def name(self) -> str:
        """The type name without its module."""
        return self.type.rpartition(".")[2]

    def field(self, label: str) -> str | None:
        """A ``LABEL:  value`` line of the message (PostgreSQL's DETAIL, CONTEXT)."""
        m = re.search(rf"^{label}:\s+(.*)$", self.message, re.MULTILINE)
        return m.group(1).strip() if m else None

    @property
    def headline(self) -> str:
        """The first line of the message."""
        return self.message.split("\n", 1)[0].strip()


Translator = Callable[[Sink | None, Raised], str | None]


# -- PostgreSQL ------------------------------------------------------------------------


def _table(sink: Sink | None) -> str:
    if isinstance(sink, PostgresSink):
        return f"{sink.schema}.{sink.table}"
    return "the target table"


def _scrub(sink: Sink | None, text: str) -> str:
    """Name the target table instead of an upsert's staging table."""
    if not isinstance(sink, PostgresSink):
        return text
    text = re.sub(rf'"?{re.escape(sink.marker_schema)}"?\."?({STAGE_NAME.pattern})"?', "\\1", text)
    return STAGE_NAME.sub(_table(sink), text)


def _copy_column(raised: Raised) -> str | None:
    """The column a COPY failed on (CONTEXT: ``COPY t, line 3, column amount: "x"``)."""
    context = raised.field("CONTEXT") or ""
    m = re.search(r"\bcolumn (.+?)(?::|$)", context)
    return m.group(1).strip() if m else None


def _not_null(sink: Sink | None, raised: Raised) -> str | None:
    m = re.search(r'null value in column "([^"]+)"', raised.message)
    if m is None:
        return None
    row = raised.field("DETAIL") or ""
    row = row.removeprefix("Failing row contains ").rstrip(".")
    seen = f" (failing row: {_short(row, 120)})" if row else ""
    return (
        f'column "{m.group(1)}" of {_table(sink)} is NOT NULL, but a row has a null there{seen}; '
        "fill or filter the nulls before the sink, or allow nulls in the column"
    )


def _too_long(sink: Sink | None, raised: Raised) -> str | None:
    m = re.search(r"value too long for type (.+)$", raised.headline)
    column = _copy_column(raised)
    if m is None:
        return None
    where = f'column "{column}" ({m.group(1)})' if column else f"a column of type {m.group(1)}"
    return (
        f"a value is too long for {where} of {_table(sink)}; shorten it before the sink "
        "or widen the column"
    )


def _out_of_range(sink: Sink | None, raised: Raised) -> str | None:
    column = _copy_column(raised)
    detail = raised.field("DETAIL")
    why = raised.headline + (f": {detail}" if detail else "")
    where = f'column "{column}"' if column else "a column"
    return (
        f"a value is out of range for {where} of {_table(sink)} ({why}); cast or filter it "
        "before the sink, or widen the column's type"
    )


def _unique(sink: Sink | None, raised: Raised) -> str | None:
    m = re.search(r'unique constraint "([^"]+)"', raised.headline)
    detail = (raised.field("DETAIL") or "").rstrip(".")
    constraint = f' (unique constraint "{m.group(1)}")' if m else ""
    what = f"duplicate key in {_table(sink)}" + (f": {detail}" if detail else "")
    if isinstance(sink, PostgresSink) and sink.key:
        hint = f"the sink upserts by key {sink.key}; another unique index conflicts"
    else:
        hint = "the sink appends: pass key=[...] to PostgresSink to upsert, or drop the duplicates"
    return f"{what}{constraint}; {hint}"


# -- Kafka -----------------------------------------------------------------------------


def _too_large(sink: Sink | None, raised: Raised) -> str | None:
    topic = f"topic {sink.topic}" if isinstance(sink, KafkaSink) else "the topic"
    limit = sink.max_request_size if isinstance(sink, KafkaSink) else 1048576
    m = re.search(r"The message is (\d+) bytes", raised.message)
    if m is not None:  # kafka-python refused it before sending
        return (
            f"a record of {int(m.group(1)):,} bytes (key, value and headers) for {topic} is "
            f"larger than the producer's limit max_request_size={limit:,} bytes; raise it with "
            "KafkaSink(producer_config={'max_request_size': ...}) and the topic's "
            "max.message.bytes (broker default message.max.bytes) to match, or make the "
            "records smaller"
        )
    return (
        f"the broker refused a record for {topic} as larger than the topic's "
        "max.message.bytes (broker default message.max.bytes); raise that setting "
        f"(and the producer's max_request_size={limit:,} bytes with it, through "
        "KafkaSink(producer_config=...)), or make the records smaller"
    )


TRANSLATORS: dict[str, Translator] = {
    "psycopg.errors.NotNullViolation": _not_null,
    "psycopg.errors.StringDataRightTruncation": _too_long,
    "psycopg.errors.NumericValueOutOfRange": _out_of_range,
    "psycopg.errors.UniqueViolation": _unique,
    "kafka.errors.MessageSizeTooLargeError": _too_large,
}
"""Known errors by qualified type name (as a traceback prints it)."""


# -- explain -----------------------------------------------------------------------------


def _ours() -> set[str]:
    found: set[str] = set()
    todo: list[type] = [TwoPhaseError]
    while todo:
        cls = todo.pop()
        found.add(f"{cls.__module__}.{cls.__qualname__}")
        todo.extend(cls.__subclasses__())
    return found


def _short(text: str, limit: int = MAX_CAUSE) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def explain(sink: Sink | None, chain: Sequence[Raised]) -> str:
    """One line saying why a write to ``sink`` failed; ``chain`` lists the
    exceptions innermost first (as a traceback prints them), the outermost last."""
    ours = _ours()
    for raised in reversed(chain):
        translate = TRANSLATORS.get(raised.type)
        said = translate(sink, raised) if translate else None
        if said is None and raised.type in ours:
            said = f"{raised.name}: {raised.message}"
        if said is not None:
            return " ".join(_scrub(sink, said).split())
    if not chain:
        return "unknown cause"
    last = chain[-1]
    text = f"{last.name}: {last.headline}" if last.headline else last.name
    return _short(_scrub(sink, text))
