# Sourced by the scripts: create .venv once and (re)install the project when
# pyproject.toml changes. Needs python3 (3.10+) with venv, and Java 17 for Spark.
#
# .venv must be a real directory of this checkout with a working interpreter.
# A symlink (for example one copied from another machine) or a directory whose
# interpreter does not run is broken: it is said so and replaced.
_venv_broken=""
if [ -L .venv ]; then
    _venv_broken=".venv is a symlink (to $(readlink .venv))"
elif [ -e .venv ] && [ ! -d .venv ]; then
    _venv_broken=".venv is not a directory"
elif [ -d .venv ] && ! .venv/bin/python -c 'import sys' >/dev/null 2>&1; then
    _venv_broken=".venv has no working interpreter"
fi
if [ -n "$_venv_broken" ]; then
    echo "$_venv_broken: replacing it with a new virtual environment" >&2
    rm -rf .venv
fi
unset _venv_broken
if [ ! -x .venv/bin/python ]; then
    echo "creating .venv with $(python3 --version 2>&1) ..."
    python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import sinks, lifecycle, pytest' >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.installed ]; then
    echo "installing the project and its dependencies into .venv (a few minutes the first time; log: .venv/install.log) ..."
    if ! { .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e '.[dev]'; } > .venv/install.log 2>&1; then
        tail -n 40 .venv/install.log >&2
        echo "installing into .venv failed (the whole log: .venv/install.log)" >&2
        return 1 2>/dev/null || exit 1
    fi
    touch .venv/.installed
fi
# The JVM artifacts (lifecycle/testing/jars.py: delta-spark, Spark's Kafka source,
# the Apache Kafka broker, the PostgreSQL JDBC driver, Hadoop's HDFS minicluster,
# S3Proxy, Hadoop's S3A with the AWS SDK bundle: about 900 MB in all),
# fetched once with Maven into $TWOPHASE_JARS (default ~/.cache/twophase/jars);
# offline once cached.
if command -v mvn >/dev/null 2>&1; then
    if ! .venv/bin/python -m lifecycle.testing.jars fetch > .venv/jars.log 2>&1; then
        tail -n 30 .venv/jars.log >&2
        echo "fetching the JVM artifacts with Maven failed (the whole log: .venv/jars.log)" >&2
        return 1 2>/dev/null || exit 1
    fi
else
    echo "Maven (mvn) is not installed: the tests that need JVM artifacts (delta-spark, Apache Kafka) skip" >&2
fi
export PYSPARK_PYTHON="$PWD/.venv/bin/python"
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
