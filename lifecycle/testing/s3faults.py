"""Faults of an S3 server for tests: a proxy that throttles, in front of a real one.

:class:`ThrottlingProxy` listens on a loopback port of its own and forwards
every request, unchanged (the same method, path, headers and body, so the
client's signature still holds), to an S3 server such as
:class:`~lifecycle.testing.s3proxy.S3Proxy`, and passes the answer back, except
that it answers every ``every``-th request itself with what S3 sends a client
that goes too fast: ``503 Slow Down`` and an ``<Error><Code>SlowDown</Code>``
body. Clients meet it as they meet S3's throttling: deltalake's object store,
boto3 and Hadoop's S3A each retry it with backoff, and the sink's own calls
retry what reaches them (:mod:`sinks.delta.storage`). ``throttled`` and
``forwarded`` count what it did; ``paused()`` lets everything through for a
while (a test's own checks of the bucket).

Point a client at :attr:`ThrottlingProxy.endpoint` instead of the server's
(``storage_options`` with ``AWS_ENDPOINT_URL``, or ``s3a_conf``). The server's
outages need no proxy: stop and start it (``S3Proxy.stop()``, ``start()``).
"""

from __future__ import annotations

import contextlib
import http.client
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message>"
    b"<RequestId>twophase-throttle</RequestId></Error>"
)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class ThrottlingProxy:
    """Forward to ``upstream`` (``http://host:port``), answering every
    ``every``-th request with 503 SlowDown (module docstring)."""

    def __init__(self, upstream: str, *, every: int = 3) -> None:
        if every < 2:
            raise ValueError("every must be 2 or more: a proxy that refuses all never forwards")
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.every = every
        self.throttled = 0
        self.forwarded = 0
        self._count = 0
        self._paused = False
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy."""
        if self._server is None:
            raise RuntimeError("the proxy has not been started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _throttle_now(self) -> bool:
        with self._lock:
            if self._paused:
                self.forwarded += 1
                return False
            self._count += 1
            if self._count % self.every == 0:
                self.throttled += 1
                return True
            self.forwarded += 1
            return False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forward every request while the ``with`` block runs."""
        with self._lock:
            self._paused = True
        try:
            yield
        finally:
            with self._lock:
                self._paused = False

    def start(self) -> None:
        """Listen on a free loopback port, serving from a daemon thread."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                if proxy._throttle_now():
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    length = resp.getheader("Content-Length")
                    self.send_header(
                        "Content-Length",
                        length if self.command == "HEAD" and length else str(len(data)),
                    )
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="s3-throttle", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> ThrottlingProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
