"""A throwaway S3 endpoint for tests: ``moto_server`` (``moto[server]``) on loopback.

``S3Server`` starts ``python -m moto.server`` on a free port of 127.0.0.1 and
waits until it accepts connections; ``create_bucket(name)`` makes an empty
bucket. Its data lives in the server process: ``cleanup()`` (or leaving the
``with`` block) loses it.

``tansu_env()`` is the environment a tansu broker needs to keep its storage in
this server (``--storage-engine s3://BUCKET/``): tansu's object store reads
``AWS_ENDPOINT``, ``AWS_ALLOW_HTTP`` and the usual credential variables.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

from lifecycle.testing.services import NativeService, free_port

ACCESS_KEY = "test"
SECRET_KEY = "test"
REGION = "us-east-1"


class S3ServerError(RuntimeError):
    """moto is not installed, or its server did not start."""


class S3Server(NativeService):
    """A moto S3 server subprocess on 127.0.0.1; ``endpoint`` once started."""

    access_key = ACCESS_KEY
    secret_key = SECRET_KEY
    region = REGION

    def __init__(self, port: int | None = None) -> None:
        self.port: int | None = port
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise S3ServerError("the S3 server has not been started yet")
        return f"http://127.0.0.1:{self.port}"

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 30.0) -> None:
        if self.is_running():
            return
        try:
            import moto.server  # noqa: F401 - only to say clearly what is missing
        except ImportError as e:
            raise S3ServerError(f"moto[server] is not installed ({e})") from e
        if self.port is None:
            self.port = free_port()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.cleanup()
                    raise S3ServerError(f"moto server did not start on port {self.port}") from None
                time.sleep(0.1)

    def client(self) -> Any:
        """A boto3 S3 client of this server."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def tansu_env(self) -> dict[str, str]:
        """Environment variables for a tansu broker storing in this server."""
        return {
            "AWS_ENDPOINT": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def cleanup(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
