"""Creating a small file only if no file of that name exists, in an object store.

A local disk does this with ``O_CREAT | O_EXCL``. deltalake's object-store
handler has no create-if-absent, so for S3 (and S3-compatible stores) this
module does a conditional PUT, ``If-None-Match: *``, with boto3 (the optional
extra ``twophase[s3]``): the store refuses it with 412 when the key exists, so
of two writers of one name exactly one succeeds. Other object stores (Azure,
GCS) get a check before the write, which is not atomic; the names carry the
incarnation, run and task attempt, so a collision there needs a reused name.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

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
                    "creating staged files exclusively on S3 needs boto3: "
                    "pip install 'twophase[s3]'"
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
        from botocore.exceptions import ClientError

        key = f"{self.prefix}/{rel}" if self.prefix else rel
        try:
            self._s3().put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412:
                raise FileExistsError(f"s3://{self.bucket}/{key} exists already") from None
            raise

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}
