"""Plain-text tables and times for the ``twophase`` commands' output."""

from __future__ import annotations

import time
from collections.abc import Sequence


def aligned(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """``rows`` (the first one the header) as lines with left-aligned columns
    two spaces apart, each line indented by ``indent``."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
        for r in rows
    ]


def local_time(ts: float | None) -> str:
    """A Unix time as local ``YYYY-MM-DD HH:MM:SS``; "-" for none."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"
