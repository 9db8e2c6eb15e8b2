"""From a Spark/Py4J error to the failure a person reads: where, and why in one line.

An exception in an executor's Python worker reaches the driver as text: PySpark
raises ``PythonException`` (``collect()`` in the batch handler) or
``StreamingQueryException`` (the terminated query) whose message embeds the
worker's traceback, itself inside a Py4J traceback. :func:`exception_chain`
reads every exception line of such a text (type, message with its DETAIL and
CONTEXT lines), leaving out Spark's and Py4J's envelopes; :mod:`sinks.explain`
turns the chain into one line in the user's terms.

The batch handler records a :class:`TaskFailure` (pipeline, sink, batch,
cause, full trace) when a sink write fails; the job turns it into a
:class:`lifecycle.errors.TaskFailedError` when the query has terminated.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass

from lifecycle.errors import PipelineFailedError, TaskFailedError
from sinks.base import Sink
from sinks.explain import Raised, explain

_HEADLINE = re.compile(r"^([A-Za-z_][\w.]*)(?:: ?(.*))?$")
_ENDS = (
    "Traceback (most recent call last):",
    "The above exception was the direct cause",
    "During handling of the above exception",
    "JVM stacktrace:",
    "=== Streaming Query ===",
    "\tat ",
)
_ENVELOPES = ("pyspark.errors.", "py4j.", "org.apache.spark.")


def exception_chain(text: str) -> list[Raised]:
    """Every exception printed in ``text`` (Python tracebacks, also those embedded
    in another exception's message), in the order printed: for one chain that is
    innermost first. Spark's and Py4J's envelope exceptions are left out unless
    nothing else is there."""
    found: list[tuple[str, list[str]]] = []
    frames = False
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(_ENDS) or (current is not None and not line.strip()):
            frames = line.startswith("Traceback (most recent call last):")
            current = None
            continue
        if frames:
            if not line.strip() or line[0] in " \t":
                continue  # a frame, its source line, its ^^^ marks
            frames = False
            m = _HEADLINE.match(line)
            if m is not None:
                current = [m.group(2) or ""]
                found.append((m.group(1), current))
            continue
        if current is not None:
            current.append(line)
    chain = [Raised(t, "\n".join(lines).strip()) for t, lines in found]
    inner = [r for r in chain if not r.type.startswith(_ENVELOPES)]
    return inner or chain


def full_trace(exc: BaseException) -> str:
    """The whole trace of ``exc`` (its chain, and the executor's traceback inside
    its message): what goes to the log."""
    return "".join(traceback.format_exception(exc)).rstrip()


def cause_of(exc: BaseException, sink: Sink | None) -> str:
    """One line in the user's terms saying why ``exc`` happened (writing ``sink``)."""
    chain = exception_chain(full_trace(exc))
    if not chain:
        head = str(exc).strip().split("\n", 1)[0]
        chain = [Raised(f"{type(exc).__module__}.{type(exc).__qualname__}", head)]
    return explain(sink, chain)


@dataclass(frozen=True)
class TaskFailure:
    """A failed batch of a pipeline, as the batch handler saw it."""

    pipeline: str
    batch: int
    sink_id: str | None
    """the sink being written (None: the failure came after the writes)"""
    target: str
    """``sink.describe()``: what the sink writes to"""
    cause: str
    trace: str

    @classmethod
    def of(cls, pipeline: str, batch: int, sink: Sink | None, exc: BaseException) -> TaskFailure:
        return cls(
            pipeline=pipeline,
            batch=batch,
            sink_id=sink.sink_id if sink is not None else None,
            target=sink.describe() if sink is not None else "",
            cause=cause_of(exc, sink),
            trace=full_trace(exc),
        )

    def error(self, job: str) -> PipelineFailedError:
        """The error the job raises for this failure."""
        if self.sink_id is None:
            return PipelineFailedError(
                job, self.pipeline, self.cause, batch=self.batch, trace=self.trace
            )
        return TaskFailedError(
            job,
            self.pipeline,
            self.sink_id,
            self.batch,
            self.cause,
            target=self.target,
            trace=self.trace,
        )
