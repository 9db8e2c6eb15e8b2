"""The test kit (``lifecycle.testing``) as a user gets it: the sample user project
under ``examples/user_project`` run by pytest in a process of its own (fixtures
from the ``pytest11`` plugin, its job SIGKILLed by ``crash_test``, its sinks
checked by the verifiers); the plugin loaded once and light; a missing broker a
skip, not an error; verifiers that fail when they should."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest
from deltalake import write_deltalake

from lifecycle.testing import (
    CrashTestError,
    assert_exactly_once_delta,
    assert_exactly_once_postgres,
    assert_final_state_delta,
    assert_final_state_postgres,
    crash_test,
)
from lifecycle.testing.verify import staged_delta
from tests.tiers import SLOW

ROOT = Path(__file__).resolve().parents[1]
USER_PROJECT = ROOT / "examples" / "user_project"


def _pytest(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@SLOW  # about a minute; the kit's parts are the default run's (this module)
def test_the_sample_user_project_passes_with_the_kit(
    pg_admin_dsn: str, kafka_bootstrap: str
) -> None:
    """The example of docs/testing.md: a user's job tested exactly-once with kills and restarts."""
    done = _pytest(
        USER_PROJECT,
        "-s",
        env={"TWOPHASE_PG_DSN": pg_admin_dsn, "TWOPHASE_KAFKA_BOOTSTRAP": kafka_bootstrap},
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout
    assert "SIGKILL" in done.stdout  # crash_test's report: the job was killed


def test_the_plugin_is_registered_once_and_imports_nothing_heavy(tmp_path: Path) -> None:
    traced = _pytest(tmp_path, "--trace-config", "--co")
    registered = [
        ln
        for ln in traced.stdout.splitlines()
        if "PLUGIN registered" in ln and "lifecycle.testing.plugin" in ln
    ]
    assert len(registered) == 1, traced.stdout[-3000:]
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, lifecycle.testing.plugin\n"
            "heavy = ('pyspark', 'psycopg', 'kafka', 'deltalake', 'pyarrow', 'testcontainers')\n"
            "print([m for m in heavy if m in sys.modules])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "[]", probe.stdout


@pytest.mark.parametrize(
    ("kind", "advice"),
    [("tansu", "twophase[testing]"), ("apache", "lifecycle.testing.jars fetch kafka-broker")],
)
def test_a_missing_broker_is_a_skip_not_an_error(tmp_path: Path, kind: str, advice: str) -> None:
    """Without the embedded broker (no ``testing`` extra), or without Apache
    Kafka's jars, only the tests that ask for it are skipped, saying what to
    install or fetch; the rest of a user's suite runs."""
    (tmp_path / "test_mine.py").write_text(
        textwrap.dedent(
            """
            def test_needs_kafka(twophase_kafka):
                pass

            def test_plain():
                assert True
            """
        )
    )
    env = {
        "TWOPHASE_TANSU": str(tmp_path / "no-such-tansu"),
        "TWOPHASE_JARS": str(tmp_path / "no-jars"),
        "TWOPHASE_TEST_KAFKA": kind,
    }
    unset = ("TWOPHASE_KAFKA_BOOTSTRAP", "TWOPHASE_REQUIRE_JARS")
    env_clean = {k: v for k, v in os.environ.items() if k not in unset}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env={**env_clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout and advice in done.stdout, done.stdout


def test_crash_test_runs_a_module_function_and_fails_a_job_that_does_not_finish(
    tmp_path: Path,
) -> None:
    (tmp_path / "tinyjob.py").write_text(
        textwrap.dedent(
            """
            import os, time
            from pathlib import Path

            def main():
                count = Path(os.environ["TINY_COUNT"])
                n = int(count.read_text()) if count.exists() else 0
                count.write_text(str(n + 1))
                time.sleep(float(os.environ.get("TINY_SLEEP", "0")))
                return int(os.environ.get("TINY_EXIT", "0"))
            """
        )
    )
    env = {"PYTHONPATH": str(tmp_path), "TINY_COUNT": str(tmp_path / "count"), "TINY_SLEEP": "5"}
    seen: list[int] = []
    report = crash_test(
        "tinyjob:main",
        kills=2,
        seed=3,
        env=env,
        fault_points=(),
        min_delay=0.5,
        max_delay=1.0,
        verify=lambda: seen.append(1),
    )
    assert report.kills == 2 and report.runs[-1].exit_code == 0 and seen == [1]
    assert (tmp_path / "count").read_text() == "3"
    with pytest.raises(CrashTestError, match="exited 1"):
        crash_test("tinyjob:main", kills=0, env={**env, "TINY_SLEEP": "0", "TINY_EXIT": "1"})


def test_the_verifiers_name_what_is_wrong(pg_dsn: str, tmp_path: Path) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE t (id bigint, v text)")
        c.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b'), (2, 'b'), (4, 'd')")
    with pytest.raises(AssertionError, match=r"more than once.*\(2, 2\)"):
        assert_exactly_once_postgres(pg_dsn, "t", [1, 2, 3])
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("DELETE FROM t WHERE id = 2")
    with pytest.raises(
        AssertionError, match=r"missing 1 \(e.g. \[3\]\), unexpected 1 \(e.g. \[4\]\)"
    ):
        assert_exactly_once_postgres(pg_dsn, "t", [1, 3])
    with pytest.raises(AssertionError, match="differ"):
        assert_final_state_postgres(pg_dsn, "t", {1: {"v": "a"}, 4: {"v": "x"}})
    assert_final_state_postgres(pg_dsn, "t", {1: {"v": "a"}, 4: {"v": "d"}})

    table = tmp_path / "delta"
    write_deltalake(str(table), pa.table({"id": [1, 2], "v": ["a", "b"]}))
    assert_exactly_once_delta(table, [1, 2])
    with pytest.raises(AssertionError, match="differ"):
        assert_final_state_delta(table, {1: {"v": "a"}, 2: {"v": "z"}})
    (table / "part-stray.parquet").write_bytes(b"not in any version")
    with pytest.raises(AssertionError, match="staged file"):
        assert_exactly_once_delta(table, [1, 2])


@pytest.mark.parametrize("store", ["s3", "hdfs"])
def test_the_delta_verifiers_read_a_table_in_s3_or_hdfs(
    store: str, request: pytest.FixtureRequest
) -> None:
    """The Delta verifiers on a table URI, through deltalake's store with the
    sink's ``storage_options``: they pass on a clean table and name what is
    left (a data file no version added, a staging marker)."""
    from sinks.delta.storage import TableStorage

    if store == "s3":
        server = request.getfixturevalue("twophase_s3")
        bucket = request.getfixturevalue("twophase_s3_bucket")
        uri, options = f"s3://{bucket}/t", server.storage_options()
    else:
        uri, options = f"{request.getfixturevalue('twophase_hdfs').uri}/kit/t", None
    write_deltalake(uri, pa.table({"id": [1, 2], "v": ["a", "b"]}), storage_options=options)
    assert_exactly_once_delta(uri, [1, 2], storage_options=options)
    assert_final_state_delta(uri, {1: {"v": "a"}, 2: {"v": "b"}}, storage_options=options)
    files = TableStorage(uri, options)
    for rel in ("part-stray.parquet", "_twophase/staged/tp2.j.p.s.i0123456789ab.r1.b0.p0.a1-0"):
        files.put(rel, b"x")
    left = staged_delta(uri, storage_options=options)
    assert left == [
        "part-stray.parquet",
        "_twophase/staged/tp2.j.p.s.i0123456789ab.r1.b0.p0.a1-0",
    ], left
    with pytest.raises(AssertionError, match="2 staged file"):
        assert_exactly_once_delta(uri, [1, 2], storage_options=options)
