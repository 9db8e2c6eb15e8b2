"""How cost grows: throughput and commit latency of each sink and its physical-limit
baseline as partitions, rows per batch and row width grow.

From a middle point (``MIDDLE``: 4 partitions, 100,000 rows per micro-batch, rows of
about 100 bytes, 3 micro-batches), one axis at a time:

* partitions 1, 4, 16, 64: for Kafka the partitions of the topic; for PostgreSQL and
  Delta the Spark tasks of each micro-batch (the stream is repartitioned, in the
  baselines as in the sinks' jobs);
* rows per micro-batch 10,000, 100,000, 1,000,000;
* row width 100 B, 1 KB, 10 KB: the ``name`` column of the input (``make_input``'s
  rows {id, name, amount, qty}) padded with random characters so that a row takes that
  many bytes in Arrow (what Spark hands the sinks; the random text does not compress).

A run holds at most 1 GB of input (``CAP``): a wide point keeps its 3 micro-batches and
takes fewer rows per batch (10 KB rows: 33,333). The input is Parquet files read as a
bounded stream (two files a micro-batch, available-now trigger) by one SparkSession
(``local[2]``) for the whole script. Per sink, its baseline(s) and the sink itself:

* PostgreSQL: autocommit binary COPY in each task (``pg_throughput.run_baseline``)
  against :class:`sinks.PostgresSink`; a private server (``fsync=off`` as the tests'),
  with room for 300 prepared transactions (64 tasks a batch);
* Kafka (a private Apache Kafka broker on loopback; ``--broker tansu`` for tansu, in
  memory, as the runs before 2026-11-27): confluent-kafka producer processes, as
  many as Spark's cores, non-transactional, the records encoded beforehand (its
  ``_rdkafka_worker``, timed from a barrier once every process has encoded its
  records, see :func:`kafka_throughput.run_librdkafka`) against :class:`sinks.KafkaSink`;
* Delta (local disk): ``write_deltalake`` per micro-batch, data collected to the driver
  (``delta_throughput.run_baseline``), and Spark's own ``df.write.parquet`` per
  micro-batch (no Delta log at all); the faster of the two is the baseline; against
  :class:`sinks.DeltaSink`.

The sinks run in a :class:`lifecycle.Job` with ``checkpoint_interval=0`` (a checkpoint
per micro-batch, as soon as Spark completed it). Commit latency is read from the job's
ledger afterwards: for every checkpoint that committed rows, ``committed_at -
decided_at``, i.e. from the checkpoint's decision (the coordinator's barrier: the cut
is chosen and ``decide`` is recorded) to every sink's commit acknowledged (stamped when
``complete`` is recorded; the ledger's fsync of ``complete``, the sinks' ``forget`` and
the sweep of orphans come after it and are not counted).

Every run is checked afterwards: PostgreSQL and Delta hold ids 0..n-1 once each (count,
distinct count, min and max), no prepared transaction of the job is left, no staged
file or marker is left in the Delta table; Kafka's raw log holds n committed records
and nothing open (``kafka_throughput.count_records``). Per sink one warm-up round at the
middle point comes first, not counted; then each point runs ``--repeat`` rounds, each
baseline then the sink (alternating). Figures are medians over the rounds; rows/s and
MB/s count the input (Arrow bytes).

Output (``--out``, default ``benchmarks/results``): ``scaling.md`` (the table, also
printed), ``scaling.json`` (every run), ``scaling.png`` (one column per axis: the
throughput ratio sink/baseline, rows/s of each, commit latency). The header records
the cores, the load average before and after, the date and the command line. Progress
goes to stderr, one line per run. ``--quick`` (rows / 100, cap 10 MB, one round, files
named ``scaling-quick.*``) is a smoke check of a few minutes.

    python benchmarks/scaling.py [--sinks pg,kafka,delta] [--axes partitions,rows,width]
                                 [--repeat 3] [--quick] [--out benchmarks/results]
                                 [--delta-baseline both|deltalake|parquet]
                                 [--broker apache|tansu]

A run of some of the sinks writes its own files (``--sinks kafka``:
``scaling-kafka.md``, ...), beside the whole run's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psycopg  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.dataset as ds  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from pyspark.sql import DataFrame, SparkSession  # noqa: E402

from benchmarks import delta_throughput, kafka_throughput, pg_throughput  # noqa: E402
from benchmarks._common import (  # noqa: E402
    bench_spark,
    commit_latencies,
    make_input,
    parquet_stream,
    time_job,
)
from sinks import DeltaSink, KafkaSink, PostgresSink  # noqa: E402
from sinks.base import Sink  # noqa: E402

SINKS = ("pg", "kafka", "delta")
AXES = ("partitions", "rows", "width")
PARTITIONS = (1, 4, 16, 64)
ROWS = (10_000, 100_000, 1_000_000)
WIDTHS = (100, 1_000, 10_000)
BATCHES = 3
FILES_PER_BATCH = 2
CAP = 1_000_000_000  # bytes of input a run holds at most
QUICK = 100  # --quick divides the rows and the cap by this
FIXED = 8 + 8 + 4 + 4  # id, amount, qty and the offset of name, in Arrow bytes
DRIVER_MEMORY = "2g"  # a 333 MB micro-batch collected by write_deltalake's baseline
ALPHABET = np.frombuffer(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", np.uint8
)

BASELINES: dict[str, tuple[str, ...]] = {
    "pg": ("copy",),
    "kafka": ("librdkafka",),
    "delta": ("deltalake", "spark-parquet"),
}
LABELS = {
    "pg": "PostgresSink",
    "kafka": "KafkaSink",
    "delta": "DeltaSink",
    "copy": "autocommit binary COPY",
    "librdkafka": "confluent-kafka processes",
    "deltalake": "write_deltalake per batch",
    "spark-parquet": "df.write.parquet per batch",
}
SINK = "sink"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- points and their input ---------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """Where on the axes a run is."""

    partitions: int
    rows: int
    """rows per micro-batch asked for (fewer when the cap says so)"""
    width: int
    """bytes per row in Arrow"""

    def value(self, axis: str) -> int:
        return {"partitions": self.partitions, "rows": self.rows, "width": self.width}[axis]

    def along(self, axis: str, v: int) -> Point:
        return replace(self, **{axis: v})

    def label(self) -> str:
        return f"partitions={self.partitions} rows={self.rows:,} width={self.width:,}"


@dataclass(frozen=True)
class Input:
    directory: Path
    files: list[str]
    rows_per_batch: int
    batches: int
    rows: int
    bytes: int


def plan(point: Point, cap: int) -> tuple[int, int]:
    """(rows per micro-batch, micro-batches) of ``point`` within ``cap`` bytes: the
    micro-batches stay, a wide row takes fewer rows per batch."""
    return min(point.rows, cap // (BATCHES * point.width)), BATCHES


def random_strings(n: int, length: int, rng: np.random.Generator) -> pa.Array:
    """``n`` strings of ``length`` random characters of a 64-letter alphabet."""
    assert n * length < 2**31, "one file's strings must fit 32-bit offsets"
    chars = ALPHABET[rng.integers(0, len(ALPHABET), size=n * length, dtype=np.uint8)]
    offsets = np.arange(0, (n + 1) * length, length, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(chars))


def make_padded_input(directory: Path, rows_per_batch: int, batches: int, width: int) -> Input:
    """``make_input``'s files, ``FILES_PER_BATCH`` a micro-batch, with ``name`` replaced
    by random text so that a row is ``width`` bytes in Arrow."""
    rows = rows_per_batch * batches
    make_input(directory, rows, batches * FILES_PER_BATCH)
    rng = np.random.default_rng(rows ^ width)
    total = 0
    files = sorted(directory.glob("*.parquet"))
    for f in files:
        t = pq.read_table(f)
        i = t.schema.get_field_index("name")
        t = t.set_column(i, "name", random_strings(t.num_rows, max(1, width - FIXED), rng))
        pq.write_table(t, f)
        total += t.nbytes
    return Input(directory, [str(f) for f in files], rows_per_batch, batches, rows, total)


class Inputs:
    """The input of each point, made once and shared by every sink."""

    def __init__(self, work: Path, cap: int) -> None:
        self.work = work
        self.cap = cap
        self._made: dict[tuple[int, int, int], Input] = {}

    def get(self, point: Point) -> Input:
        per, batches = plan(point, self.cap)
        key = (per, batches, point.width)
        if key not in self._made:
            t0 = time.perf_counter()
            where = self.work / f"in-{per}x{batches}-w{point.width}"
            self._made[key] = made = make_padded_input(where, per, batches, point.width)
            log(
                f"  input {per:,} rows x {batches} batches, {made.bytes / 1e6:,.1f} MB "
                f"({made.bytes / made.rows:,.0f} B a row), made in "
                f"{time.perf_counter() - t0:.1f} s"
            )
        return self._made[key]


# -- checks ---------------------------------------------------------------------------


def check_ids(ids: pa.ChunkedArray | pa.Array, n: int, what: str) -> None:
    """``ids`` are 0..n-1, each once."""
    got = (len(ids), pc.count_distinct(ids).as_py(), pc.min(ids).as_py(), pc.max(ids).as_py())
    assert got == (n, n, 0, n - 1), f"{what}: (rows, distinct, min, max) = {got}, expected n={n}"


def check_pg(dsn: str, table: str, n: int, variant: str) -> None:
    with psycopg.connect(dsn) as c:
        got = c.execute(f"SELECT count(*), count(DISTINCT id), min(id), max(id) FROM {table}")
        row = got.fetchone()
        assert row is not None
        assert tuple(row) == (n, n, 0, n - 1), f"{variant}: (rows, distinct, min, max) = {row}"
        prepared = c.execute("SELECT gid FROM pg_prepared_xacts").fetchall()
        assert prepared == [], f"{variant}: prepared transactions left: {prepared[:5]}"


def check_kafka(bootstrap: str, topic: str, n: int, variant: str) -> None:
    committed, aborted, still_open = kafka_throughput.count_records(bootstrap, topic)
    assert (committed, still_open) == (n, 0), (
        f"{variant}: {committed} committed, {aborted} aborted, {still_open} open records; "
        f"expected {n} committed"
    )


def check_delta(uri: str, n: int, variant: str) -> None:
    from deltalake import DeltaTable

    from tests import deltacheck

    check_ids(DeltaTable(uri).to_pyarrow_table(columns=["id"]).column("id"), n, variant)
    deltacheck.assert_nothing_staged(uri)


# -- one run --------------------------------------------------------------------------


@dataclass
class Run:
    sink: str
    variant: str
    point: Point
    round: int
    """-1: the warm-up round"""
    rows: int
    bytes: int
    rows_per_batch: int
    batches: int
    seconds: float
    commit_s: list[float] = field(default_factory=list)
    """commit latency of each checkpoint that committed rows (sink runs)"""
    load1: float = 0.0
    wall: float = 0.0
    """seconds of the whole run: setup and checks included"""

    @property
    def rows_s(self) -> float:
        return self.rows / self.seconds

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / 1e6


def run_sink(
    spark: SparkSession, src: DataFrame, sink: Sink, state: Path
) -> tuple[float, list[float]]:
    try:
        secs = time_job(spark, src, sink, state, 0.0)
    finally:
        sink.close()
    return secs, commit_latencies(state)


class Bench:
    """One sink's services and runs, in the script's SparkSession."""

    sink = ""

    def __init__(self, spark: SparkSession, delta_baselines: tuple[str, ...]) -> None:
        self.spark = spark
        self.cores = spark.sparkContext.defaultParallelism
        self.baselines = BASELINES[self.sink]
        if self.sink == "delta":
            self.baselines = delta_baselines

    @contextlib.contextmanager
    def service(self) -> Iterator[None]:
        yield

    def source(self, inp: Input, partitions: int) -> DataFrame:
        """The stream, repartitioned into ``partitions`` tasks a batch (PostgreSQL, Delta)."""
        return parquet_stream(self.spark, inp.directory, FILES_PER_BATCH).repartition(partitions)

    def run(self, variant: str, point: Point, inp: Input, where: Path) -> tuple[float, list[float]]:
        raise NotImplementedError


class PgBench(Bench):
    sink = "pg"
    dsn: str

    @contextlib.contextmanager
    def service(self) -> Iterator[None]:
        from lifecycle.testing.postgres_server import PostgresServer

        server = PostgresServer(
            settings={"max_prepared_transactions": "300", "max_connections": "300"}
        )
        try:
            server.start()
            self.dsn = server.dsn()
            yield
        finally:
            server.cleanup()

    def run(self, variant: str, point: Point, inp: Input, where: Path) -> tuple[float, list[float]]:
        table = f"scaling_{variant.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute(pg_throughput.DDL.format(t=table))
        try:
            src = self.source(inp, point.partitions)
            if variant == SINK:
                out = run_sink(self.spark, src, PostgresSink(self.dsn, table), where / "state")
            else:
                out = pg_throughput.run_baseline(src, self.dsn, table, where / "spark"), []
            check_pg(self.dsn, table, inp.rows, variant)
        finally:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                c.execute(f"DROP TABLE IF EXISTS {table}")
        return out


class KafkaBench(Bench):
    sink = "kafka"
    broker = "apache"
    """``apache`` (the broker users run) or ``tansu`` (``--broker``)"""
    bootstrap: str
    admin: Any  # kafka.KafkaAdminClient

    @contextlib.contextmanager
    def service(self) -> Iterator[None]:
        from kafka import KafkaAdminClient

        from lifecycle.testing.apache_kafka import ApacheKafka
        from lifecycle.testing.kafka_broker import KafkaBroker

        if self.broker == "tansu":
            logging.getLogger("sinks.kafka").setLevel(logging.ERROR)  # tansu's missing config
        broker = ApacheKafka() if self.broker == "apache" else KafkaBroker()
        try:
            broker.start()
            self.bootstrap = broker.bootstrap
            self.admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
            try:
                yield
            finally:
                self.admin.close()
        finally:
            broker.cleanup()

    def source(self, inp: Input, partitions: int) -> DataFrame:
        """Not repartitioned: ``partitions`` are the topic's (as kafka_throughput)."""
        return parquet_stream(self.spark, inp.directory, FILES_PER_BATCH)

    def run(self, variant: str, point: Point, inp: Input, where: Path) -> tuple[float, list[float]]:
        from kafka.admin import NewTopic

        topic = f"scaling-{variant}-{uuid.uuid4().hex[:8]}"
        self.admin.create_topics([NewTopic(topic, point.partitions, 1)])
        try:
            if variant == SINK:
                sink = KafkaSink(self.bootstrap, topic, key="id")
                src = self.source(inp, point.partitions)
                out = run_sink(self.spark, src, sink, where / "state")
            else:
                secs = kafka_throughput.run_librdkafka(self.bootstrap, topic, inp.files, self.cores)
                out = secs, []
            check_kafka(self.bootstrap, topic, inp.rows, variant)
        finally:
            with contextlib.suppress(Exception):  # free the broker's memory
                self.admin.delete_topics([topic])
        return out


class DeltaBench(Bench):
    sink = "delta"

    def run(self, variant: str, point: Point, inp: Input, where: Path) -> tuple[float, list[float]]:
        uri = str(where / "table")
        src = self.source(inp, point.partitions)
        try:
            if variant == SINK:
                out = run_sink(self.spark, src, DeltaSink(uri), where / "state")
                check_delta(uri, inp.rows, variant)
            elif variant == "deltalake":
                out = delta_throughput.run_baseline(src, uri, where / "spark", None), []
                check_delta(uri, inp.rows, variant)
            else:
                out = delta_throughput.run_spark_parquet(src, uri, where / "spark", None), []
                ids = ds.dataset(uri, format="parquet").to_table(columns=["id"]).column("id")
                check_ids(ids, inp.rows, variant)
        finally:
            shutil.rmtree(where, ignore_errors=True)
        return out


BENCHES: dict[str, Callable[[SparkSession, tuple[str, ...]], Bench]] = {
    "pg": PgBench,
    "kafka": KafkaBench,
    "delta": DeltaBench,
}


# -- the script -----------------------------------------------------------------------


def points(middle: Point, axes: list[str], quick: bool) -> list[Point]:
    """The middle point first, then each axis' other points, each point once."""
    out = [middle]
    for axis in axes:
        for v in axis_values(axis, quick):
            p = middle.along(axis, v)
            if p not in out:
                out.append(p)
    return out


def axis_values(axis: str, quick: bool) -> tuple[int, ...]:
    if axis == "partitions":
        return PARTITIONS
    if axis == "rows":
        return tuple(r // QUICK for r in ROWS) if quick else ROWS
    return WIDTHS


@dataclass
class Summary:
    sink: str
    point: Point
    rows_per_batch: int
    batches: int
    rows: int
    bytes: int
    seconds: dict[str, float]
    """median seconds of each variant"""
    baseline: str
    """the fastest baseline"""
    commit_ms: list[float]

    def rows_s(self, variant: str) -> float:
        return self.rows / self.seconds[variant]

    def mb_s(self, variant: str) -> float:
        return self.bytes / self.seconds[variant] / 1e6

    @property
    def ratio(self) -> float:
        return self.seconds[self.baseline] / self.seconds[SINK]

    def commit_p50(self) -> float:
        return statistics.median(self.commit_ms) if self.commit_ms else float("nan")


def summarise(runs: list[Run]) -> list[Summary]:
    groups: dict[tuple[str, Point], list[Run]] = {}
    for r in runs:
        if r.round >= 0:
            groups.setdefault((r.sink, r.point), []).append(r)
    out = []
    for (sink, point), rs in groups.items():
        by: dict[str, list[float]] = {}
        for r in rs:
            by.setdefault(r.variant, []).append(r.seconds)
        med = {v: statistics.median(xs) for v, xs in by.items()}
        base = min((v for v in med if v != SINK), key=lambda v: med[v])
        commits = [c * 1000 for r in rs if r.variant == SINK for c in r.commit_s]
        first = rs[0]
        out.append(
            Summary(
                sink,
                point,
                first.rows_per_batch,
                first.batches,
                first.rows,
                first.bytes,
                med,
                base,
                commits,
            )
        )
    return out


def markdown(summaries: list[Summary], axes: list[str], middle: Point, header: list[str]) -> str:
    lines = ["# How cost grows: `benchmarks/scaling.py`", "", *header, ""]
    lines += [
        "| sink | axis | value | rows/batch x batches | MB | baseline | baseline rows/s "
        "| baseline MB/s | sink rows/s | sink MB/s | sink / baseline | commit p50 ms "
        "| commit max ms |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for sink in SINKS:
        mine = {s.point: s for s in summaries if s.sink == sink}
        if not mine:
            continue
        for axis in axes:
            for s in sorted(
                (s for s in mine.values() if _on_axis(s.point, middle, axis)),
                key=lambda s: s.point.value(axis),
            ):
                others = ", ".join(
                    f"{LABELS[v]} {s.rows_s(v):,.0f}"
                    for v in s.seconds
                    if v not in (SINK, s.baseline)
                )
                base = LABELS[s.baseline] + (f" (other: {others})" if others else "")
                cmax = max(s.commit_ms) if s.commit_ms else float("nan")
                lines.append(
                    f"| {LABELS[sink]} | {axis} | {s.point.value(axis):,} "
                    f"| {s.rows_per_batch:,} x {s.batches} | {s.bytes / 1e6:,.1f} | {base} "
                    f"| {s.rows_s(s.baseline):,.0f} | {s.mb_s(s.baseline):,.1f} "
                    f"| {s.rows_s(SINK):,.0f} | {s.mb_s(SINK):,.1f} | {s.ratio:.2f} "
                    f"| {s.commit_p50():,.0f} | {cmax:,.0f} |"
                )
    return "\n".join(lines) + "\n"


def _on_axis(p: Point, middle: Point, axis: str) -> bool:
    return all(p.value(a) == middle.value(a) for a in AXES if a != axis)


def plot(summaries: list[Summary], axes: list[str], middle: Point, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"partitions": "partitions", "rows": "rows per micro-batch", "width": "row width (B)"}
    colours = {"pg": "tab:blue", "kafka": "tab:orange", "delta": "tab:green"}
    fig, grid = plt.subplots(3, len(axes), figsize=(5 * len(axes), 11), squeeze=False)
    for col, axis in enumerate(axes):
        ratio, absolute, latency = grid[0][col], grid[1][col], grid[2][col]
        for sink in SINKS:
            line = sorted(
                (s for s in summaries if s.sink == sink and _on_axis(s.point, middle, axis)),
                key=lambda s: s.point.value(axis),
            )
            if not line:
                continue
            xs = [s.point.value(axis) for s in line]
            c = colours[sink]
            ratio.plot(xs, [s.ratio for s in line], "o-", color=c, label=LABELS[sink])
            absolute.plot(xs, [s.rows_s(SINK) for s in line], "o-", color=c, label=LABELS[sink])
            absolute.plot(
                xs,
                [s.rows_s(s.baseline) for s in line],
                "s--",
                color=c,
                alpha=0.6,
                label=f"baseline of {LABELS[sink]}",
            )
            latency.plot(xs, [s.commit_p50() for s in line], "o-", color=c, label=LABELS[sink])
        ticks = sorted({s.point.value(axis) for s in summaries if _on_axis(s.point, middle, axis)})
        for ax in (ratio, absolute, latency):
            ax.set_xscale("log")
            ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel(names[axis])
            ax.grid(True, alpha=0.3)
        ratio.axhline(1.0, color="grey", lw=0.8)
        ratio.set_ylim(bottom=0)
        ratio.set_ylabel("throughput sink / baseline")
        absolute.set_yscale("log")
        absolute.set_ylabel("rows/s (dashed: baseline)")
        latency.set_ylabel("commit latency p50 (ms)")
        latency.set_ylim(bottom=0)
        ratio.set_title(f"{names[axis]} (others at the middle point)")
    grid[0][0].legend(fontsize="small")
    grid[1][0].legend(fontsize="x-small")
    fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(
    command: str,
    started: datetime.datetime,
    cores: int | None,
    load_before: float,
    load_after: float,
    repeat: int,
) -> str:
    """The plot's title: what ran, when, on what, how many rounds."""
    return (
        f"{command} - {started:%Y-%m-%d %H:%M} - {cores} cores, load "
        f"{load_before:.2f} -> {load_after:.2f}; medians of {repeat}"
    )


def replot(path: Path) -> int:
    """The plot of the run recorded in ``path`` (its ``.png`` beside it)."""
    doc = json.loads(path.read_text())
    known = {f.name for f in fields(Run)}
    runs = [
        Run(**{**{k: v for k, v in r.items() if k in known}, "point": Point(**r["point"])})
        for r in doc["runs"]
    ]
    summaries = summarise(runs)
    axes = list(AXES)  # the JSON does not name the axes run: an axis not run shows the middle point
    middle = Point(**doc["middle"])
    started = datetime.datetime.fromisoformat(doc["date"])
    title = _title(
        doc["command"],
        started,
        doc["cpu_count"],
        doc["loadavg_before"][0],
        doc["loadavg_after"][0],
        doc["repeat"],
    )
    plot(summaries, axes, middle, path.with_suffix(".png"), title)
    log(f"wrote {path.with_suffix('.png')}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--sinks", default=",".join(SINKS))
    ap.add_argument("--axes", default=",".join(AXES))
    ap.add_argument("--repeat", type=int, help="rounds per point (3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke check")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument(
        "--delta-baseline",
        choices=("both", "deltalake", "parquet"),
        default="both",
        help="Delta's baseline(s); with both, the faster is the reference",
    )
    ap.add_argument("--workdir", help="where input, tables and states go (default: a tmp dir)")
    ap.add_argument(
        "--broker", choices=("apache", "tansu"), default="apache", help="Kafka's broker"
    )
    ap.add_argument(
        "--replot", metavar="JSON", help="draw the plot of a run's scaling*.json again, and stop"
    )
    args = ap.parse_args()
    try:
        import matplotlib  # noqa: F401  (the plot comes last: refuse before a long run)
    except ImportError:
        ap.error("the plot needs matplotlib: pip install -e '.[bench]'")
    if args.replot:
        return replot(Path(args.replot))
    KafkaBench.broker = args.broker
    sinks = [s for s in args.sinks.split(",") if s]
    axes = [a for a in args.axes.split(",") if a]
    if set(sinks) - set(SINKS) or set(axes) - set(AXES) or not sinks or not axes:
        ap.error(f"--sinks from {SINKS}, --axes from {AXES}")
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    if repeat < 1:
        ap.error("--repeat must be >= 1")
    delta_baselines = {
        "both": ("deltalake", "spark-parquet"),
        "deltalake": ("deltalake",),
        "parquet": ("spark-parquet",),
    }[args.delta_baseline]
    cap = CAP // QUICK if args.quick else CAP
    middle = Point(4, 100_000 // QUICK if args.quick else 100_000, 100)
    todo = points(middle, axes, args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # a run of some sinks keeps to its own files (scaling-kafka.md), beside the whole run's
    stem = "scaling" + ("" if set(sinks) == set(SINKS) else "-" + "-".join(sinks))
    stem += "-quick" if args.quick else ""
    logging.basicConfig(level=logging.WARNING)

    command = shlex.join([Path(sys.executable).name, *sys.argv])
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg()
    t_start = time.monotonic()
    # the write_deltalake baseline collects a whole micro-batch in the driver
    os.environ.setdefault("PYSPARK_SUBMIT_ARGS", f"--driver-memory {DRIVER_MEMORY} pyspark-shell")
    work = Path(tempfile.mkdtemp(prefix="twophase-scaling-", dir=args.workdir))
    runs: list[Run] = []
    try:
        spark = bench_spark("twophase-scaling")
        cores = spark.sparkContext.defaultParallelism
        inputs = Inputs(work, cap)
        total = sum(
            (len(todo) * repeat + 1) * (len(BASELINES[s] if s != "delta" else delta_baselines) + 1)
            for s in sinks
        )
        log(
            f"scaling: {len(sinks)} sink(s) x {len(todo)} points x {repeat} round(s) "
            f"(+ a warm-up round each): {total} runs; {os.cpu_count()} cores, Spark "
            f"local[{cores}], load {load_before[0]:.2f}"
        )
        n = 0
        for sink in sinks:
            bench = BENCHES[sink](spark, delta_baselines)
            variants = [*bench.baselines, SINK]
            with bench.service():
                for r, point in [(-1, middle)] + [(r, p) for p in todo for r in range(repeat)]:
                    inp = inputs.get(point)
                    for variant in variants:
                        n += 1
                        where = work / f"{sink}-{variant}-{n}"
                        t0 = time.monotonic()
                        secs, commit_s = bench.run(variant, point, inp, where)
                        shutil.rmtree(where, ignore_errors=True)
                        run = Run(
                            sink,
                            variant,
                            point,
                            r,
                            inp.rows,
                            inp.bytes,
                            inp.rows_per_batch,
                            inp.batches,
                            secs,
                            commit_s,
                            os.getloadavg()[0],
                            time.monotonic() - t0,
                        )
                        runs.append(run)
                        commits = (
                            " commit " + "/".join(f"{c * 1000:.0f}" for c in commit_s) + " ms"
                            if commit_s
                            else ""
                        )
                        log(
                            f"[{n}/{total} {time.monotonic() - t_start:6.0f}s] {sink:<5} "
                            f"{point.label():<44} {'warm-up' if r < 0 else f'round {r}'} "
                            f"{variant:<13} {secs:7.2f} s {run.rows_s:>11,.0f} rows/s "
                            f"{run.mb_s:7.1f} MB/s{commits} (load {run.load1:.2f}, "
                            f"{run.wall:.1f} s in all)"
                        )
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    load_after = os.getloadavg()
    took = time.monotonic() - t_start
    summaries = summarise(runs)

    def load(xs: tuple[float, float, float]) -> str:
        return ", ".join(f"{x:.2f}" for x in xs)

    header = [
        f"- command: `{command}`",
        f"- date: {started.isoformat(timespec='seconds')}; took {took / 60:.1f} min",
        f"- cores: {os.cpu_count()} (`os.cpu_count()`), Spark `local[{cores}]`; "
        f"load average (1, 5, 15 min) before: {load(load_before)}, after: {load(load_after)}; "
        f"`PYSPARK_SUBMIT_ARGS={os.environ['PYSPARK_SUBMIT_ARGS']}`",
        f"- middle point: {middle.partitions} partitions, {middle.rows:,} rows per micro-batch, "
        f"{middle.width} B rows, {BATCHES} micro-batches; one axis at a time; at most "
        f"{cap / 1e6:,.0f} MB of input a run (wide rows: fewer rows per batch)",
        f"- each figure: the median of {repeat} round(s) (baseline(s), then the sink) after a "
        "warm-up round; sinks in a `lifecycle.Job` with `checkpoint_interval=0`; every run "
        "checked (all rows once, nothing open or staged)",
        "- partitions: Kafka's topic partitions; PostgreSQL's and Delta's Spark tasks a "
        "micro-batch (the stream repartitioned, baseline too)",
        f"- Kafka's broker: {'Apache Kafka' if args.broker == 'apache' else 'tansu, in memory'}",
        "- commit latency: per checkpoint that committed rows, the ledger's `committed_at - "
        "decided_at` (decision to every sink's commit acknowledged); p50 and max over the "
        "rounds' checkpoints",
        "- baseline: the faster of the variants named; sink / baseline is the throughput "
        "ratio (1.00 = as fast as the baseline)",
    ]
    table = markdown(summaries, axes, middle, header)
    print(table)
    (out / f"{stem}.md").write_text(table)
    doc: dict[str, Any] = {
        "command": command,
        "date": started.isoformat(timespec="seconds"),
        "seconds": took,
        "cpu_count": os.cpu_count(),
        "spark_cores": cores,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "middle": asdict(middle),
        "batches": BATCHES,
        "cap_bytes": cap,
        "repeat": repeat,
        "runs": [
            {**asdict(r), "point": asdict(r.point), "rows_s": r.rows_s, "mb_s": r.mb_s}
            for r in runs
        ],
        "summary": [
            {
                "sink": s.sink,
                "point": asdict(s.point),
                "rows_per_batch": s.rows_per_batch,
                "batches": s.batches,
                "rows": s.rows,
                "bytes": s.bytes,
                "median_seconds": s.seconds,
                "baseline": s.baseline,
                "ratio": s.ratio,
                "commit_ms_p50": s.commit_p50() if s.commit_ms else None,
                "commit_ms_max": max(s.commit_ms) if s.commit_ms else None,
            }
            for s in summaries
        ],
    }
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    title = _title(command, started, os.cpu_count(), load_before[0], load_after[0], repeat)
    plot(summaries, axes, middle, out / f"{stem}.png", title)
    log(f"wrote {out / stem}.md, .json, .png in {took / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
