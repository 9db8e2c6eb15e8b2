"""What an object store's refusal means, said once for the Delta sink's errors.

deltalake reports a store's refusal as a chain of causes with terminal colour
codes (``Kernel error -> ... ↳ 403 Forbidden ↳ <Error><Code>...``).
:func:`explain` turns it into one line that says what to fix first (the
credentials, the bucket, the network), then the chain without colours. The
store's answer never holds a secret (a request's signature is not echoed), and
neither does this text: it names the access key id, never the secret key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_METADATA_SERVICE = "169.254.169.254"

_CREDENTIAL_CODES = {
    "SignatureDoesNotMatch": "the secret key does not match the access key id",
    "InvalidAccessKeyId": "the store knows no such access key id",
    "ExpiredToken": "the session token has expired",
    "InvalidToken": "the session token is not valid",
    "AccessDenied": "the credentials may not read or write this location",
}


def _key_id(options: Mapping[str, str]) -> str | None:
    for k, v in options.items():
        if k.upper() in ("AWS_ACCESS_KEY_ID", "ACCESS_KEY_ID"):
            return v
    return None


def plain(message: str) -> str:
    """``message`` without colour codes, its lines joined by a semicolon."""
    lines = (line.strip().lstrip("↳").strip() for line in _COLOUR.sub("", message).splitlines())
    return "; ".join(line for line in lines if line)


def explain(error: BaseException, location: str, options: Mapping[str, str]) -> str:
    """One line on what ``error`` (from opening ``location``) asks to fix,
    then what the store said."""
    said = plain(str(error))
    code = next(iter(_CODE.findall(said)), None)
    where = location.split("://", 1)
    bucket = where[1].split("/", 1)[0] if len(where) == 2 else location
    if code in _CREDENTIAL_CODES:
        key = _key_id(options)
        hint = (
            f"{_CREDENTIAL_CODES[code]} ({code}; access key id {key!r} from storage_options)"
            if key
            else f"{_CREDENTIAL_CODES[code]} ({code}; the access key id came from the "
            "environment or the credential chain)"
        )
        return f"the store refused the credentials: {hint}. The store said: {said}"
    if code == "NoSuchBucket":
        return f"the bucket {bucket!r} does not exist (NoSuchBucket). The store said: {said}"
    if _METADATA_SERVICE in said or "Missing AccessKeyId" in said:
        return (
            "no credentials: neither storage_options nor the environment give both "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and no credential provider (an "
            "instance's role) gave any. A job restarted from its recorded settings, and "
            "twophase, take them from the environment (TWOPHASE_<SINK>_<KEY>, or the "
            f"key's own name): the state records neither. The store said: {said}"
        )
    return said
