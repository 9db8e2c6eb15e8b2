"""A private Prometheus server for tests (no mocks): Debian's ``prometheus``
binary (2.42; ``.ci/run`` installs it when missing), started on a free loopback
port with its data in a temporary directory.

``Prometheus(targets, rule_files)`` scrapes each ``host:port`` in ``targets``
every ``interval`` seconds with ``honor_labels: true`` (as the operating page
advises, so a job's series keep its name in ``job``), evaluates the rules as
often, and answers HTTP API queries (``query``, ``query_range``, ``alerts``,
``series_names``). The binary is taken from
``$TWOPHASE_PROMETHEUS`` if set, else from ``PATH``.

Run as a program (``python -m lifecycle.testing.prometheus HOST:PORT
[RULES...]``) it scrapes those targets, prints its address and waits for
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lifecycle.testing.services import ProcessService, free_port, serve

SCRAPE_JOB = "twophase"
"""The scrape job's name: the ``job`` label of ``up`` (the series a job
exports keep their own ``job``)."""


class PrometheusError(RuntimeError):
    """Prometheus is missing, did not start, or refused a query."""


def binary() -> str:
    """The ``prometheus`` to run; :class:`PrometheusError` when there is none."""
    found = os.environ.get("TWOPHASE_PROMETHEUS") or shutil.which("prometheus")
    if not found:
        raise PrometheusError(
            "prometheus is not installed: `apt-get install prometheus` (Debian), which "
            ".ci/run does, or set TWOPHASE_PROMETHEUS to the binary"
        )
    return found


class Prometheus(ProcessService):
    """A Prometheus server scraping ``targets`` and evaluating ``rule_files``."""

    def __init__(
        self,
        targets: Sequence[str],
        rule_files: Sequence[str | os.PathLike[str]] = (),
        *,
        interval: float = 1.0,
    ) -> None:
        super().__init__("twophase-prometheus-", "prometheus.log")
        self.targets = list(targets)
        self.rule_files = [Path(r).resolve() for r in rule_files]
        self.interval = interval
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> Path:
        every = f"{int(self.interval * 1000)}ms"
        config = {
            "global": {"scrape_interval": every, "evaluation_interval": every},
            "rule_files": [str(r) for r in self.rule_files],
            "scrape_configs": [
                {
                    "job_name": SCRAPE_JOB,
                    "honor_labels": True,
                    "scrape_timeout": every,
                    "static_configs": [{"targets": self.targets}],
                }
            ],
        }
        path = self.workdir / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2))  # YAML reads JSON
        return path

    def start(self, timeout: float = 60.0) -> None:
        """Start the server and wait until it answers ``/-/ready``."""
        self._spawn(
            [
                binary(),
                f"--config.file={self._config()}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ]
        )
        deadline = time.monotonic() + timeout
        while True:
            if not self.is_running():
                raise PrometheusError("prometheus exited at start\n" + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus not ready in {timeout} s\n" + self.log_tail())
            time.sleep(0.2)

    def api(self, path: str, **params: str) -> Any:
        """The ``data`` of an HTTP API answer (``/api/v1/<path>``); raises
        :class:`PrometheusError` on an error answer."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                doc = json.load(r)
        except urllib.error.HTTPError as e:
            doc = json.load(e)
        if doc.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        data = self.api("query", query=expr)
        return list(data["result"]) if data["resultType"] == "vector" else [data]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query's result (``[{"metric": {...}, "values": [[t, "v"], ...]}]``)."""
        data = self.api("query_range", query=expr, start=str(start), end=str(end), step=str(step))
        return list(data["result"])

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts pending or firing now."""
        return list(self.api("alerts")["alerts"])

    def series_names(self) -> set[str]:
        """Every metric name Prometheus holds."""
        return set(self.api("label/__name__/values"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("targets", nargs="+", help="HOST:PORT of each endpoint to scrape")
    ap.add_argument("--rules", action="append", default=[], help="a rule file (repeatable)")
    args = ap.parse_args(argv)
    server = Prometheus(args.targets, args.rules)

    def why_stopped() -> None:
        raise PrometheusError("prometheus stopped\n" + server.log_tail())

    serve(server, lambda: server.url, why_stopped)


if __name__ == "__main__":
    main()
