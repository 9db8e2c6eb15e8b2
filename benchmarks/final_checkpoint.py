"""Time from end of input to exit: one shared final checkpoint against one
final checkpoint per pipeline, one after another.

A bounded job of three pipelines of very different sizes writes to PostgreSQL,
Kafka (tansu, started here) and Delta. With ``final_checkpoint="shared"``, one
checkpoint commits the remaining data of all three as soon as the last one has
finished its logic; with ``"per-pipeline"``, each pipeline's final data is
committed by a checkpoint of its own as it finishes, one after another. The
checkpoint interval is long (60 s), so all data is committed by the final
checkpoint(s). Reported: ``JobResult.end_of_input_to_exit`` (from the moment the
last pipeline had consumed its input to the end of the run) and the whole run,
median of the repeats, after a warm-up run.

    python benchmarks/final_checkpoint.py [--repeat R] [--scale S]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from kafka import KafkaAdminClient  # noqa: E402
from kafka.admin import NewTopic  # noqa: E402

from benchmarks._common import bench_spark  # noqa: E402
from lifecycle import Job  # noqa: E402
from sinks import DeltaSink, KafkaSink, PostgresSink  # noqa: E402


def write_input(directory: Path, files: int, rows: int) -> None:
    directory.mkdir(parents=True)
    n = 0
    for f in range(files):
        text = "".join(
            json.dumps({"id": n + i, "name": f"n{n + i}", "amount": (n + i) * 0.5}) + "\n"
            for i in range(rows)
        )
        (directory / f"part-{f:04d}.json").write_text(text)
        n += rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scale", type=int, default=1, help="multiplies the input sizes")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from lifecycle.testing.kafka_broker import KafkaBroker
    from lifecycle.testing.postgres_server import PostgresServer

    work = Path(tempfile.mkdtemp(prefix="twophase-final-"))
    sizes = {"small": (1, 100), "medium": (4, 2000), "large": (8, 10000)}
    for name, (files, rows) in sizes.items():
        write_input(work / name, files, rows * args.scale)
    pg, broker = PostgresServer(), KafkaBroker()
    pg.start()
    broker.start()
    try:
        spark = bench_spark("twophase-final-checkpoint")
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        results: dict[str, list[tuple[float, float, int]]] = {"shared": [], "per-pipeline": []}
        for r in range(-1, args.repeat):  # run -1 warms up and is not counted
            for mode in results:
                tag = f"{mode.replace('-', '_')}_{r + 1}"
                with psycopg.connect(pg.dsn(), autocommit=True) as c:
                    c.execute(f"CREATE TABLE small_{tag} (id bigint, name text, amount float8)")
                topic = f"medium-{uuid.uuid4().hex[:8]}"
                admin.create_topics([NewTopic(topic, 3, 1)])
                sinks = {
                    "small": PostgresSink(pg.dsn(), f"small_{tag}"),
                    "medium": KafkaSink(broker.bootstrap, topic, key="id"),
                    "large": DeltaSink(str(work / f"delta_{tag}")),
                }
                job = Job(
                    spark,
                    f"final_{tag}",
                    work / f"state_{tag}",
                    checkpoint_interval=60,
                    final_checkpoint=mode,
                )
                for name in sizes:
                    src = (
                        spark.readStream.schema("id long, name string, amount double")
                        .option("maxFilesPerTrigger", 2)
                        .json(str(work / name))
                    )
                    job.add_pipeline(name, src, [sinks[name]], bounded=True)
                t0 = time.perf_counter()
                result = job.run(handle_signals=False)
                total = time.perf_counter() - t0
                assert result.committed and result.end_of_input_to_exit is not None
                label = "warm-up" if r < 0 else f"run {r}"
                print(
                    f"{label:<8} {mode:<13} end of input -> exit "
                    f"{result.end_of_input_to_exit:6.3f} s   whole run {total:6.2f} s   "
                    f"checkpoints {result.checkpoints}",
                    flush=True,
                )
                if r >= 0:
                    results[mode].append((result.end_of_input_to_exit, total, result.checkpoints))
        admin.close()
        spark.stop()
        print()
        rows = {k: v[1] * args.scale * v[0] for k, v in sizes.items()}
        print(f"three pipelines (rows {rows}) to PostgreSQL, Kafka, Delta; median of {args.repeat}")
        print("| final checkpoint | end of input -> exit (s) | whole run (s) | checkpoints |")
        print("| --- | ---: | ---: | ---: |")
        for mode, vals in results.items():
            eoi = statistics.median(v[0] for v in vals)
            tot = statistics.median(v[1] for v in vals)
            print(f"| {mode} | {eoi:.3f} | {tot:.2f} | {vals[0][2]} |")
        return 0
    finally:
        broker.cleanup()
        pg.cleanup()


if __name__ == "__main__":
    sys.exit(main())
