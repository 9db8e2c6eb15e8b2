"""Rebuilding a sink from its recorded settings (:mod:`sinks.settings`).

The one module that knows every kind of sink, above the sinks: each sink
imports :mod:`sinks.settings` for its helpers, never this module, so no import
runs back up from a sink to the list of sinks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sinks.base import Sink
from sinks.delta import DeltaSink
from sinks.errors import ConfigError
from sinks.kafka import KafkaSink
from sinks.postgres import PostgresSink
from sinks.settings import FORMAT, environment

KINDS: dict[str, type[PostgresSink] | type[KafkaSink] | type[DeltaSink]] = {
    "postgres": PostgresSink,
    "kafka": KafkaSink,
    "delta": DeltaSink,
}
"""every kind of sink whose settings can be recorded, by its ``kind``"""


def from_settings(settings: Mapping[str, Any], secrets: Mapping[str, str] | None = None) -> Sink:
    """Build the sink that ``settings`` (a sink's ``settings()``) describe, its
    secrets taken from ``secrets`` (default: the environment; see
    :mod:`sinks.settings`)."""
    kind = settings.get("kind")
    if kind not in KINDS:
        raise ConfigError(
            f"sink {settings.get('sink_id')!r} of kind {kind!r} cannot be rebuilt from its "
            f"recorded settings (only {sorted(KINDS)} can)"
        )
    if settings.get("v", FORMAT) != FORMAT:
        raise ConfigError(f"sink settings of unknown format {settings.get('v')!r}")
    return KINDS[kind].from_settings(settings, environment(secrets))
