"""Faults of an S3 server for tests: proxies in front of a real one.

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

:class:`RacingProxy` makes writers race: it holds each PUT of a key that
matches its pattern (by default a Delta log entry, ``_delta_log/<version>.json``)
until ``writers`` PUTs of that key have arrived, or ``wait`` seconds have
passed, then forwards them all at once, so that each writer's conditional PUT
(``If-None-Match: *``) of a version meets the others' at the server. It counts
the keys that were raced for and the answers (``statuses``: 200 for the
winner, 412 for each loser), which a test asserts to show a race happened.

Point a client at a proxy's ``endpoint`` instead of the server's
(``storage_options`` with ``AWS_ENDPOINT_URL``, or ``s3a_conf``). The server's
outages need no proxy: stop and start it (``S3Proxy.stop()``, ``start()``).
"""

from __future__ import annotations

import contextlib
import http.client
import re
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar
from urllib.parse import urlparse

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message>"
    b"<RequestId>twophase-throttle</RequestId></Error>"
)
_P = TypeVar("_P", bound="_ForwardingProxy")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class _ForwardingProxy:
    """Forward every request to ``upstream`` (``http://host:port``)
    unchanged; subclasses answer some themselves (:meth:`_refusal`), delay
    them (:meth:`_before`) or watch the answers (:meth:`_after`)."""

    def __init__(self, upstream: str) -> None:
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy."""
        if self._server is None:
            raise RuntimeError("the proxy has not been started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _refusal(self, method: str, path: str) -> bool:
        """Whether to answer this request 503 SlowDown instead of forwarding it."""
        return False

    def _before(self, method: str, path: str) -> None:
        """Called before the request is forwarded (may block)."""

    def _after(self, method: str, path: str, status: int) -> None:
        """Called with the server's answer to a forwarded request."""

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
                if proxy._refusal(self.command, self.path):
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                proxy._before(self.command, self.path)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    proxy._after(self.command, self.path, resp.status)
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
            target=self._server.serve_forever, name=type(self).__name__, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self: _P) -> _P:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ThrottlingProxy(_ForwardingProxy):
    """Forward to ``upstream`` (``http://host:port``), answering every
    ``every``-th request with 503 SlowDown (module docstring)."""

    def __init__(self, upstream: str, *, every: int = 3) -> None:
        if every < 2:
            raise ValueError("every must be 2 or more: a proxy that refuses all never forwards")
        super().__init__(upstream)
        self.every = every
        self.throttled = 0
        self.forwarded = 0
        self._count = 0
        self._paused = False

    def _refusal(self, method: str, path: str) -> bool:
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


DELTA_LOG_ENTRY = r"/_delta_log/\d{20}\.json$"
""":class:`RacingProxy`'s default pattern: a Delta version's commit file."""


class RacingProxy(_ForwardingProxy):
    """Forward to ``upstream``, holding each PUT of a key that matches
    ``pattern`` (a regular expression searched in the request's path) until
    ``writers`` PUTs of the key arrived or ``wait`` seconds passed (module
    docstring). ``raced`` counts the keys that ``writers`` PUTs were released
    together for; ``statuses`` the server's answers to the held PUTs."""

    def __init__(
        self, upstream: str, *, pattern: str = DELTA_LOG_ENTRY, writers: int = 2, wait: float = 5.0
    ) -> None:
        if writers < 2:
            raise ValueError("writers must be 2 or more: one writer races nobody")
        super().__init__(upstream)
        self.pattern = re.compile(pattern)
        self.writers = writers
        self.wait = wait
        self.raced = 0
        self.statuses: Counter[int] = Counter()
        self._arrived: dict[str, int] = {}
        self._gates: dict[str, threading.Event] = {}

    def _held(self, method: str, path: str) -> str | None:
        key = path.split("?", 1)[0]
        return key if method == "PUT" and self.pattern.search(key) else None

    def _before(self, method: str, path: str) -> None:
        key = self._held(method, path)
        if key is None:
            return
        with self._lock:
            gate = self._gates.setdefault(key, threading.Event())
            self._arrived[key] = self._arrived.get(key, 0) + 1
            if self._arrived[key] == self.writers:
                self.raced += 1
                gate.set()
        gate.wait(self.wait)

    def _after(self, method: str, path: str, status: int) -> None:
        if self._held(method, path) is not None:
            with self._lock:
                self.statuses[status] += 1
