#!/usr/bin/env bash
# The project's test command: sets up .venv (once) and runs the test suite.
# Tests start their own services on loopback (a private PostgreSQL cluster);
# see README.md. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import sinks, lifecycle, pytest' >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.installed ]; then
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e '.[dev]'
    touch .venv/.installed
fi
.venv/bin/ruff check sinks lifecycle tests integration benchmarks examples
status=0
.venv/bin/python -m pytest "$@" || status=$?
# pytest exits 5 when it collected no tests: that is a failure of the suite here.
if [ "$status" -eq 5 ]; then
    echo "no tests were collected" >&2
    exit 1
fi
exit "$status"
