#!/usr/bin/env bash
# The smoke run on the newest pyspark the project allows (pyproject.toml:
# pyspark>=4.0.1,<5), which delta-spark may not accept yet: the suite itself
# runs on the pyspark delta-spark accepts (.venv, `[dev]`). This installs the
# project without delta-spark into .venv-newest (pip picks the newest pyspark),
# then runs a few end-to-end tests of every sink, the lifecycle and one
# delta-spark test, which skips saying why. Extra arguments go to pytest.
#
# The JVM artifacts that exist for that pyspark are fetched as for the suite
# (lifecycle/testing/jars.py; delta-spark is not built for it). Needs what the
# README's test command needs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=.venv-newest
if [ -L "$venv" ] || { [ -e "$venv" ] && ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; }; then
    rm -rf "$venv"
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if ! { "$venv/bin/pip" install -q --upgrade pip \
        && "$venv/bin/pip" install -q --upgrade --upgrade-strategy eager -e '.[testing]' hypothesis; } \
        > "$venv/install.log" 2>&1; then
    tail -n 40 "$venv/install.log" >&2
    echo "installing into $venv failed (the whole log: $venv/install.log)" >&2
    exit 1
fi
pyspark="$("$venv/bin/python" -c 'import pyspark; print(pyspark.__version__)')"
echo "smoke run on pyspark $pyspark (the suite's: $(.venv/bin/python -c 'import pyspark; print(pyspark.__version__)' 2>/dev/null || echo 'no .venv'))"
# the broker the Kafka tests run (the same jars as the suite's); Spark's own
# jar sets exist per Spark release and may not be published for this one yet
"$venv/bin/python" -m lifecycle.testing.jars fetch kafka-broker > "$venv/jars.log" 2>&1 \
    || { tail -n 20 "$venv/jars.log" >&2; exit 1; }
export PYSPARK_PYTHON="$PWD/$venv/bin/python"
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
unset TWOPHASE_REQUIRE_JARS   # delta-spark's tests skip here, saying why
status=0
"$venv/bin/python" -m pytest -p no:cacheprovider -rs \
    "tests/test_delta_e2e.py::test_bounded_job_exactly_once_one_version_per_checkpoint[4.0]" \
    tests/test_delta_merge.py::test_a_change_feed_merges_into_delta_equal_to_the_model \
    "tests/test_postgres_e2e.py::test_bounded_job_commits_every_row_once" \
    tests/test_postgres_e2e.py::test_upsert_by_key_last_row_wins \
    tests/test_kafka_e2e.py::test_postgres_and_kafka_commit_on_the_same_checkpoint \
    tests/test_lifecycle.py::test_three_pipelines_share_one_final_checkpoint \
    tests/test_delta_table_features.py::test_identity_columns_are_refused_before_anything_is_written \
    "$@" || status=$?
[ "$status" -eq 5 ] && { echo "no tests were collected" >&2; exit 1; }
exit "$status"
