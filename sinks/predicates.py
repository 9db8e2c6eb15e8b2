"""What a ``replace_where`` predicate may not say, whatever the sink.

A replace evaluates its predicate on every batch and again at the commit that
finishes the backfill, maybe days apart, and both evaluations must name the
same slice. Each sink refuses the expressions whose value changes between
evaluations in its own dialect (Spark's analyzed condition for Delta,
PostgreSQL's IMMUTABLE rule). Both dialects also turn a few special strings
into the current date or time when a statement is parsed, as constants that
no such check sees: :func:`time_words` finds them in the text.
"""

from __future__ import annotations

import re

_TIME_WORDS = re.compile(r"'\s*(now|today|tomorrow|yesterday)\s*'", re.IGNORECASE)


def time_words(predicate: str) -> list[str]:
    """The quoted special date and time strings of ``predicate`` (``'today'``,
    ``'now'``, ``'tomorrow'``, ``'yesterday'``), which Spark (``DATE 'today'``)
    and PostgreSQL (``'today'::date``) read as the current date or time."""
    return sorted({f"'{m.group(1).lower()}'" for m in _TIME_WORDS.finditer(predicate)})


def changes_between_evaluations(what: str, predicate: str, where: str) -> str:
    """The refusal's text: ``what`` in ``predicate`` changes between evaluations."""
    return (
        f"{where}: replace_where {predicate!r} uses {what}, whose value changes between "
        "evaluations: the predicate is evaluated on every batch and again at the commit "
        "that finishes the backfill, maybe days apart, and the two must name the same "
        "slice. Write the value out (e.g. day = '2026-11-01')"
    )
