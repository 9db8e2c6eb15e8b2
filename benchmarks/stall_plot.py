"""A run with a stall, as Prometheus saw it: the plot on the operating page.

A job streams Spark's rate source into PostgreSQL, scraped every second by a
real Prometheus evaluating the shipped rules (the stall threshold scaled to
2 intervals + 15 s and every ``for`` to 0, as in ``tests/test_prometheus.py``;
the sink's lock_timeout 40 s). After ``--before`` seconds an exclusive lock on
the sink's progress table holds every commit back for ``--stall`` seconds,
then the run goes on for ``--after`` seconds. The figure draws, from
Prometheus's HTTP API: the checkpoint duration (the mean of each second's
checkpoints) and the time since the last one; the age of the oldest prepared
transaction against its limit; and when each alert fired.

    python -m benchmarks.stall_plot [--out benchmarks/results/stall.png]

Needs the ``bench`` extra (matplotlib) and Debian's ``prometheus``. After the
run, every id the source produced is checked in the table once.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from benchmarks._common import bench_spark
from lifecycle.testing.plugin import fresh_database
from lifecycle.testing.postgres_server import PostgresServer
from tests.monitored import MonitoredJob, rules_scaled_down
from tests.pgcheck import assert_exactly_once, job_prepared

ALERTS = ("TwophaseCheckpointStalled", "TwophasePreparedWorkAging", "TwophasePreparedWorkNearLimit")


def _series(
    m: MonitoredJob, expr: str, start: float, end: float
) -> tuple[list[float], list[float]]:
    found = m.prometheus.query_range(expr, start, end, 1.0)
    if not found:
        return [], []
    values = found[0]["values"]
    return [float(t) - start for t, _ in values], [float(v) for _, v in values]


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--before", type=float, default=20.0, help="seconds before the stall")
    ap.add_argument("--stall", type=float, default=40.0, help="seconds the lock is held")
    ap.add_argument("--after", type=float, default=25.0, help="seconds after it")
    ap.add_argument("--out", default="benchmarks/results/stall.png", help="the PNG to write")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spark = bench_spark("stall-plot")
    with (
        PostgresServer() as pg,
        fresh_database(pg.dsn()) as dsn,
        tempfile.TemporaryDirectory() as tmp,
    ):
        work = Path(tmp)
        rules = rules_scaled_down(
            work / "rules.yml", threshold="2 * twophase_checkpoint_interval_seconds + 15", for_s=0
        )
        with MonitoredJob(spark, dsn, work, rules, lock_timeout=40.0) as m:
            start = time.time()
            time.sleep(args.before)
            stall_at = time.time() - start
            with m.stall():
                time.sleep(args.stall)
            released = time.time() - start
            time.sleep(args.after)
            end = time.time()
            job = f'job="{m.name}"'
            duration = _series(
                m,
                f"rate(twophase_checkpoint_duration_seconds_sum{{{job}}}[5s]) / "
                f"rate(twophase_checkpoint_duration_seconds_count{{{job}}}[5s])",
                start,
                end,
            )
            since = _series(m, f"twophase_seconds_since_last_checkpoint{{{job}}}", start, end)
            age = _series(m, f"twophase_prepared_oldest_age_seconds{{{job}}}", start, end)
            limit = _series(m, f"twophase_prepared_age_limit_seconds{{{job}}}", start, end)
            fired: dict[str, Any] = {
                a: _series(m, f'ALERTS{{alertname="{a}",alertstate="firing",{job}}}', start, end)
                for a in ALERTS
            }
        assert m.result is not None and m.result.committed
        with psycopg.connect(dsn) as c:
            row = c.execute("SELECT max(id) FROM ticks").fetchone()
        assert row is not None and row[0] is not None
        assert_exactly_once(dsn, "ticks", row[0] + 1)  # every id of the source, once
        assert job_prepared(dsn, m.name) == []
    spark.stop()

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for ax in (top, bottom):
        ax.axvspan(stall_at, released, color="0.92", label="progress table locked")
    top.plot(*since, color="tab:gray", label="seconds since the last checkpoint")
    top.plot(*duration, color="tab:blue", marker=".", label="checkpoint duration (mean per 5 s)")
    top.set_ylabel("seconds")
    top.legend(loc="upper left", fontsize=8)
    bottom.plot(*age, color="tab:red", label="oldest prepared transaction's age")
    if limit[1]:
        bottom.plot(*limit, color="tab:red", linestyle="--", label="its limit (lock_timeout)")
        half = (limit[0], [v / 2 for v in limit[1]])
        bottom.plot(*half, color="tab:orange", linestyle=":", label="half: the ageing alert")
    for i, (name, (ts, _)) in enumerate(fired.items()):
        if ts:
            bottom.plot(ts, [-2 - 2 * i] * len(ts), "|", markersize=6, label=f"{name} firing")
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("seconds into the run")
    bottom.legend(loc="upper left", fontsize=8)
    fig.suptitle("A checkpoint held back by a lock, as Prometheus scraped it")
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}; stall from {stall_at:.1f} s to {released:.1f} s")
    for name, (ts, _) in fired.items():
        span = f"{ts[0]:.0f} s to {ts[-1]:.0f} s" if ts else "never"
        print(f"  {name}: firing {span}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
