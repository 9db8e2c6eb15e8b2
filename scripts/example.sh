#!/usr/bin/env bash
# Sets up .venv (once), starts a private PostgreSQL on loopback and runs a small
# exactly-once job end to end (examples/orders_job.py). Extra arguments go to
# the job, e.g. --dsn postgresql://app:app@127.0.0.1:5432/shop to use your server.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh
exec .venv/bin/python examples/orders_job.py "$@"
