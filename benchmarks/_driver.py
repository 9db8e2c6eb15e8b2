"""A job's driver without Spark, for the benchmarks of commits and recovery.

Real services (a PostgreSQL server of its own, with room for many prepared
transactions; a tansu broker; a Delta table on local disk), the three real
sinks, a real file ledger and a real :class:`~lifecycle.coordinator.Coordinator`.
What Spark's executors do is done here by :meth:`Driver.prepare_batch`: it
opens a writer per task and sink, writes, prepares, on a few threads, exactly
as a task would; :meth:`Driver.spark_completed` writes Spark's ``commits/N``.
The figures are then the driver's own: what a checkpoint or a recovery costs,
without Spark's planning and scheduling around it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from lifecycle.coordinator import Coordinator
from lifecycle.job_sinks import PipelineSinks
from lifecycle.ledger import FileLedger
from lifecycle.spark_log import SparkCommitLog
from sinks import DeltaSink, KafkaSink, PostgresSink, capabilities
from sinks.base import Committable, JobScope, Sink, WriteContext

JOB = "bench"
PIPELINE = "p"
SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64())])


@dataclass
class Services:
    dsn: str
    bootstrap: str
    root: Path


@contextlib.contextmanager
def services(max_prepared: int = 2000, kafka: str | None = None) -> Iterator[Services]:
    """PostgreSQL (``max_prepared_transactions`` = ``max_prepared``) and a Kafka
    broker (``kafka``: ``apache``, the broker users run, when its jars are
    fetched, else ``tansu``), started here and stopped afterwards, and a
    temporary directory."""
    from lifecycle.testing import jars
    from lifecycle.testing.apache_kafka import ApacheKafka
    from lifecycle.testing.kafka_broker import KafkaBroker
    from lifecycle.testing.postgres_server import PostgresServer

    pg = PostgresServer(
        settings={
            "max_prepared_transactions": str(max_prepared),
            "max_connections": "300",
            "fsync": "on",
            "synchronous_commit": "on",
        }
    )
    kafka = kafka or ("apache" if jars.available("kafka-broker") else "tansu")
    broker = ApacheKafka() if kafka == "apache" else KafkaBroker()
    print(f"Kafka: {kafka}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-driver-") as tmp:
        try:
            pg.start()
            broker.start()
            yield Services(pg.dsn(), broker.bootstrap, Path(tmp))
        finally:
            broker.cleanup()
            pg.cleanup()


def make_sinks(
    s: Services, name: str, partitions: int = 4, options: dict[str, dict[str, Any]] | None = None
) -> dict[str, Sink]:
    """The three sinks, writing table/topic ``name``, preflighted; ``options``:
    more constructor arguments per sink id (``pg``, ``kafka``, ``delta``)."""
    more = options or {}
    sinks: dict[str, Sink] = {
        "pg": PostgresSink(s.dsn, name, create_table=True, sink_id="pg", **more.get("pg", {})),
        "kafka": KafkaSink(
            s.bootstrap,
            name,
            key="id",
            create_topic=True,
            partitions=partitions,
            sink_id="kafka",
            **more.get("kafka", {}),
        ),
        "delta": DeltaSink(s.root / name, sink_id="delta"),
    }
    for sink in sinks.values():
        sink.preflight(SCHEMA)
    return sinks


def executors(n: int = 2) -> ProcessPoolExecutor:
    """Processes that do the executors' part (the machine's 2 cores)."""
    return ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))


def _task(job: tuple[bytes, JobScope, int, int, int, int, int, int | None]) -> Committable:
    """One Spark task: open the sink's writer, write ``rows`` rows, prepare
    (``lease``: what the driver's committer leased the batch)."""
    shipped, scope, run, batch, part, tasks, rows, lease = job
    sink: Sink = pickle.loads(shipped)
    ctx = WriteContext(scope, run, batch, part, batch * tasks + part, 0, lease)
    first = (batch * tasks + part) * rows
    ids = range(first, first + rows)
    data = pa.RecordBatch.from_pydict(
        {"id": list(ids), "name": [f"n{i}" for i in ids], "amount": [i * 0.5 for i in ids]},
        schema=SCHEMA,
    )
    writer = sink.open_writer(ctx, SCHEMA)
    try:
        writer.write(data)
        c = writer.prepare()
    finally:
        writer.close()
    assert c is not None
    return c


class Driver:
    """One incarnation of the job's driver: a ledger, its coordinator, the sinks.

    ``sinks`` are pipeline :data:`PIPELINE`'s; ``others``: more pipelines of
    the same job, by name, each with sinks of its own (its own tables and
    topics) and its own Spark commit log."""

    def __init__(
        self,
        s: Services,
        name: str,
        sinks: dict[str, Sink],
        others: Mapping[str, dict[str, Sink]] | None = None,
    ) -> None:
        self.sinks = sinks
        self.pipelines: dict[str, dict[str, Sink]] = {PIPELINE: sinks, **(others or {})}
        # as Spark ships them to executors, taken before anything wraps a method
        self._shipped = {
            (p, sid): pickle.dumps(sink)
            for p, of in self.pipelines.items()
            for sid, sink in of.items()
        }
        self.spark = s.root / f"{name}-spark"
        self._spark = {
            p: self.spark if p == PIPELINE else s.root / f"{name}-spark-{p}" for p in self.pipelines
        }
        for where in self._spark.values():
            (where / "commits").mkdir(parents=True, exist_ok=True)
            (where / "metadata").write_text("{}")
        self.ledger = FileLedger(s.root / f"{name}-ledger", JOB)
        self.run = self.ledger.begin_run()
        self.coordinator = Coordinator(
            JOB,
            self.ledger,
            [
                PipelineSinks(p, of, SparkCommitLog(self._spark[p]))
                for p, of in self.pipelines.items()
            ],
        )
        self.coordinator.claim_sinks()

    def scope(self, sink_id: str, pipeline: str = PIPELINE) -> JobScope:
        return JobScope(JOB, pipeline, sink_id, self.ledger.incarnation)

    def prepare_batch(
        self, batch: int, tasks: int, rows: int, pool: ProcessPoolExecutor
    ) -> dict[str, list[Committable]]:
        """What ``tasks`` Spark tasks of ``batch`` prepare in every sink,
        ``rows`` rows each: the executors' part, done in the processes of
        ``pool`` (see :func:`executors`) as Spark's Python workers would."""
        return self.prepare_batches(batch, tasks, rows, pool, [PIPELINE])[PIPELINE]

    def prepare_batches(
        self,
        batch: int,
        tasks: int,
        rows: int,
        pool: ProcessPoolExecutor,
        pipelines: Sequence[str] | None = None,
    ) -> dict[str, dict[str, list[Committable]]]:
        """:meth:`prepare_batch` for ``batch`` of each of ``pipelines`` (all
        of them by default) at once, per pipeline and sink."""
        names = list(self.pipelines) if pipelines is None else list(pipelines)
        leases = {
            (p, sid): capabilities.lease(s.committer(), self.scope(sid, p), batch)
            for p in names
            for sid, s in self.pipelines[p].items()
        }
        jobs = [
            (
                self._shipped[key],
                self.scope(key[1], key[0]),
                self.run,
                batch,
                part,
                tasks,
                rows,
                lease,
            )
            for key, lease in leases.items()
            for part in range(tasks)
        ]
        done = list(pool.map(_task, jobs, chunksize=8))
        out: dict[str, dict[str, list[Committable]]] = {
            p: {sid: [] for sid in self.pipelines[p]} for p in names
        }
        for job, c in zip(jobs, done, strict=True):
            out[job[1].pipeline][job[1].sink_id].append(c)
        return out

    def spark_completed(self, batch: int, pipeline: str = PIPELINE) -> None:
        """Spark wrote ``commits/<batch>`` of ``pipeline``."""
        (self._spark[pipeline] / "commits" / str(batch)).write_text("v1\n{}")

    def close(self) -> None:
        self.ledger.close()
        for of in self.pipelines.values():
            for sink in of.values():
                sink.close()


def timed(sink: Sink, method: str) -> list[float]:
    """Seconds of each call of ``<method>`` of ``sink``'s committer from now on
    (the instance's method wrapped, to show where the driver's time goes; the
    committer is the same object every call)."""
    took: list[float] = []
    committer = sink.committer()
    call = getattr(committer, method)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            took.append(time.perf_counter() - t0)

    setattr(committer, method, wrapper)
    return took


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"
