"""A sink's non-secret settings: what is recorded, and where its secrets come back from.

Every sink has ``settings()``: a small JSON-able dict with its ``kind``, its
``sink_id`` and the constructor arguments needed to build it again, with every
secret taken out. The ledger records it (``Ledger.record_sinks``), so the
``twophase`` commands can reach the sinks of a job without the job's code.
:func:`sinks.rebuild.from_settings` builds the sink again (that module knows
every kind of sink; this one is imported by the sinks themselves); the secrets
come from the environment (or the mapping given), never from the ledger.

What is taken out, and where it comes back from (``<SINK>`` is the sink id in
upper case with every character other than A-Z and 0-9 replaced by ``_``; the
first variable found wins):

* PostgreSQL: ``password`` and ``sslpassword`` of the DSN (parsed by psycopg's
  conninfo parser, so URIs and key=value strings alike). Back from
  ``TWOPHASE_<SINK>_PASSWORD``, then ``PGPASSWORD``; when neither is set, libpq
  looks as it always does (``PGPASSWORD``, ``PGPASSFILE`` / ``~/.pgpass``).
* Kafka: ``producer_config`` keys whose name contains ``password``,
  ``secret`` or ``token`` (``sasl_plain_password``, ``ssl_password``, ...).
  Back from ``TWOPHASE_<SINK>_<KEY>``, then ``TWOPHASE_KAFKA_<KEY>`` (``<KEY>``
  the key in upper case, e.g. ``TWOPHASE_KAFKA_SASL_PLAIN_PASSWORD``); a
  missing one is an error naming both (kafka-python reads no environment).
* Delta: ``storage_options`` keys whose name contains ``key``, ``secret``,
  ``token``, ``password``, ``credential`` or ``sas`` (``AWS_SECRET_ACCESS_KEY``,
  ``AWS_ACCESS_KEY_ID``, ``AWS_SESSION_TOKEN``, ``AZURE_STORAGE_ACCOUNT_KEY``,
  ``GOOGLE_SERVICE_ACCOUNT_KEY``, ...). Back from ``TWOPHASE_<SINK>_<KEY>``,
  then the variable named like the key itself in upper case (the object store's
  usual one, e.g. ``AWS_SECRET_ACCESS_KEY``); when neither is set the option
  stays out and the object store's own credential chain applies.

Settings that are not JSON values (an ``ssl_context`` object, a callable) are
left out too and named under ``"omitted"``; the rebuilt sink lacks them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

FORMAT = 1

KAFKA_SECRET_WORDS = ("password", "secret", "token")
STORAGE_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "sas")
DSN_SECRETS = ("password", "sslpassword")


def env_name(*parts: str) -> str:
    """``TWOPHASE_<PART>_<PART>...``: upper case, non-alphanumerics as ``_``."""
    return "_".join(re.sub(r"[^A-Z0-9]", "_", p.upper()) for p in ("twophase", *parts))


def is_secret(key: str, words: Iterable[str]) -> bool:
    low = key.lower()
    return any(w in low for w in words)


def is_json_value(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def split_secrets(
    options: Mapping[str, Any], words: Iterable[str]
) -> tuple[dict[str, Any], list[str], list[str]]:
    """``(kept, redacted keys, omitted keys)`` of a dict of options: secrets out
    (by name), values that are not JSON out."""
    words = tuple(words)
    kept: dict[str, Any] = {}
    redacted: list[str] = []
    omitted: list[str] = []
    for k, v in options.items():
        if is_secret(k, words):
            redacted.append(k)
        elif not is_json_value(v):
            omitted.append(k)
        else:
            kept[k] = v
    return kept, sorted(redacted), sorted(omitted)


def lookup(secrets: Mapping[str, str], names: Iterable[str]) -> str | None:
    """The value of the first of ``names`` set in ``secrets``."""
    for name in names:
        value = secrets.get(name)
        if value:
            return value
    return None


def environment(secrets: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if secrets is None else secrets
