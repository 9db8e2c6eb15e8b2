#!/usr/bin/env bash
# The project's test command: sets up .venv (once), lints, runs the test suite.
# Tests start their own services on loopback (a private PostgreSQL cluster);
# see README.md. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh
.venv/bin/ruff check sinks lifecycle tests integration benchmarks examples
status=0
.venv/bin/python -m pytest "$@" || status=$?
# pytest exits 5 when it collected no tests: that is a failure of the suite here.
if [ "$status" -eq 5 ]; then
    echo "no tests were collected" >&2
    exit 1
fi
exit "$status"
