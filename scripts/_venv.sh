# Sourced by the scripts: create .venv once and (re)install the project when
# pyproject.toml changes. Needs python3 (3.10+) with venv, and Java 17 for Spark.
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import sinks, lifecycle, pytest' >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.installed ]; then
    echo "installing the project and its dependencies into .venv ..."
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e '.[dev]'
    touch .venv/.installed
fi
export PYSPARK_PYTHON="$PWD/.venv/bin/python"
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
