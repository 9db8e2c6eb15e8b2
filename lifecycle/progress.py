"""How far a job's bounded pipelines are: a bar per pipeline on a terminal, one log
line per checkpoint otherwise.

``Job(progress=...)``:

* ``"auto"`` (default): bars when standard error is a terminal, log lines
  otherwise;
* ``"bar"``: bars (``tqdm``) on standard error;
* ``"log"``: the INFO line each checkpoint logs (``checkpoint N (kind)
  committed: ...``) ends with the progress of every bounded pipeline still
  working: rows committed (of the total, when known), batches, rows per
  second; no line of its own;
* ``"off"``: nothing.

A pipeline's total is known when ``add_pipeline(..., expected_rows=N)`` gives it
(Spark's streaming sources do not say how much a bounded input holds); without
it a bar shows rows and rate, no ETA. Rows counted are those of the pipeline's
first sink (every sink gets the same rows).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from sinks.errors import ConfigError

MODES = ("auto", "bar", "log", "off")


@dataclass
class Counts:
    """What a pipeline has done in this run."""

    batches: int = 0
    rows_prepared: int = 0
    rows_committed: int = 0


@dataclass(frozen=True)
class Tracked:
    """A pipeline whose progress is shown."""

    name: str
    expected_rows: int | None = None


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"progress must be one of {MODES}, not {mode!r}")
    return mode


class ProgressView:
    """Shows the progress of ``pipelines`` (see the module docstring)."""

    def __init__(self, mode: str, pipelines: list[Tracked], stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        mode = check_mode(mode)
        if mode == "auto":
            mode = "bar" if _is_tty(self._stream) else "log"
        self.mode = mode if pipelines else "off"
        self._pipelines = pipelines
        self._began = time.monotonic()
        self._bars: dict[str, Any] = {}
        self._done: set[str] = set()
        if self.mode == "bar":
            from tqdm import tqdm  # only when bars are drawn

            for i, p in enumerate(pipelines):
                self._bars[p.name] = tqdm(
                    total=p.expected_rows,
                    desc=p.name,
                    unit="rows",
                    unit_scale=True,
                    position=i,
                    leave=True,
                    file=self._stream,
                    dynamic_ncols=True,
                )

    def update(self, counts: Mapping[str, Counts]) -> None:
        """Redraw the bars (tqdm limits how often it draws)."""
        for name, bar in self._bars.items():
            c = counts.get(name, Counts())
            if c.rows_prepared > bar.n:
                bar.update(c.rows_prepared - bar.n)
            bar.set_postfix(batches=c.batches, committed=c.rows_committed, refresh=False)

    def note(self, counts: Mapping[str, Counts]) -> str:
        """The progress of the bounded pipelines still working, for the
        checkpoint's log line: ``progress: load 1,200 of 2,000 rows (60%), 7
        batches, 412 rows/s``."""
        elapsed = max(1e-9, time.monotonic() - self._began)
        parts = []
        for p in self._pipelines:
            if p.name in self._done:
                continue
            c = counts.get(p.name, Counts())
            done = (
                f"{c.rows_committed:,} of {p.expected_rows:,} rows "
                f"({100.0 * c.rows_committed / p.expected_rows:.0f}%)"
                if p.expected_rows
                else f"{c.rows_committed:,} rows"
            )
            parts.append(
                f"{p.name} {done}, {c.batches} batch(es), {c.rows_prepared / elapsed:,.0f} rows/s"
            )
        return "progress: " + "; ".join(parts) if parts else ""

    def finished(self, pipeline: str) -> None:
        """``pipeline`` is done: no more lines for it."""
        self._done.add(pipeline)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
