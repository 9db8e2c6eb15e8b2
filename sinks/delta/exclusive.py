"""Creating a small file only if no file of that name exists, in an object store.

A local disk does this with ``O_CREAT | O_EXCL``. deltalake's object-store
handler has no create-if-absent, so for S3 (and S3-compatible stores) this
module does a conditional PUT, ``If-None-Match: *``, with boto3 (the optional
extra ``twophase[s3]``): the store refuses it with 412 when the key exists, so
of two writers of one name exactly one succeeds. Other object stores (Azure,
GCS) get a check before the write, which is not atomic; the names carry the
incarnation, run and task attempt, so a collision there needs a reused name.

**Retries.** A PUT that fails for a reason that passes (the store throttles,
``503 SlowDown``; a 5xx; the connection refused or cut while the server
restarts) is tried again with backoff for up to :data:`~sinks._retry.STORE_OUTAGE` seconds
(:func:`sinks._retry.retry_transient`), after boto3's own few quick attempts.
The outcome of a PUT whose answer was lost is unknown, so a 412 after such a
try is checked: when the object holds exactly the bytes written, the PUT was
ours and succeeded; anything else is a name someone else holds
(:class:`FileExistsError`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from sinks._retry import STORE_OUTAGE, retry_transient

_ENDPOINT_KEYS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT", "ENDPOINT_URL", "ENDPOINT")


def _option(options: dict[str, str], *names: str) -> str | None:
    lowered = {k.lower(): v for k, v in options.items()}
    for name in names:
        for key in (name, name.lower()):
            if key in options:
                return options[key]
            if key.lower() in lowered:
                return lowered[key.lower()]
    return None


class S3Exclusive:
    """Conditional PUTs into the bucket of an ``s3://`` table URI."""

    def __init__(self, table_uri: str, storage_options: dict[str, str]) -> None:
        parsed = urlparse(table_uri)
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.options = storage_options
        self._client: Any = None

    def _s3(self) -> Any:
        if self._client is None:
            try:
                import boto3
            except ImportError:
                raise ImportError(
                    "creating staged files exclusively on S3 needs boto3, on the "
                    "executors too: pip install 'twophase[s3]' into the environment "
                    "they run (docs/deploying.md)"
                ) from None
            o = self.options
            self._client = boto3.client(
                "s3",
                endpoint_url=_option(o, *_ENDPOINT_KEYS),
                aws_access_key_id=_option(o, "AWS_ACCESS_KEY_ID", "ACCESS_KEY_ID"),
                aws_secret_access_key=_option(o, "AWS_SECRET_ACCESS_KEY", "SECRET_ACCESS_KEY"),
                aws_session_token=_option(o, "AWS_SESSION_TOKEN", "SESSION_TOKEN"),
                region_name=_option(o, "AWS_REGION", "AWS_DEFAULT_REGION", "REGION"),
            )
        return self._client

    def create(self, rel: str, data: bytes) -> None:
        """Create ``rel`` (relative to the table) holding ``data``; raise
        :class:`FileExistsError` when it exists."""
        self._s3()  # first: without boto3 it says what to install
        from botocore.exceptions import ClientError
        from botocore.exceptions import ConnectionError as BotoConnectionError

        key = f"{self.prefix}/{rel}" if self.prefix else rel
        unsure = False  # an earlier try may have written it and lost the answer

        def put() -> None:
            nonlocal unsure
            try:
                self._s3().put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
            except ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 412:
                    if unsure and self._holds(key, data):
                        return
                    raise FileExistsError(f"s3://{self.bucket}/{key} exists already") from None
                if _passing(e):
                    unsure = True
                    raise _StoreUnavailable(f"s3://{self.bucket}/{key}: {e}") from e
                raise
            except BotoConnectionError as e:
                unsure = True
                raise _StoreUnavailable(f"s3://{self.bucket}/{key}: {e}") from e

        retry_transient(
            put,
            what=f"creating s3://{self.bucket}/{key}",
            transient=(_StoreUnavailable,),
            deadline=STORE_OUTAGE,
        )

    def _holds(self, key: str, data: bytes) -> bool:
        """Whether the object ``key`` holds exactly ``data``."""
        body = self._s3().get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return bool(body == data)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}


class _StoreUnavailable(OSError):
    """A request the store did not serve for a reason that passes."""


_PASSING_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "InternalError",
}


def _passing(e: Any) -> bool:
    """Whether the store's error answer ``e`` (a botocore ``ClientError``) passes:
    throttling, a timeout, a server error."""
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    return bool(status >= 500 or e.response.get("Error", {}).get("Code") in _PASSING_CODES)
