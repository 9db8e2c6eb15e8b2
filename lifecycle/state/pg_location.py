"""Where a PostgreSQL ledger lives: a libpq URI with two parameters of ours.

    postgresql://user[:password]@host[:port]/dbname[?schema=NAME][&job=NAME][&libpq params]

``schema`` (default ``twophase_ledger``) is the schema holding the ledger
tables; ``job`` names one job's ledger in it (a schema holds the ledgers of
any number of jobs, one per job name). Both are taken out before the rest goes
to libpq, so every libpq parameter (``sslmode``, ``connect_timeout``, ...)
works. A password comes from the URI, or from libpq's environment
(``PGPASSWORD``, ``~/.pgpass``); :meth:`PgLocation.display` never shows it,
and it is what gets stored (``STATE_DIR/ledger.location``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from urllib.parse import quote, unquote, urlsplit

from sinks.errors import ConfigError

SCHEMES = ("postgresql", "postgres")
DEFAULT_SCHEMA = "twophase_ledger"
_SCHEMA = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def is_pg_location(location: str) -> bool:
    """Whether ``location`` is a PostgreSQL URI (``postgresql://`` or ``postgres://``)."""
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


SECRETS = ("password", "sslpassword")
"""libpq parameters that are never shown or stored"""


def _uri(scheme: str, netloc: str, path: str, pairs: list[tuple[str, str]]) -> str:
    query = "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in pairs)
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")


@dataclass(frozen=True)
class PgLocation:
    """A parsed ledger URI."""

    scheme: str
    netloc: str
    path: str
    params: tuple[tuple[str, str], ...]
    """libpq's query parameters (ours taken out)"""
    schema: str = DEFAULT_SCHEMA
    job: str | None = None

    @classmethod
    def parse(cls, uri: str) -> PgLocation:
        if not is_pg_location(uri):
            raise ConfigError(
                "a PostgreSQL ledger location is a URI (postgresql://user@host/dbname); "
                "the file ledger is given as a local directory, or None"
            )
        parts = urlsplit(uri)
        params: list[tuple[str, str]] = []
        schema, job = DEFAULT_SCHEMA, None
        for item in filter(None, parts.query.split("&")):
            k, _, v = (unquote(x) for x in item.partition("="))
            if k == "schema":
                schema = v
            elif k == "job":
                job = v
            else:
                params.append((k, v))
        if not _SCHEMA.fullmatch(schema):
            raise ConfigError(
                f"ledger schema {schema!r}: use letters, digits and _ (not first), "
                "at most 63 characters"
            )
        if job == "":
            job = None
        return cls(parts.scheme, parts.netloc, parts.path, tuple(params), schema, job)

    def with_job(self, job: str) -> PgLocation:
        return replace(self, job=job)

    def conninfo(self) -> str:
        """What libpq connects with (the password included, when the URI has one)."""
        return _uri(self.scheme, self.netloc, self.path, list(self.params))

    def display(self) -> str:
        """The URI without its password, with ``schema`` (and ``job``): what is shown
        and stored."""
        userinfo, at, hosts = self.netloc.rpartition("@")
        netloc = f"{userinfo.split(':', 1)[0]}@{hosts}" if at else hosts
        ours = [("schema", self.schema)] + ([("job", self.job)] if self.job else [])
        theirs = [(k, v) for k, v in self.params if k not in SECRETS]
        return _uri(self.scheme, netloc, self.path, ours + theirs)


def _key(*parts: str) -> int:
    digest = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def lock_key(schema: str, job: str) -> int:
    """The advisory lock key of the ledger of ``job`` in ``schema`` (a signed bigint;
    advisory locks are per database)."""
    return _key("twophase-ledger", schema, job)


def ddl_key(schema: str) -> int:
    """The advisory lock key that serialises creating the tables of ``schema``."""
    return _key("twophase-ledger-ddl", schema)


def lock_tag(key: int) -> tuple[int, int]:
    """How ``pg_locks`` shows a bigint advisory key: (classid, objid), objsubid 1."""
    return (key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF
