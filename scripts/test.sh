#!/usr/bin/env bash
# The project's test command: sets up .venv (once), lints, checks the types,
# builds the docs, runs the test suite.
# Tests start their own services on loopback (a private PostgreSQL cluster);
# see README.md. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh
.venv/bin/ruff check sinks lifecycle tests integration benchmarks examples docs
# The type hints of both packages, strictly ([tool.mypy] in pyproject.toml).
echo "checking the type hints (mypy) ..."
.venv/bin/mypy
# The documentation site, strictly: a warning (a broken link or reference, a
# docstring that does not render) fails the run. -E: every page read anew.
echo "building the documentation site (docs/) ..."
.venv/bin/python -m sphinx -E -W --keep-going -n -q -b html docs docs/_build/html
# The shipped Prometheus rules and their unit tests (integration/prometheus).
echo "checking the alert rules (promtool) ..."
if ! command -v promtool >/dev/null 2>&1; then
    echo "promtool is missing: apt-get install prometheus (.ci/run installs it)" >&2
    exit 1
fi
(cd integration/prometheus &&
    promtool check rules twophase-rules.yml &&
    promtool test rules twophase-rules.test.yml twophase-rules.seconds.test.yml)
status=0
.venv/bin/python -m pytest "$@" || status=$?
# pytest exits 5 when it collected no tests: that is a failure of the suite here.
if [ "$status" -eq 5 ]; then
    echo "no tests were collected" >&2
    exit 1
fi
exit "$status"
