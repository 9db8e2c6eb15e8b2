"""Rebuilding a sink from its recorded settings (:mod:`sinks.settings`).

The one module that knows every kind of sink, above the sinks: each sink
imports :mod:`sinks.settings` for its helpers, never this module, so no import
runs back up from a sink to the list of sinks.

A sink of another kind (one of your own) is rebuilt from the class its
settings name (``"class": "module:Name"``, which :meth:`Sink.settings
<sinks.base.Sink.settings>` records), by that class's
``from_settings(settings, secrets)``: the ``twophase`` commands import the
module, so it must be importable where they run.
"""

from __future__ import annotations

import importlib
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
    if settings.get("v", FORMAT) != FORMAT:
        raise ConfigError(f"sink settings of unknown format {settings.get('v')!r}")
    if kind in KINDS:
        return KINDS[kind].from_settings(settings, environment(secrets))
    built = _class_of(settings).from_settings(settings, environment(secrets))
    if not isinstance(built, Sink):
        raise ConfigError(f"{settings['class']}.from_settings returned {built!r}, not a sink")
    return built


def _class_of(settings: Mapping[str, Any]) -> Any:
    """The sink class a sink of another kind recorded (``"class"``), with its
    ``from_settings``; a :class:`ConfigError` saying what is missing."""
    what = f"sink {settings.get('sink_id')!r} of kind {settings.get('kind')!r}"
    named = settings.get("class")
    if not isinstance(named, str) or ":" not in named:
        raise ConfigError(
            f"{what} cannot be rebuilt from its recorded settings: they name no class "
            f"(only {sorted(KINDS)} and sinks whose settings() record one can)"
        )
    module, _, qualname = named.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"{what}: cannot import {named} ({e}); run the command where the job's code "
            "is importable (PYTHONPATH)"
        ) from None
    if not (isinstance(found, type) and issubclass(found, Sink)):
        raise ConfigError(f"{what}: {named} is not a sink class")
    if not callable(getattr(found, "from_settings", None)):
        raise ConfigError(
            f"{what}: {named} defines no from_settings(settings, secrets), so the twophase "
            "commands cannot build it again"
        )
    return found
