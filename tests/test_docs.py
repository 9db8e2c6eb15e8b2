"""The documentation's code runs, so it cannot rot.

* ``examples/quickstart.py`` (the README's example, included by the site's
  getting-started page) runs into this run's PostgreSQL, Kafka and a Delta
  table, and every order is in each sink once. The README
  carries the file verbatim.
* Every ``python`` block of the pages under ``docs/`` runs in one namespace
  per block, where the names the pages use for the user's things are real
  objects of this test: ``spark`` (the suite's session), ``dsn`` (a fresh
  database), ``servers`` (the Kafka broker), ``job`` (a job not yet run), ``df``
  and ``source`` (streaming DataFrames), and paths under ``/data``, ``/state``
  and the like point into a temporary directory. A block that needs what no
  test can give starts with ``# not run here: <why>``; it is compiled, and
  checked as the others are: every keyword it passes to the project's classes
  and functions exists in their signatures.
* Blocks included from files (``literalinclude``) are run where those files
  are run: ``examples/read_process_write.py`` by ``tests/test_kafka_source.py``,
  ``examples/user_project`` by ``tests/test_testing_kit.py``.

The site itself is built strictly by ``scripts/test.sh`` (``-W -n``): a broken
link or reference fails it.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import lifecycle
import sinks
from lifecycle import Job
from lifecycle.testing import (
    assert_exactly_once_delta,
    assert_exactly_once_kafka,
    assert_exactly_once_postgres,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
QUICKSTART = ROOT / "examples" / "quickstart.py"
NOT_RUN = "# not run here:"
_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        if "_build" in page.parts:
            continue
        text = page.read_text()
        for m in _BLOCK.finditer(text):
            line = text[: m.start()].count("\n") + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", textwrap.dedent(m.group(2))))
    return found


BLOCKS = _blocks()


def test_the_pages_have_python_blocks_to_run() -> None:
    assert len(BLOCKS) >= 8, [where for where, _ in BLOCKS]


def test_the_readme_carries_the_quickstart_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    assert QUICKSTART.read_text().rstrip() in readme, (
        "README.md's example differs from examples/quickstart.py: copy the file into it"
    )


def test_the_options_page_names_every_option() -> None:
    """docs/reference/options.md has a row for every parameter of ``Job``,
    ``add_pipeline`` and each sink (a new option once went undocumented there)."""
    from sinks import DeltaSink, KafkaSink, PostgresSink

    rows: dict[str, set[str]] = {}
    for line in (DOCS / "reference" / "options.md").read_text().splitlines():
        cells = line.strip().strip("|").split("|")
        if len(cells) < 4 or not cells[0].strip().startswith("`"):
            continue
        for where in re.findall(r"`([^`]+)`", cells[0]):
            rows.setdefault(where, set()).update(re.findall(r"`([^`]+)`", cells[1]))
    for where, function in [
        ("Job", Job.__init__),
        ("add_pipeline", Job.add_pipeline),
        ("PostgresSink", PostgresSink.__init__),
        ("KafkaSink", KafkaSink.__init__),
        ("DeltaSink", DeltaSink.__init__),
    ]:
        params = [p for p in inspect.signature(function).parameters if p != "self"]
        missing = [p for p in params if p not in rows.get(where, set())]
        assert not missing, f"docs/reference/options.md lacks {where}'s {missing}"


def test_quickstart_writes_every_order_once(
    spark: Any,
    pg_dsn: str,
    kafka_bootstrap: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The example's ``main`` in this process: its ``getOrCreate()`` finds the
    suite's session (a driver of its own would cost a JVM start)."""
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    n = 600
    for f in range(3):
        rows = range(f * n // 3, (f + 1) * n // 3)
        (incoming / f"orders-{f}.json").write_text(
            "".join(
                json.dumps({"order_id": i, "customer": f"c{i % 7}", "amount": i * 0.5}) + "\n"
                for i in rows
            )
        )
    monkeypatch.setenv("ORDERS_DSN", pg_dsn)
    monkeypatch.setenv("ORDERS_KAFKA", kafka_bootstrap)
    monkeypatch.setenv("ORDERS_DELTA", str(tmp_path / "delta"))
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    assert spec is not None and spec.loader is not None
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    assert quickstart.main(str(incoming), str(tmp_path / "state")) == 0
    assert "committed: True" in capsys.readouterr().out
    assert_exactly_once_postgres(pg_dsn, "orders", range(n), key="order_id")
    assert_exactly_once_kafka(kafka_bootstrap, "orders", range(n), key_of="order_id", job="orders")
    assert_exactly_once_delta(tmp_path / "delta", range(n), key="order_id")


# -- the pages' blocks -------------------------------------------------------------


def _public() -> dict[str, Callable[..., Any]]:
    names: dict[str, Callable[..., Any]] = {}
    for module in (lifecycle, sinks):
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj):
                names[name] = obj
    names["add_pipeline"] = Job.add_pipeline
    names["stop"] = Job.stop
    names["run"] = Job.run
    return names


def _check_keywords(source: str, where: str) -> None:
    """Every keyword a call of the project's API passes exists in its signature."""
    public = _public()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        target = public.get(name or "")
        if target is None:
            continue
        params = inspect.signature(target).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        for kw in node.keywords:
            assert kw.arg is None or kw.arg in params, (
                f"{where}: {name}() has no parameter {kw.arg!r}"
            )


@pytest.fixture
def page_namespace(
    spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[dict[str, Any], Callable[[str], str]]]:
    from sinks import DeltaSink, KafkaSink, PostgresSink

    (tmp_path / "data" / "events").mkdir(parents=True)
    (tmp_path / "data" / "incoming").mkdir(parents=True)
    monkeypatch.setenv("KAFKA_PASSWORD", "not-a-secret")
    df = spark.readStream.schema("id long, day string, op string, lsn long").json(
        str(tmp_path / "data" / "incoming")
    )
    job = Job(spark, "docs", tmp_path / "state" / "docs")
    namespace = {
        "spark": spark,
        "dsn": pg_dsn,
        "servers": kafka_bootstrap,
        "state_dir": str(tmp_path / "state" / "job"),
        "delta_dir": str(tmp_path / "data" / "delta"),
        "job": job,
        "df": df,
        "source": df,
        "same_source_df": df,
        "os": os,
        "Job": Job,
        "PostgresSink": PostgresSink,
        "KafkaSink": KafkaSink,
        "DeltaSink": DeltaSink,
    }
    ledger_uri = pg_dsn if pg_dsn.startswith("postgresql://") else None

    def localise(source: str) -> str:
        """The pages' example locations, pointed at this test's."""
        if ledger_uri is not None:
            source = source.replace("postgresql://twophase@db.example/jobs", ledger_uri)
        source = source.replace("hdfs://nn:8020/", f"file://{tmp_path}/hdfs/")
        for top in ("/data/", "/state/", "/checkpoints/", "/var/lib/"):
            source = source.replace(f'"{top}', f'"{tmp_path}{top}')
        return source

    yield namespace, localise


@pytest.mark.parametrize("where,source", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_a_python_block_of_the_pages_runs(
    where: str, source: str, page_namespace: tuple[dict[str, Any], Callable[[str], str]]
) -> None:
    _check_keywords(source, where)
    compile(source, where, "exec")
    if source.lstrip().startswith(NOT_RUN):
        reason = source.lstrip()[len(NOT_RUN) :].splitlines()[0].strip()
        assert reason, f"{where}: say why the block is not run"
        return
    namespace, localise = page_namespace
    exec(compile(localise(source), where, "exec"), dict(namespace))
