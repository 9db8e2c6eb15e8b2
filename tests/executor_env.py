"""The executors' Python environment for the cluster tests, built the way the
docs/deploying.md tells users to build theirs.

A new virtual environment (``python -m venv --copies``: Spark refuses to
unpack an archive whose symlinks point outside it) gets the project from a
wheel built from a copy of the sources (not an editable install, which would
point back at this checkout) and its dependencies except pyspark (executors
take PySpark from the Spark installation, here the pip package's
``python/lib/pyspark.zip``); it is packed as a tar whose entries have no
leading ``./`` (Spark refuses those too). Jobs pass it with
``spark.archives=<tar>#environment`` and run executors' Python as
``./environment/bin/python``. The archive is a ``.tar.gz``: Spark unpacks a
plain ``.tar`` with Java code that drops the executable bits.

The archive is cached under ``.venv/.cache/`` keyed by the sources, the
dependencies and the interpreter, so a second test session reuses it.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "sinks", "lifecycle")


def _runtime_requirements(extras: Sequence[str] = ()) -> list[str]:
    """The project's dependencies with those of ``extras``, without pyspark."""
    out = []
    for spec in requires("twophase") or []:
        req = Requirement(spec)
        if req.marker is not None and "extra" in str(req.marker):
            if not any(req.marker.evaluate({"extra": e}) for e in extras):
                continue
            spec = f"{req.name}{req.specifier}"
        if req.name.lower() == "pyspark":
            continue
        out.append(spec)
    return out


def _key(extras: Sequence[str]) -> str:
    h = hashlib.sha256()
    h.update(sys.version.encode())
    h.update("\n".join(sorted(_runtime_requirements(extras))).encode())
    for name in SOURCES:
        path = ROOT / name
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _run(*argv: str | Path) -> None:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed:\n{proc.stdout}\n{proc.stderr}")


def executor_archive(cache: Path | None = None, extras: Sequence[str] = ()) -> Path:
    """Build (or reuse) the executors' environment, with the project's optional
    ``extras`` (``("s3",)``: boto3, which tasks writing an ``s3://`` table
    need); return the tar's path."""
    name = "-".join(["executor-env", *sorted(extras)])
    cache = cache or ROOT / ".venv" / ".cache" / name
    archive = cache / f"executor-env-{_key(extras)}.tar.gz"
    if archive.exists():
        return archive
    if cache.exists():
        shutil.rmtree(cache)  # older builds
    cache.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="twophase-exenv-") as tmp:
        work = Path(tmp)
        src = work / "src"
        src.mkdir()
        for name in SOURCES:
            path = ROOT / name
            if path.is_dir():
                shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(path, src / name)
        pip = [sys.executable, "-m", "pip", "-q"]
        _run(*pip, "wheel", "--no-deps", "-w", work / "dist", src)
        wheel = next((work / "dist").glob("twophase-*.whl"))
        env = work / "env"
        _run(sys.executable, "-m", "venv", "--copies", "--without-pip", env)
        # this environment's pip installs into the new one (pip >= 22.3; the
        # scripts keep .venv's pip current)
        into = [*pip, "--python", env / "bin" / "python", "install"]
        _run(*into, "--no-deps", wheel)
        _run(*into, *_runtime_requirements(extras))
        for cache_dir in env.rglob("__pycache__"):
            shutil.rmtree(cache_dir, ignore_errors=True)
        partial = cache / "partial.tar.gz"
        entries = sorted(p.name for p in env.iterdir())
        # no "./" entries; gzip -1: the archive is unpacked once per executor
        _run("tar", "-C", env, "--use-compress-program=gzip -1", "-cf", partial, *entries)
        partial.rename(archive)
    return archive


if __name__ == "__main__":
    print(executor_archive())
