"""Testing the job exactly-once with the twophase test kit: the fixtures come from
the kit's pytest plugin (installed with ``twophase[testing]``), the job runs in
child processes that ``crash_test`` SIGKILLs and restarts, and the verifiers
read every sink back."""

from __future__ import annotations

import json
from pathlib import Path

from lifecycle.testing import (
    assert_exactly_once_delta,
    assert_exactly_once_kafka,
    assert_final_state_postgres,
    crash_test,
)

JOB = Path(__file__).resolve().parents[1] / "orders_job.py"


def write_orders(directory: Path, n: int, files: int) -> None:
    directory.mkdir(parents=True)
    per = n // files
    for f in range(files):
        rows = range(f * per, n if f == files - 1 else (f + 1) * per)
        text = "".join(
            json.dumps({"order_id": i, "customer": f"c{i % 7}", "amount": i * 0.5}) + "\n"
            for i in rows
        )
        (directory / f"orders-{f:03d}.json").write_text(text)


def test_orders_survive_kills_exactly_once(
    twophase_pg_dsn, twophase_kafka, twophase_kafka_topic, twophase_delta_table, tmp_path
):
    n = 3000
    write_orders(tmp_path / "in", n, files=12)
    topic = twophase_kafka_topic(3)
    env = {
        "ORDERS_INPUT": str(tmp_path / "in"),
        "ORDERS_STATE": str(tmp_path / "state"),
        "ORDERS_DSN": twophase_pg_dsn,
        "ORDERS_KAFKA": twophase_kafka,
        "ORDERS_TOPIC": topic,
        "ORDERS_DELTA": str(twophase_delta_table),
    }
    report = crash_test(JOB, kills=2, seed=7, env=env, min_delay=4, max_delay=10)
    print(report)
    expected = {i: {"customer": f"c{i % 7}", "amount": i * 0.5} for i in range(n)}
    assert_final_state_postgres(twophase_pg_dsn, "orders", expected, key="order_id", job="orders")
    assert_exactly_once_kafka(twophase_kafka, topic, range(n), key_of="order_id", job="orders")
    assert_exactly_once_delta(twophase_delta_table, range(n), key="order_id")
