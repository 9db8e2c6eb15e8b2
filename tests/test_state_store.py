"""The state store (``lifecycle/state/store.py``, ``hadoop_store.py``) on real
storage: a local directory (:class:`LocalStore`), and Hadoop's LocalFileSystem
through the driver JVM of a real SparkSession, addressed as ``file://`` and as
``viewfs://`` mounted onto a second directory (standing in for shared storage).

Every store gets the same contract tests; the files are checked on disk, under
the directory the URI names. The crash states of a Hadoop replace (a partial
``NAME.part``, a complete ``NAME.tmp`` after ``NAME`` was deleted) are made on
disk, as a killed writer leaves them, and read back through the store.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from lifecycle import Job
from lifecycle.spark_log import SparkCommitLog
from lifecycle.state.hadoop_store import HadoopStore
from lifecycle.state.store import LocalStore, open_store
from lifecycle.state.store_interface import StateStore
from sinks.errors import ConfigError
from tests.conftest import write_input
from tests.sparkutil import INPUT_SCHEMA


def mount_viewfs(spark: SparkSession, target: Path) -> str:
    """A fresh viewfs mount table whose ``/state`` is ``target`` (in the
    session's Hadoop configuration); returns ``viewfs://<table>/state``."""
    table = f"t{uuid.uuid4().hex[:10]}"  # a new authority: no cached FileSystem
    conf = spark.sparkContext._jsc.hadoopConfiguration()  # type: ignore[attr-defined]
    conf.set(f"fs.viewfs.mounttable.{table}.link./state", target.resolve().as_uri())
    return f"viewfs://{table}/state"


@dataclass
class Case:
    store: StateStore
    disk: Path
    """the local directory the store's root is, as the OS sees it"""


@pytest.fixture(params=["local", "file", "viewfs"])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Case]:
    disk = tmp_path / "shared" / "job"
    disk.mkdir(parents=True)
    if request.param == "local":
        yield Case(open_store(str(disk), None), disk)
        return
    spark = request.getfixturevalue("spark")
    if request.param == "file":
        uri = disk.resolve().as_uri()
    else:
        uri = mount_viewfs(spark, tmp_path / "shared") + "/job"
    store = open_store(uri, spark)
    assert isinstance(store, HadoopStore) and store.uri() == uri
    yield Case(store, disk)


def on_disk(d: Path) -> list[str]:
    """Every file under ``d`` (relative), without Hadoop's checksum files."""
    return sorted(
        str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and not p.name.endswith(".crc")
    )


def test_write_read_list_exists(case: Case) -> None:
    s = case.store
    data = b'{"a": 1}\n\x00\xff binary too'
    s.write_atomic("pipelines/p/ending_input.json", data)
    s.write_atomic("pipelines/p/spark/commits/0", b"v1")
    s.write_atomic("pipelines/q/x", b"")
    assert s.read("pipelines/p/ending_input.json") == data
    assert s.read("pipelines/q/x") == b""
    assert s.exists("pipelines/p/ending_input.json") and s.exists("pipelines/p")
    assert s.list("pipelines") == ["p", "q"]
    assert s.list("pipelines/p") == ["ending_input.json", "spark"]
    assert s.list("") == ["pipelines"]
    # written where the URI says, nothing else, no temporary file left
    assert on_disk(case.disk) == [
        "pipelines/p/ending_input.json",
        "pipelines/p/spark/commits/0",
        "pipelines/q/x",
    ]
    assert (case.disk / "pipelines/p/ending_input.json").read_bytes() == data


def test_replace(case: Case) -> None:
    s = case.store
    for i in range(3):
        s.write_atomic("control/stop.json", json.dumps({"n": i}).encode())
        assert json.loads(s.read("control/stop.json") or b"") == {"n": i}
    assert on_disk(case.disk) == ["control/stop.json"]
    assert s.list("control") == ["stop.json"]


def test_missing(case: Case) -> None:
    s = case.store
    assert s.read("control/stop.json") is None
    assert s.read("nowhere/at/all") is None
    assert not s.exists("control/stop.json") and not s.exists("control")
    assert s.list("control") == [] and s.list("a/b") == []
    s.delete("control/stop.json")  # nothing there: no error
    s.delete("a/b")


def test_delete(case: Case) -> None:
    s = case.store
    s.write_atomic("control/stop.json", b"{}")
    s.write_atomic("pipelines/p/spark/commits/0", b"v1")
    s.write_atomic("pipelines/p/spark/offsets/0", b"v1")
    s.delete("control/stop.json")
    assert s.read("control/stop.json") is None and not s.exists("control/stop.json")
    assert s.list("control") == []
    s.delete("pipelines/p/spark")  # a tree
    assert not s.exists("pipelines/p/spark") and s.list("pipelines/p") == []
    assert on_disk(case.disk) == []


def test_uri_and_names(case: Case) -> None:
    s = case.store
    assert s.uri("pipelines/p/spark").endswith("/job/pipelines/p/spark")
    for bad in ("/abs", "a/../b", "a//b", "./a"):
        with pytest.raises(ValueError, match="not a relative name"):
            s.read(bad)


def test_a_crash_during_a_first_write_leaves_no_file(case: Case) -> None:
    """A writer killed while writing its temporary file: the file does not exist."""
    (case.disk / "control").mkdir()
    suffix = ".part" if isinstance(case.store, HadoopStore) else ".tmp"
    (case.disk / "control" / f"stop.json{suffix}").write_bytes(b'{"dra')
    assert case.store.read("control/stop.json") is None
    assert not case.store.exists("control/stop.json")
    assert case.store.list("control") == []
    case.store.write_atomic("control/stop.json", b"{}")  # the next write goes through
    assert case.store.read("control/stop.json") == b"{}"


def test_a_crash_during_a_replace_leaves_the_old_content(case: Case) -> None:
    case.store.write_atomic("f.json", b"old")
    suffix = ".part" if isinstance(case.store, HadoopStore) else ".tmp"
    (case.disk / f"f.json{suffix}").write_bytes(b"ne")  # killed mid-write
    assert case.store.read("f.json") == b"old"
    case.store.write_atomic("f.json", b"new")
    assert case.store.read("f.json") == b"new"
    assert on_disk(case.disk) == ["f.json"]


@pytest.mark.parametrize("scheme", ["file", "viewfs"])
def test_hadoop_replace_killed_between_delete_and_rename(  # type: ignore[no-untyped-def]
    spark, tmp_path: Path, scheme: str
) -> None:
    """Hadoop's rename does not overwrite, so a replace deletes NAME, then renames
    the complete NAME.tmp onto it: a crash in between leaves only NAME.tmp,
    which the store reads (new content), and the next write or delete tidies."""
    disk = tmp_path / "shared"
    disk.mkdir()
    uri = disk.as_uri() if scheme == "file" else mount_viewfs(spark, disk)
    s = open_store(uri, spark)
    s.write_atomic("pipelines/p/ending_input.json", b"old")
    # the state the crash leaves: NAME deleted, NAME.tmp complete (with the
    # checksum file Hadoop's LocalFileSystem keeps beside it)
    d = disk / "pipelines/p"
    (d / "ending_input.json").rename(d / "ending_input.json.tmp")
    (d / ".ending_input.json.crc").rename(d / ".ending_input.json.tmp.crc")
    assert s.read("pipelines/p/ending_input.json") == b"old"
    assert s.exists("pipelines/p/ending_input.json")
    s.write_atomic("pipelines/p/ending_input.json", b"newer")
    assert s.read("pipelines/p/ending_input.json") == b"newer"
    assert on_disk(disk) == ["pipelines/p/ending_input.json"]
    # NAME and a stale NAME.tmp (killed before the delete): NAME wins
    (disk / "pipelines/p/ending_input.json.tmp").write_bytes(b"stale")
    assert s.read("pipelines/p/ending_input.json") == b"newer"
    s.delete("pipelines/p/ending_input.json")
    assert s.read("pipelines/p/ending_input.json") is None
    assert on_disk(disk) == []


def test_hadoop_rename_does_not_overwrite_here(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Why the replace takes the delete-then-rename steps: the FileSystem behind
    file:// refuses to rename onto an existing file (HDFS does the same)."""
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    src = jvm.org.apache.hadoop.fs.Path((tmp_path / "a").as_uri())
    dst = jvm.org.apache.hadoop.fs.Path((tmp_path / "b").as_uri())
    assert src.getFileSystem(conf).rename(src, dst) is False
    assert (tmp_path / "b").read_text() == "b"


def test_viewfs_names_the_mounted_directory(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A file written through viewfs:// is the file of the mount's target, as
    file:// and the OS see it."""
    disk = tmp_path / "shared"
    disk.mkdir()
    view = open_store(mount_viewfs(spark, disk) + "/job", spark)
    direct = open_store((disk / "job").as_uri(), spark)
    view.write_atomic("control/stop.json", b'{"drain": true}')
    assert direct.read("control/stop.json") == b'{"drain": true}'
    assert LocalStore(disk / "job").read("control/stop.json") == b'{"drain": true}'
    direct.delete("control/stop.json")
    assert view.read("control/stop.json") is None


def test_spark_commit_log_through_hadoop(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A real streaming query with its checkpoint on viewfs://: the commit log
    read through the Hadoop store says what the files on disk say."""
    write_input(tmp_path / "in", files=3, rows_per_file=5)
    disk = tmp_path / "shared"
    disk.mkdir()
    store = open_store(mount_viewfs(spark, disk) + "/job", spark)
    q = (
        spark.readStream.schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(tmp_path / "in"))
        .writeStream.format("noop")
        .option("checkpointLocation", store.uri("pipelines/p/spark"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination(120)
    assert q.exception() is None
    via_hadoop = SparkCommitLog(store, "pipelines/p/spark")
    via_os = SparkCommitLog(disk / "job" / "pipelines" / "p" / "spark")
    assert via_hadoop.exists() and via_os.exists()
    assert via_hadoop.latest() == via_os.latest() == 2
    for b in range(3):
        assert via_hadoop.offsets_digest(b) == via_os.offsets_digest(b) is not None
    assert via_hadoop.offsets_digest(3) is None
    assert not SparkCommitLog(store, "pipelines/other/spark").exists()
    assert SparkCommitLog(store, "pipelines/other/spark").latest() == -1


def test_open_store_by_form(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(open_store(str(tmp_path), spark), LocalStore)
    assert isinstance(open_store(tmp_path, spark), LocalStore)
    assert isinstance(open_store("relative/dir", spark), LocalStore)
    assert isinstance(open_store(tmp_path.as_uri(), spark), HadoopStore)
    with pytest.raises(ConfigError, match="pass the URI as a str"):
        open_store(Path("viewfs://t/state"), spark)


def test_a_scheme_without_a_client_is_refused(spark) -> None:  # type: ignore[no-untyped-def]
    """PySpark's bundled Hadoop client has no S3A or ABFS classes: the state
    store says which jars are missing instead of failing later."""
    with pytest.raises(ConfigError, match="hadoop-aws") as e:
        open_store("s3a://bucket/state", spark)
    assert "s3a" in str(e.value)
    with pytest.raises(ConfigError, match="hadoop-azure"):
        open_store("abfss://c@account.dfs.core.windows.net/state", spark)


def test_a_job_on_a_uri_keeps_its_ledger_there_or_where_it_is_told(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    uri = mount_viewfs(spark, tmp_path) + "/job"
    assert Job(spark, "j", uri).ledger_dir is None  # the store ledger, in the URI
    with pytest.raises(ConfigError, match=r"ledger= is a hdfs: URI: .*a local directory"):
        Job(spark, "j", uri, ledger="hdfs://nn/ledger")  # the ledger is never on a URI
    pg = Job(spark, "j", uri, ledger="postgresql://db/x")  # opened (and checked) by run()
    assert pg.ledger_dir is None and pg.ledger_location == "postgresql://db/x"
    job = Job(spark, "j", uri, ledger=tmp_path / "ledger-host")
    assert job.ledger_dir == tmp_path / "ledger-host" / "ledger"
    assert Job(spark, "j", tmp_path / "s").ledger_dir == tmp_path / "s" / "ledger"
