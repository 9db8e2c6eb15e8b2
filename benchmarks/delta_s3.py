"""The Delta sink on S3 (S3Proxy on loopback) against delta-spark and write_deltalake.

One run starts one S3 server (:class:`lifecycle.testing.s3proxy.S3Proxy` with
its ``transient`` store, objects in the server's memory: delta-spark's writes
through S3A make directory markers, which S3Proxy's file stores break, see
docs/testing.md) and one SparkSession (``local[2]``) that has delta-spark's
jars (as :func:`benchmarks._common.bench_spark` adds them) and Hadoop's S3A on
the driver's classpath (``lifecycle.testing.jars.jars("s3a")``), pointed at
the server (``S3Proxy.spark_conf()``). Every run writes a fresh table in a
fresh bucket, which is deleted after the run has been checked. Three parts:

1. **Appends** (``--rows`` rows in ``2 x --batches`` Parquet files read as a
   bounded stream, two files a micro-batch, available-now trigger):

   * ``DeltaSink``: ``DeltaSink("s3://bucket/t", storage_options=...)`` in a
     :class:`lifecycle.Job` (exactly-once; on S3 the Arrow route, the only
     one: staged files written by the sink's writer in ``mapInArrow`` tasks,
     one Delta version per checkpoint);
   * ``delta-spark txnVersion``: what a Spark user runs instead,
     ``foreachBatch`` writing each micro-batch with delta-spark through S3A
     (``option("txnAppId", ...).option("txnVersion", batch_id)``, Delta's
     idempotent writes), one version per micro-batch;
   * ``write_deltalake``: ``foreachBatch`` collecting each micro-batch to the
     driver as Arrow and appending it with
     ``deltalake.write_deltalake("s3://...", data, mode="append",
     storage_options=...)``: at-least-once, the limit of a Python writer.

   Checked: the table holds ids ``0..rows-1`` once each (count, distinct
   count, min, max, read back with deltalake); the sink's table has no staging
   marker left. ``--floors`` adds the Arrow route's floors (:data:`FLOORS`:
   ``mapInArrow`` tasks that discard the rows, encode them as Parquet, and
   upload that with one PUT), to show where the sink's time goes; they are
   reported apart, with the seconds of their Spark jobs.

2. **Keyed merges**: ``--batches`` micro-batches of ``--changes`` changes each
   (90% upserts, 10% deletes, keys drawn as ``benchmarks/delta_merge.py``
   draws them, ``--distributions``) into a copy of a base table of ``--rows``
   rows in ``--files`` files (ids in order, each file one range of ids; written
   once with deltalake, copied server-side into each run's bucket):

   * ``DeltaSink``: ``DeltaSink(..., key=["id"], delete_when=("op", "D"))``
     in a Job (exactly-once: change files at each batch's end, one
     copy-on-write rewrite and one version per checkpoint);
   * ``delta-spark MERGE``: ``foreachBatch`` running
     ``DeltaTable.forPath(spark, "s3a://...").merge(...)`` with delete,
     update and insert clauses (the standard upsert recipe), at-least-once.

   Checked: the table equals the expected rows (the base with every batch's
   changes applied in order), row for row.

3. **The sweep's listing** at ``--markers`` staging markers: markers named in
   the sink's scope (``_twophase/staged/<txn>-<seq>``, ``<txn>`` a
   :class:`sinks.naming.TxnName` of job ``bench``, pipeline ``load``) are
   created in a table's directory, then timed (``--sweep-repeat`` times
   each, median): the listing itself (``TableStorage.list_files`` of the
   marker directory), the Delta committer's ``lingering`` (what ``twophase status``
   shows) and its ``sweep`` with no orphan among them (the
   sweep after every checkpoint, :mod:`lifecycle.sweep`, when the markers
   belong to batches not yet committed). Then one sweep that finds every
   marker orphaned and deletes them all (reads each marker, deletes the file
   it names and the marker); its requests are counted on a tenth of the
   markers, made again.

Runs alternate after one warm-up round; medians are reported with the
ratios (time of the other / time of the sink: above 1.0 the sink is faster),
and the sink's commit time (each checkpoint's, from the job's ledger).
Unless ``--no-count``, each variant runs once more, after the timed rounds
and not timed, with every S3 request going through a counting proxy
(:class:`CountingProxy`: deltalake's and boto3's endpoint, and S3A's endpoint
for that run's bucket), and the sweep's calls are counted the same way:
requests by kind. ``--quick`` (100,000 rows, 3 micro-batches of 1,000 changes,
500 markers, one round) is a smoke run of a few minutes.

Writes ``<stem>.json`` (every run, the medians, ratios, counts) and
``<stem>.md`` (the tables, also printed) to ``--out`` (``benchmarks/results``).

    python benchmarks/delta_s3.py [--rows N] [--files F] [--batches B] [--changes M]
                                  [--distributions uniform,recent,new] [--repeat R]
                                  [--markers K] [--parts appends,merges,sweep]
                                  [--interval S] [--no-count] [--floors] [--quick]
                                  [--conf KEY=VALUE] [--out DIR] [--stem NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from deltalake import DeltaTable, write_deltalake  # noqa: E402
from pyspark.sql import DataFrame, SparkSession  # noqa: E402

from benchmarks._common import (  # noqa: E402
    add_conf_option,
    bench_spark,
    commit_latencies,
    make_input,
    parquet_stream,
    time_foreach_batch,
    time_job,
)
from benchmarks.delta_merge import base_table  # noqa: E402
from benchmarks.delta_merge import changes as make_changes  # noqa: E402
from benchmarks.delta_merge import run_delta_spark as run_spark_merge  # noqa: E402
from benchmarks.delta_throughput import run_delta_spark as run_spark_append  # noqa: E402
from lifecycle.testing import jars  # noqa: E402
from lifecycle.testing.s3proxy import S3Proxy  # noqa: E402
from sinks import DeltaSink  # noqa: E402
from sinks.base import JobScope  # noqa: E402
from sinks.delta.storage import DATA_SUFFIX, STAGING_DIR, TableStorage, file_stem  # noqa: E402
from sinks.naming import TxnName  # noqa: E402

SINK = "DeltaSink"
APPEND_ALT = "delta-spark txnVersion"
APPEND_LIMIT = "write_deltalake"
APPENDS = (SINK, APPEND_ALT, APPEND_LIMIT)
MERGE_ALT = "delta-spark MERGE"
MERGES = (SINK, MERGE_ALT)
PARTS = ("appends", "merges", "sweep")
DISTRIBUTIONS = ("recent", "uniform", "new")
PROVIDER = "transient"
"""S3Proxy's store: in its JVM's memory (its file stores break S3A's directory
markers, which delta-spark's first write to a table makes)"""
JOB, PIPELINE = "bench", "load"
"""the names :func:`benchmarks._common.time_job` gives its job and pipeline"""

log = logging.getLogger("delta_s3")


# -- counting S3 requests -------------------------------------------------------------


def request_kind(method: str, target: str, headers: Any) -> str:
    """The S3 operation of a path-style request (``/bucket/key?query``)."""
    url = urlparse(target)
    query = parse_qs(url.query, keep_blank_values=True)
    key = url.path.lstrip("/").partition("/")[2]
    if method == "HEAD":
        return "HEAD"
    if method == "GET":
        return "LIST" if not key or "list-type" in query else "GET"
    if method == "PUT":
        if headers.get("x-amz-copy-source"):
            return "COPY"
        return "PUT part" if "partNumber" in query else "PUT"
    if method == "POST":
        if "delete" in query:
            return "DELETE (batch)"
        if "uploads" in query:
            return "POST multipart start"
        if "uploadId" in query:
            return "POST multipart complete"
        return "POST"
    if method == "DELETE":
        return "DELETE multipart abort" if "uploadId" in query else "DELETE"
    return method


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


COUNTS_PATH = "/__twophase_counts__"
"""GET on the proxy: its counts since the last such GET, as JSON (not forwarded)"""


class CountingProxy:
    """Forwards every request unchanged to ``upstream`` (the S3 server) and
    counts them by kind (:func:`request_kind`). Like
    :class:`lifecycle.testing.s3faults.ThrottlingProxy`, without the refusals,
    and in a process of its own (:func:`serve_counting_proxy`): deltalake's
    file-system handler holds the GIL while it waits for the store, so a proxy
    in the driver's process would wait for it forever."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self._proc: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        assert self._proc is not None, "the proxy has not been started"
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--count-proxy", self.upstream],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        self.port = int(self._proc.stdout.readline())

    def take(self) -> dict[str, int]:
        """The counts since the last call (and start again from zero)."""
        with urllib.request.urlopen(self.endpoint + COUNTS_PATH, timeout=30) as r:
            counts: dict[str, int] = json.loads(r.read())
        return dict(sorted(counts.items()))

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            proc.wait(10)


def serve_counting_proxy(upstream: str) -> None:
    """The proxy's process: print its port, then serve until terminated."""
    parsed = urlparse(upstream)
    target = (parsed.hostname or "127.0.0.1", parsed.port or 80)
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    local = threading.local()

    def connection() -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(*target, timeout=120)
        return conn

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _forward(self, body: bytes) -> http.client.HTTPResponse:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                headers["Content-Length"] = str(len(body))
            for attempt in (0, 1):  # a pooled connection the server closed: once more
                conn = connection()
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    return conn.getresponse()
                except (http.client.HTTPException, ConnectionError):
                    conn.close()
                    local.conn = None
                    if attempt:
                        raise
            raise AssertionError("unreachable")

        def _send(
            self,
            status: int,
            reason: str,
            headers: list[tuple[str, str]],
            data: bytes,
            length: str | None = None,
        ) -> None:
            self.send_response(status, reason)
            for k, v in headers:
                if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _handle(self) -> None:
            body = self._body()
            if self.path == COUNTS_PATH:
                with lock:
                    data = json.dumps(dict(counts)).encode()
                    counts.clear()
                self._send(200, "OK", [("Content-Type", "application/json")], data)
                return
            with lock:
                counts[request_kind(self.command, self.path, self.headers)] += 1
            resp = self._forward(body)
            data = resp.read()
            length = resp.getheader("Content-Length") if self.command == "HEAD" else None
            try:
                self._send(resp.status, resp.reason, resp.getheaders(), data, length)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client stopped reading (a ranged read)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.request_queue_size = 128
    print(server.server_address[1], flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


# -- the store and the session -------------------------------------------------------


@dataclass
class Store:
    """The S3 server, its buckets, and how each client reaches them: directly
    (timed runs) or through the counting proxy (``counted``)."""

    server: S3Proxy
    proxy: CountingProxy | None
    spark: SparkSession | None = None
    _n: int = 0

    def options(self, counted: bool = False) -> dict[str, str]:
        """deltalake's (and the sink's) storage options."""
        opts = self.server.storage_options()
        if counted:
            assert self.proxy is not None
            opts["AWS_ENDPOINT_URL"] = self.proxy.endpoint
        return opts

    def bucket(self, label: str, counted: bool = False) -> str:
        """A new empty bucket; with ``counted``, S3A reaches it through the proxy
        (a per-bucket endpoint, read when S3A first opens the bucket)."""
        self._n += 1
        name = f"b{self._n:03d}-" + "".join(c if c.isalnum() else "-" for c in label.lower())
        name = name[:63].rstrip("-")
        self.server.create_bucket(name)
        if self.spark is not None:
            endpoint = self.proxy.endpoint if counted and self.proxy else self.server.endpoint
            hconf = self.spark.sparkContext._jsc.hadoopConfiguration()
            hconf.set(f"fs.s3a.bucket.{name}.endpoint", endpoint)
        return name

    def drop(self, bucket: str) -> None:
        self.server.delete_bucket(bucket)


def s3_spark(app: str, server: S3Proxy, conf: Sequence[str]) -> SparkSession:
    """:func:`benchmarks._common.bench_spark`'s session (``local[2]``, delta-spark's
    jars and SQL extension), with Hadoop's S3A on the driver's classpath (set
    before the JVM starts: local mode runs the executors in the driver's JVM)
    and pointed at ``server``. ``conf``: more settings, ``KEY=VALUE``."""
    s3a = os.pathsep.join(str(p) for p in jars.jars("s3a"))
    start = {"spark.driver.extraClassPath": s3a, **server.spark_conf()}
    return bench_spark(app, jar_sets=("delta",), conf=conf, start_conf=start)


# -- the variants ---------------------------------------------------------------------


def run_write_deltalake(src: DataFrame, uri: str, options: dict[str, str], ckpt: Path) -> float:
    def each(df: DataFrame, _batch: int) -> None:
        data = df.toArrow()
        if data.num_rows:
            write_deltalake(uri, data, mode="append", storage_options=options)

    return time_foreach_batch(src, each, ckpt)


def check_append(uri: str, options: dict[str, str], rows: int, variant: str) -> int:
    """Ids 0..rows-1 once each in the table; no staging marker left. Its version."""
    dt = DeltaTable(uri, storage_options=options)
    ids = dt.to_pyarrow_table(columns=["id"]).column("id")
    got = (len(ids), pc.count_distinct(ids).as_py(), pc.min(ids).as_py(), pc.max(ids).as_py())
    assert got == (rows, rows, 0, rows - 1), f"{variant}: (rows, distinct, min, max) {got}"
    staged = TableStorage(uri, options).list_files(STAGING_DIR)
    assert not staged, f"{variant}: {len(staged)} staging marker(s) left"
    return dt.version()


def copy_prefix(server: S3Proxy, src_bucket: str, dst_bucket: str, prefix: str) -> int:
    """Copy every object under ``prefix`` server-side; return how many."""
    c = server.client()
    keys = [
        o["Key"]
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=src_bucket, Prefix=prefix)
        for o in page.get("Contents", [])
    ]
    for k in keys:
        c.copy_object(Bucket=dst_bucket, Key=k, CopySource={"Bucket": src_bucket, "Key": k})
    return len(keys)


def expected_merge(base: pa.Table, change_dir: Path) -> pa.Table:
    """The base with every change file's changes applied in order (by id)."""
    final: dict[int, tuple[str, float] | None] = {}
    for f in sorted(change_dir.glob("*.parquet")):
        t = pq.read_table(f)
        for i, name, amount, op in zip(
            *(t.column(c).to_pylist() for c in ("id", "name", "amount", "op")), strict=True
        ):
            final[i] = None if op == "D" else (name, amount)
    kept = base.filter(pc.invert(pc.is_in(base.column("id"), pa.array(list(final), pa.int64()))))
    written = [(i, v) for i, v in final.items() if v is not None]
    new = pa.table(
        {
            "id": pa.array([i for i, _ in written], pa.int64()),
            "name": pa.array([v[0] for _, v in written], pa.string()),
            "amount": pa.array([v[1] for _, v in written], pa.float64()),
        }
    )
    return pa.concat_tables([kept, new]).sort_by("id")


def check_merge(uri: str, options: dict[str, str], want: pa.Table, variant: str) -> int:
    """The table equals ``want`` row for row; its version."""
    dt = DeltaTable(uri, storage_options=options)
    got = dt.to_pyarrow_table(columns=want.column_names).sort_by("id").cast(want.schema)
    assert got.num_rows == want.num_rows, f"{variant}: {got.num_rows} rows, want {want.num_rows}"
    assert got.equals(want), f"{variant}: the merged table differs from the expected rows"
    return dt.version()


# -- the sweep ------------------------------------------------------------------------


def make_markers(server: S3Proxy, bucket: str, prefix: str, names: list[str]) -> float:
    """PUT one staging marker per stem (16 at a time); seconds taken."""
    import boto3
    from botocore.config import Config

    c = boto3.client(  # S3Proxy.client()'s, with a connection for each thread
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=16),
    )

    def put(stem: str) -> None:
        key = f"{prefix}/{STAGING_DIR}/{stem}"
        c.put_object(Bucket=bucket, Key=key, Body=(stem + DATA_SUFFIX).encode())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, names))
    return time.perf_counter() - t0


def marker_stems(sink_id: str, incarnation: str, n: int) -> list[str]:
    """``n`` stems of the sink's scope: 100 tasks a batch, one file each."""
    return [
        file_stem(str(TxnName(JOB, PIPELINE, sink_id, 1, i // 100, i % 100, 0, incarnation)), 0)
        for i in range(n)
    ]


@dataclass
class SweepResult:
    markers: int
    create_s: float
    seconds: dict[str, list[float]] = field(default_factory=dict)
    requests: dict[str, dict[str, int]] = field(default_factory=dict)
    found: dict[str, int] = field(default_factory=dict)


def run_sweep(store: Store, markers: int, repeat: int, count: bool) -> SweepResult:
    """Part 3 (module docstring): the sweep's listing with ``markers`` markers."""
    server = store.server
    bucket = store.bucket("sweep")
    uri = f"s3://{bucket}/t"
    write_deltalake(
        uri, pa.table({"id": pa.array([0], pa.int64())}), storage_options=store.options()
    )
    incarnation = secrets.token_hex(6)
    made = time.perf_counter()
    sink_id = DeltaSink(uri, storage_options=store.options()).sink_id
    stems = marker_stems(sink_id, incarnation, markers)
    result = SweepResult(markers, make_markers(server, bucket, "t", stems))
    print(f"sweep: {markers:,} markers created in {time.perf_counter() - made:.1f} s", flush=True)
    scope = JobScope(JOB, PIPELINE, sink_id, incarnation)

    def calls(sink: DeltaSink) -> dict[str, Callable[[], int]]:
        storage = TableStorage(uri, sink.storage_options)
        return {
            "list_files": lambda: len(storage.list_files(STAGING_DIR)),
            "lingering": lambda: len(sink.committer().lingering(JOB, PIPELINE)),
            "sweep, none orphaned": lambda: len(sink.committer().sweep(scope, lambda n: False)),
        }

    timed = DeltaSink(uri, storage_options=store.options())
    for r in range(-1, repeat):
        for what, call in calls(timed).items():
            t0 = time.perf_counter()
            found = call()
            secs = time.perf_counter() - t0
            result.found[what] = found
            if r >= 0:
                result.seconds.setdefault(what, []).append(secs)
            print(
                f"sweep {'warm-up' if r < 0 else f'run {r}':<8} {what:<32} {secs:6.3f} s "
                f"({found:,})",
                flush=True,
            )
    if count:
        counted = DeltaSink(uri, storage_options=store.options(counted=True))
        assert store.proxy is not None
        store.proxy.take()
        for what, call in calls(counted).items():
            call()
            result.requests[what] = store.proxy.take()
    # one sweep that finds every marker orphaned (reads it, deletes its file and it)
    t0 = time.perf_counter()
    swept = timed.committer().sweep(scope, lambda n: True)
    result.seconds["sweep, all orphaned"] = [time.perf_counter() - t0]
    result.found["sweep, all orphaned"] = len(swept)
    left = TableStorage(uri, store.options()).list_files(STAGING_DIR)
    assert not left, f"the sweep left {len(left)} marker(s)"
    print(
        f"sweep: every marker orphaned, swept in {result.seconds['sweep, all orphaned'][0]:.2f} s",
        flush=True,
    )
    if count:
        assert store.proxy is not None
        make_markers(server, bucket, "t", stems[: max(1, markers // 10)])
        counted = DeltaSink(uri, storage_options=store.options(counted=True))
        store.proxy.take()
        counted.committer().sweep(scope, lambda n: True)
        result.requests[f"sweep, all orphaned (of {max(1, markers // 10):,})"] = store.proxy.take()
    store.drop(bucket)
    return result


# -- the runs -------------------------------------------------------------------------


@dataclass
class Run:
    part: str
    case: str
    variant: str
    round: int
    seconds: float
    version: int
    requests: dict[str, int] | None = None
    commit_s: list[float] | None = None
    """the sink's: each checkpoint's commit, from its decision to every commit done"""
    jobs_s: float | None = None
    """the floors': the seconds of their Spark jobs, summed over the micro-batches"""


def timed_rounds(
    rounds: Iterator[int], variants: Sequence[str], one: Callable[[str, int], Run]
) -> list[Run]:
    runs = []
    for r in rounds:
        for v in variants:
            run = one(v, r)
            runs.append(run)
            label = "warm-up" if r < 0 else ("counted" if run.requests is not None else f"run {r}")
            reqs = f", {sum(run.requests.values()):,} requests" if run.requests else ""
            print(
                f"{label:<8} {run.part:<7} {run.case:<8} {v:<22} {run.seconds:7.2f} s "
                f"({f'table version {run.version}' if run.version >= 0 else 'no table'}{reqs})",
                flush=True,
            )
    return runs


def append_runs(
    spark: SparkSession, store: Store, work: Path, args: argparse.Namespace
) -> list[Run]:
    make_input(work / "in", args.rows, 2 * args.batches)

    def one(variant: str, r: int) -> Run:
        counted = r == COUNTED
        bucket = store.bucket(f"a-{variant}", counted)
        where = work / f"append-{bucket}"
        uri = f"s3://{bucket}/t"
        options = store.options(counted)
        src = parquet_stream(spark, work / "in", 2)
        if store.proxy is not None:
            store.proxy.take()
        commit_s = jobs_s = None
        if variant == SINK:
            sink = DeltaSink(uri, storage_options=options)
            secs = time_job(spark, src, sink, where / "state", args.interval)
            commit_s = commit_latencies(where / "state")
        elif variant == APPEND_ALT:
            secs = run_spark_append(src, f"s3a://{bucket}/t", where / "spark", None)
        elif variant == APPEND_LIMIT:
            secs = run_write_deltalake(src, uri, options, where / "spark")
        else:
            secs, jobs_s = run_floor(src, FLOORS.index(variant), bucket, options, where)
        requests = store.proxy.take() if counted and store.proxy is not None else None
        if variant in FLOORS:
            version = -1
        else:
            version = check_append(uri, store.options(), args.rows, variant)
        store.drop(bucket)
        shutil.rmtree(where, ignore_errors=True)
        return Run("append", "-", variant, r, secs, version, requests, commit_s, jobs_s)

    runs = timed_rounds(
        iter(range(-1, args.repeat)), APPENDS + (FLOORS if args.floors else ()), one
    )
    if args.count:  # the floors' requests are the PUTs of their files: not counted
        runs += timed_rounds(iter([COUNTED]), APPENDS, one)
    return runs


FLOORS = ("floor: discard", "floor: Parquet", "floor: Parquet + PUT")
"""``--floors``: the same stream into ``foreachBatch`` -> ``mapInArrow`` tasks that
discard their rows; that encode them as one Parquet file in memory (pyarrow,
snappy, as the sink's writer); and that also upload it with one PUT (boto3, a
client made in each task, as the sink's markers are written). What the sink's
Arrow route costs before any of its own work."""


class FloorTask:
    """The tasks of a floor (:data:`FLOORS`): ``level`` 0, 1 or 2."""

    def __init__(self, level: int, bucket: str, options: dict[str, str]) -> None:
        self.level = level
        self.bucket = bucket
        self.options = options

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import io
        import uuid

        buf = io.BytesIO()
        writer: pq.ParquetWriter | None = None
        for b in batches:
            if self.level == 0:
                continue
            if writer is None:
                writer = pq.ParquetWriter(buf, b.schema, compression="snappy")
            writer.write_batch(b)
        if writer is not None:
            writer.close()
            if self.level == 2:
                import boto3

                o = self.options
                boto3.client(
                    "s3",
                    endpoint_url=o["AWS_ENDPOINT_URL"],
                    aws_access_key_id=o["AWS_ACCESS_KEY_ID"],
                    aws_secret_access_key=o["AWS_SECRET_ACCESS_KEY"],
                    region_name=o["AWS_REGION"],
                ).put_object(
                    Bucket=self.bucket, Key=f"t/{uuid.uuid4()}.parquet", Body=buf.getvalue()
                )
        yield from ()


def run_floor(
    src: DataFrame, level: int, bucket: str, options: dict[str, str], where: Path
) -> tuple[float, float]:
    """A floor's seconds, and the seconds of its Spark jobs."""
    jobs: list[float] = []
    task = FloorTask(level, bucket, options)

    def each(df: DataFrame, _batch: int) -> None:
        t0 = time.perf_counter()
        df.mapInArrow(task, "committable string").collect()
        jobs.append(time.perf_counter() - t0)

    return time_foreach_batch(src, each, where / "spark"), sum(jobs)


COUNTED = 1_000_000
"""the round number of the counted run (after the timed rounds)"""


def rounds(args: argparse.Namespace) -> Iterator[int]:
    yield from range(-1, args.repeat)
    if args.count:
        yield COUNTED


def merge_runs(
    spark: SparkSession, store: Store, work: Path, args: argparse.Namespace
) -> list[Run]:
    base_bucket = store.bucket("base")
    t0 = time.perf_counter()
    base = base_table(f"s3://{base_bucket}/t", args.rows, args.files, store.options())
    print(
        f"merge: base table of {args.rows:,} rows written in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    runs: list[Run] = []
    for how in args.distributions:
        change_dir = work / f"changes-{how}"
        make_changes(change_dir, args.rows, args.changes, how, seed=7, batches=args.batches)
        want = expected_merge(base, change_dir)

        def one(
            variant: str,
            r: int,
            how: str = how,
            change_dir: Path = change_dir,
            want: pa.Table = want,
        ) -> Run:
            counted = r == COUNTED
            bucket = store.bucket(f"m-{how}-{variant}", counted)
            copy_prefix(store.server, base_bucket, bucket, "t/")
            where = work / f"merge-{bucket}"
            uri = f"s3://{bucket}/t"
            options = store.options(counted)
            src = parquet_stream(spark, change_dir, 1)
            if store.proxy is not None:
                store.proxy.take()
            commit_s = None
            if variant == SINK:
                sink = DeltaSink(uri, storage_options=options, key=["id"], delete_when=("op", "D"))
                secs = time_job(spark, src, sink, where / "state", args.interval)
                commit_s = commit_latencies(where / "state")
            else:
                secs = run_spark_merge(src, f"s3a://{bucket}/t", where / "spark")
            requests = store.proxy.take() if counted and store.proxy is not None else None
            version = check_merge(uri, store.options(), want, variant)
            store.drop(bucket)
            shutil.rmtree(where, ignore_errors=True)
            return Run("merge", how, variant, r, secs, version, requests, commit_s)

        runs += timed_rounds(rounds(args), MERGES, one)
    store.drop(base_bucket)
    return runs


# -- the report -----------------------------------------------------------------------


def medians(runs: list[Run]) -> dict[tuple[str, str, str], float]:
    by: dict[tuple[str, str, str], list[float]] = {}
    for r in runs:
        if 0 <= r.round < COUNTED:
            by.setdefault((r.part, r.case, r.variant), []).append(r.seconds)
    return {k: statistics.median(v) for k, v in by.items()}


def counts_of(runs: list[Run]) -> dict[tuple[str, str, str], dict[str, int]]:
    return {(r.part, r.case, r.variant): r.requests for r in runs if r.requests is not None}


def fmt_counts(c: dict[str, int] | None) -> str:
    if not c:
        return "-"
    return f"{sum(c.values()):,} (" + ", ".join(f"{k} {v:,}" for k, v in c.items()) + ")"


LABELS = {
    ("append", SINK): '`DeltaSink("s3://...")` in a Job (exactly-once; Arrow route)',
    ("append", APPEND_ALT): "delta-spark `txnAppId`/`txnVersion` in `foreachBatch` (S3A)",
    ("append", APPEND_LIMIT): "`write_deltalake` per batch in `foreachBatch` (at-least-once)",
    ("merge", SINK): '`DeltaSink(..., key=["id"])` in a Job (exactly-once)',
    ("merge", MERGE_ALT): "delta-spark `DeltaTable.merge` in `foreachBatch` (S3A)",
}


def commits_line(runs: list[Run], part: str) -> str:
    """The sink's commits in ``part``'s timed runs (from its ledger)."""
    per_run = [
        r.commit_s
        for r in runs
        if r.part == part and r.commit_s is not None and 0 <= r.round < COUNTED
    ]
    if not per_run:
        return ""
    return (
        "The sink's commits (each checkpoint's, from its decision to every commit done; "
        f"the ledger's): {statistics.median(len(c) for c in per_run):.0f} checkpoint(s) "
        f"with rows a run, {statistics.median(sum(c) for c in per_run):.2f} s a run (median)"
    )


def report(
    runs: list[Run], sweep: SweepResult | None, args: argparse.Namespace, header: list[str]
) -> str:
    med = medians(runs)
    counted = counts_of(runs)
    out = [*header, ""]
    if any(r.part == "append" for r in runs):
        out += [
            f"Appends: {args.rows:,} rows, {args.batches} micro-batches; median of "
            f"{args.repeat} after a warm-up",
            "",
            "| variant | seconds | rows/s | sink vs this | S3 requests (counted run) |",
            "| --- | ---: | ---: | ---: | --- |",
        ]
        sink = med[("append", "-", SINK)]
        for v in APPENDS:
            m = med[("append", "-", v)]
            out.append(
                f"| {LABELS[('append', v)]} | {m:.2f} | {args.rows / m:,.0f} | "
                f"{m / sink:.2f} | {fmt_counts(counted.get(('append', '-', v)))} |"
            )
        out += ["", commits_line(runs, "append")]
        if args.floors:
            out += [
                "",
                "The Arrow route's floors: `foreachBatch` -> `mapInArrow` tasks that discard "
                "their rows, that encode them as Parquet in memory, and that also upload it "
                "with one PUT",
                "",
                "| floor | seconds | its Spark jobs, s | sink vs this |",
                "| --- | ---: | ---: | ---: |",
            ]
            for v in FLOORS:
                m = med[("append", "-", v)]
                jobs = statistics.median(
                    r.jobs_s for r in runs if r.variant == v and 0 <= r.round < COUNTED and r.jobs_s
                )
                out.append(f"| {v} | {m:.2f} | {jobs:.2f} | {m / sink:.2f} |")
        out.append("")
    if any(r.part == "merge" for r in runs):
        total = args.changes * args.batches
        out += [
            f"Keyed merges: {args.batches} micro-batches of {args.changes:,} changes (10% "
            f"deletes) into {args.rows:,} rows in {args.files} files; median of {args.repeat} "
            "after a warm-up",
            "",
            "| keys | variant | seconds | changes/s | sink vs this | S3 requests (counted run) |",
            "| --- | --- | ---: | ---: | ---: | --- |",
        ]
        for how in args.distributions:
            sink = med[("merge", how, SINK)]
            for v in MERGES:
                m = med[("merge", how, v)]
                out.append(
                    f"| {how} | {LABELS[('merge', v)]} | {m:.2f} | {total / m:,.0f} | "
                    f"{m / sink:.2f} | {fmt_counts(counted.get(('merge', how, v)))} |"
                )
        out += ["", commits_line(runs, "merge"), ""]
    if sweep is not None:
        out += [
            f"The sweep at {sweep.markers:,} staging markers (created in "
            f"{sweep.create_s:.1f} s, 16 PUTs at a time); median of {args.sweep_repeat}",
            "",
            "| call | seconds | found | S3 requests |",
            "| --- | ---: | ---: | --- |",
        ]
        for what, secs in sweep.seconds.items():
            out.append(
                f"| `{what}` | {statistics.median(secs):.3f} | {sweep.found.get(what, 0):,} | "
                f"{fmt_counts(sweep.requests.get(what))} |"
            )
        for what, c in sweep.requests.items():
            if what not in sweep.seconds:
                out.append(f"| `{what}` (counted only) | - | - | {fmt_counts(c)} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", type=int, help="rows appended, and of the merges' base (2,000,000)")
    ap.add_argument("--files", type=int, default=20, help="files of the merges' base table")
    ap.add_argument("--batches", type=int, help="micro-batches of each run (10)")
    ap.add_argument("--changes", type=int, help="changes a micro-batch of the merges (20,000)")
    ap.add_argument(
        "--distributions",
        default="uniform",
        help=f"the merges' keys, a comma-separated subset of {DISTRIBUTIONS}",
    )
    ap.add_argument("--repeat", type=int, help="timed rounds after the warm-up (3)")
    ap.add_argument("--markers", type=int, help="staging markers of the sweep (10,000)")
    ap.add_argument("--sweep-repeat", type=int, default=5, help="timed calls of each sweep call")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {PARTS}")
    ap.add_argument("--interval", type=float, default=5.0, help="the sink's checkpoint_interval")
    ap.add_argument(
        "--no-count",
        dest="count",
        action="store_false",
        help="no counted run (each variant once more through the counting proxy)",
    )
    ap.add_argument(
        "--floors",
        action="store_true",
        help="the appends also run the Arrow route's floors (where the sink's time goes)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke check")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--stem", help="the results' file names (delta-s3, delta-s3-quick)")
    ap.add_argument("--workdir", help="where input and states go (default: a tmp dir)")
    add_conf_option(ap)
    ap.add_argument("--count-proxy", metavar="UPSTREAM", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.count_proxy:
        serve_counting_proxy(args.count_proxy)
        return 0
    quick = args.quick
    args.rows = args.rows or (100_000 if quick else 2_000_000)
    args.batches = args.batches or (3 if quick else 10)
    args.changes = args.changes or (1_000 if quick else 20_000)
    args.repeat = args.repeat if args.repeat is not None else (1 if quick else 3)
    args.markers = args.markers or (500 if quick else 10_000)
    args.sweep_repeat = 1 if quick and args.sweep_repeat == 5 else args.sweep_repeat
    args.distributions = [d for d in args.distributions.split(",") if d]
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS) or set(args.distributions) - set(DISTRIBUTIONS):
        ap.error(f"--parts from {PARTS}, --distributions from {DISTRIBUTIONS}")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    stem = args.stem or ("delta-s3-quick" if quick else "delta-s3")
    logging.basicConfig(level=logging.WARNING)

    command = shlex.join([Path(sys.executable).name, *sys.argv])
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg()
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="twophase-delta-s3-", dir=args.workdir))
    runs: list[Run] = []
    sweep: SweepResult | None = None
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(S3Proxy(provider=PROVIDER, heap="2g"))
        stack.callback(shutil.rmtree, work, True)
        proxy = None
        if args.count:
            proxy = CountingProxy(server.endpoint)
            proxy.start()
            stack.callback(proxy.stop)
        store = Store(server, proxy)
        print(
            f"S3Proxy {server.endpoint} (store {server.provider}); {os.cpu_count()} cores, "
            f"load {load_before[0]:.2f}",
            flush=True,
        )
        if "appends" in parts or "merges" in parts:
            spark = s3_spark("twophase-delta-s3", server, args.conf)
            stack.callback(spark.stop)
            store.spark = spark
            if "appends" in parts:
                runs += append_runs(spark, store, work, args)
            if "merges" in parts:
                runs += merge_runs(spark, store, work, args)
        if "sweep" in parts:
            sweep = run_sweep(store, args.markers, args.sweep_repeat, args.count)
    load_after = os.getloadavg()
    took = time.monotonic() - t_start

    def load(xs: tuple[float, float, float]) -> str:
        return ", ".join(f"{x:.2f}" for x in xs)

    header = [
        "# The Delta sink on S3: `benchmarks/delta_s3.py`",
        "",
        f"- command: `{command}`",
        f"- date: {started.isoformat(timespec='seconds')}; took {took / 60:.1f} min",
        f"- cores: {os.cpu_count()}, Spark `local[2]`; load average (1, 5, 15 min) before: "
        f"{load(load_before)}, after: {load(load_after)}; settings {args.conf}",
        f"- S3: S3Proxy (store `{PROVIDER}`) on 127.0.0.1; the sink's "
        f"checkpoint_interval={args.interval}",
        "- sink vs this: this variant's median seconds / the sink's (above 1: the sink is faster)",
    ]
    table = report(runs, sweep, args, header)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(table)
    med = medians(runs)
    doc: dict[str, Any] = {
        "command": command,
        "date": started.isoformat(timespec="seconds"),
        "seconds": took,
        "cpu_count": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "settings": args.conf,
        "rows": args.rows,
        "batches": args.batches,
        "changes": args.changes,
        "base_files": args.files,
        "distributions": args.distributions,
        "repeat": args.repeat,
        "interval": args.interval,
        "runs": [asdict(r) for r in runs],
        "medians": [
            {"part": p, "case": c, "variant": v, "seconds": s} for (p, c, v), s in med.items()
        ],
        "ratios": {
            f"{p} {c}: {SINK} vs {v}": med[(p, c, v)] / med[(p, c, SINK)]
            for (p, c, v) in med
            if v != SINK and v not in FLOORS and (p, c, SINK) in med
        },
        "sweep": asdict(sweep) if sweep is not None else None,
    }
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out / stem}.md and .json in {took / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
