"""The coordinator's and the ledger's own cost per batch, against how many
committables are pending (DESIGN.md, invariant 10).

A real :class:`~lifecycle.ledger.FileLedger` in a temporary directory, a real
:class:`~lifecycle.coordinator.Coordinator` and a real Spark commit log
(``commits/N`` files in a temporary checkpoint directory), with a sink whose
commit and abort do nothing: what is measured is the coordinator and the
ledger, not a sink. One pipeline holds ``N`` pending committables
(``--per-batch`` per batch); Spark has completed only the oldest pending batch.
Each round times ``coordinator.register`` of one more batch, then
``coordinator.checkpoint()``, which commits that oldest batch alone while the
rest stay pending; then Spark completes the next one. Reported: the median of
the rounds (after warm-up rounds) and its ratio to the smallest size. The mean
is shown too: it includes the ledger's compactions, which the median leaves out.

``--old`` also measures the ledger and coordinator of commit e43e90d (one JSON
document rewritten at every change), loaded from git. Its ledger is filled by
writing its document directly: filling it batch by batch would take hours at
100,000 committables.

    python benchmarks/ledger_cost.py [--sizes 100,1000,10000,100000] [--per-batch 100]
                                     [--repeat R] [--old [--old-repeat R]]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from lifecycle.coordinator import Coordinator  # noqa: E402
from lifecycle.job_sinks import PipelineSinks  # noqa: E402
from lifecycle.ledger import FileLedger  # noqa: E402
from lifecycle.spark_log import SparkCommitLog  # noqa: E402
from sinks.base import Committable, JobScope, OrphanTest  # noqa: E402
from sinks.naming import TxnName  # noqa: E402
from tests.memory_sink import MemorySink  # noqa: E402

OLD_REV = "e43e90d"
JOB = "bench"


class NoopSink(MemorySink):
    """A sink whose driver side does nothing: commit and abort return at once
    (its own committer, so the old coordinator, which called the sink, runs it too)."""

    kind = "noop"

    def abort_lingering(self, scope: JobScope, is_orphan: OrphanTest) -> list[str]:
        """The old coordinator's name for :meth:`sweep`."""
        return self.sweep(scope, is_orphan)


def committables(batch: int, n: int) -> dict[str, list[Committable]]:
    """What a batch of ``n`` tasks registers (names as the sinks make them)."""
    return {
        "s": [
            {"txn": str(TxnName(JOB, "p", "s", 1, batch, i, batch * n + i)), "rows": 1000}
            for i in range(n)
        ]
    }


def load_old(name: str) -> ModuleType:
    """``lifecycle/<name>.py`` of commit OLD_REV as a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{OLD_REV}:lifecycle/{name}.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="old-ledger-")) / f"old_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"old_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Result:
    register: list[float]
    checkpoint: list[float]
    compactions: int | None  # during the rounds (None: the old ledger has none)


def complete_upto(commits: Path, batch: int) -> None:
    """Spark has completed ``batch`` (it keeps the last 100 entries)."""
    (commits / str(batch)).write_text("v1\n{}")
    stale = commits / str(batch - 100)
    if stale.exists():
        stale.unlink()


def measure(old: dict[str, ModuleType] | None, pending: int, per_batch: int, rounds: int) -> Result:
    batches = max(1, pending // per_batch)
    with tempfile.TemporaryDirectory(prefix="ledger-cost-") as tmp:
        spark = Path(tmp) / "spark"
        (spark / "commits").mkdir(parents=True)
        (spark / "metadata").write_text("{}")
        if old is None:
            ledger: Any = FileLedger(Path(tmp) / "ledger", JOB)
            ledger.begin_run()
            coordinator: Any = Coordinator(
                JOB, ledger, [PipelineSinks("p", {"s": NoopSink()}, SparkCommitLog(spark))]
            )
            for b in range(batches):
                coordinator.register("p", b, committables(b, per_batch))
        else:
            doc = {
                "format": 1,
                "job": JOB,
                "run": 1,
                "next_checkpoint": 1,
                "pending": {"p": {str(b): committables(b, per_batch) for b in range(batches)}},
                "decided": None,
                "history": [],
                "finished": [],
                "totals": {},
            }
            (Path(tmp) / "ledger").mkdir()
            (Path(tmp) / "ledger" / "ledger.json").write_text(json.dumps(doc))
            ledger = old["ledger"].FileLedger(Path(tmp) / "ledger", JOB)
            coordinator = old["coordinator"].Coordinator(
                JOB, ledger, [PipelineSinks("p", {"s": NoopSink()}, SparkCommitLog(spark))]
            )
        oldest = 0
        complete_upto(spark / "commits", oldest)
        generation = getattr(ledger, "generation", None)
        result = Result([], [], None)
        for _ in range(rounds):
            new = oldest + batches
            cs = committables(new, per_batch)
            t0 = time.perf_counter()
            coordinator.register("p", new, cs)
            t1 = time.perf_counter()
            cp = coordinator.checkpoint()
            t2 = time.perf_counter()
            assert cp is not None and cp.cut == {"p": oldest}, cp
            result.register.append(t1 - t0)
            result.checkpoint.append(t2 - t1)
            oldest += 1
            complete_upto(spark / "commits", oldest)
        assert len(ledger.pending()["p"]) == batches
        if generation is not None:
            result.compactions = ledger.generation - generation
        ledger.close()
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--sizes", default="100,1000,10000,100000", help="pending committables")
    ap.add_argument("--per-batch", type=int, default=100, help="committables per batch (100)")
    ap.add_argument("--repeat", type=int, default=1000, help="measured rounds per size (1000)")
    ap.add_argument("--warmup", type=int, default=5, help="rounds not measured (5)")
    ap.add_argument("--old", action="store_true", help=f"also measure the ledger of {OLD_REV}")
    ap.add_argument("--old-repeat", type=int, default=5, help="measured rounds, old ledger (5)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    impls: dict[str, tuple[dict[str, ModuleType] | None, int]] = {"new": (None, args.repeat)}
    if args.old:
        impls = {
            f"old ({OLD_REV})": (
                {"ledger": load_old("ledger"), "coordinator": load_old("coordinator")},
                args.old_repeat,
            ),
            **impls,
        }
    print(
        "The sink's commit and abort do nothing: these are the coordinator's and the "
        "ledger's own costs (fsyncs included), one pipeline, "
        f"{args.per_batch} committables per batch, Spark completed only the oldest batch."
    )
    print()
    print(
        "| ledger | pending committables | register median ms (mean) | x | "
        "checkpoint median ms (mean) | x | rounds (compactions) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, (old, repeat) in impls.items():
        base: tuple[float, float] | None = None
        for n in sizes:
            r = measure(old, n, args.per_batch, args.warmup + repeat)
            reg = r.register[args.warmup :]
            cpt = r.checkpoint[args.warmup :]
            med = (statistics.median(reg) * 1e3, statistics.median(cpt) * 1e3)
            base = base or med
            print(
                f"| {label} | {n:,} | {med[0]:.2f} ({statistics.mean(reg) * 1e3:.2f}) | "
                f"{med[0] / base[0]:.2f} | {med[1]:.2f} ({statistics.mean(cpt) * 1e3:.2f}) | "
                f"{med[1] / base[1]:.2f} | {repeat}"
                f"{'' if r.compactions is None else f' ({r.compactions})'} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
