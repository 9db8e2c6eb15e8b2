"""The Kafka sink's transactions, measured against transaction_timeout_ms.

tansu never expires a transaction, so what can be tested is what the sink
sees and says: the age each committable carries (``opened_at``, written by a
real writer on the broker), the early checkpoint and warning when a batch's
transactions may reach half the timeout by their commit, the warning at a late
commit, and the pre-commit order that puts Kafka last.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

from lifecycle.binding import precommit_order
from sinks import DeltaSink, KafkaSink, PostgresSink
from sinks.kafka import txn_age
from tests.test_kafka_unit import SCHEMA, ctx, job_name, rows, write_task

TIMEOUT_MS = 900_000


def _sink(interval: float = 60.0) -> KafkaSink:
    sink = KafkaSink("127.0.0.1:9", "t", transaction_timeout_ms=TIMEOUT_MS, commit_timeout=300)
    sink.check_checkpoint_interval(interval)
    return sink


def _batch(*ages: float) -> list[dict[str, object]]:
    now = time.time()
    return [{"transactional_id": f"x{i}", "opened_at": now - a} for i, a in enumerate(ages)]


def test_young_transactions_ask_for_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sinks.kafka")
    assert _sink().checkpoint_pressure(_batch(5, 30)) is None
    assert _sink().checkpoint_pressure([{"transactional_id": "old-version"}]) is None
    assert not caplog.records


def test_a_long_batch_asks_for_a_checkpoint_now(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sinks.kafka")
    # 100 s open + 60 s interval + 300 s commit_timeout = 460 s >= 450 s, half the timeout
    reason = _sink().checkpoint_pressure(_batch(3, 100))
    assert reason is not None and "open 100s" in reason and "460s old" in reason
    assert "transaction_timeout_ms=900000" in reason
    said = caplog.records[-1].getMessage()
    assert "Checkpointing now" in said and "transaction.max.timeout.ms" in said
    # the same age with a longer interval is further from safe, a shorter one closer
    assert _sink(interval=0).checkpoint_pressure(_batch(100)) is None


def test_a_late_commit_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sinks.kafka")
    txn_age.check_at_commit("sink", _batch(10), timeout_ms=TIMEOUT_MS)
    assert not caplog.records
    txn_age.check_at_commit("sink", _batch(10, 750), timeout_ms=TIMEOUT_MS)
    said = caplog.records[-1].getMessage()
    assert "open for 750s, 83% of transaction_timeout_ms=900000" in said


def test_kafka_precommits_after_the_other_sinks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    k1 = KafkaSink("127.0.0.1:9", "a")
    k2 = KafkaSink("127.0.0.1:9", "b")
    pg = PostgresSink("host=127.0.0.1 dbname=x", "t")
    delta = DeltaSink(str(tmp_path / "d"))
    assert precommit_order([k1, pg, k2, delta]) == [pg, delta, k1, k2]
    assert precommit_order([pg, delta]) == [pg, delta]


def test_a_prepared_transaction_says_when_it_opened(
    kafka_bootstrap: str, kafka_topic: Callable[[int], str]
) -> None:
    sink = KafkaSink(kafka_bootstrap, kafka_topic(1))
    try:
        sink.preflight(SCHEMA)
        before = time.time()
        c = write_task(sink, ctx(job_name(), 0), [rows(0, 3)])
        assert c is not None and before - 0.01 <= c["opened_at"] <= time.time()
        sink.committer().abort([c])
    finally:
        sink.close()
