#!/usr/bin/env bash
# Sets up .venv (once, timed apart), then runs the three-sink demo
# (examples/three_sinks.py): a private PostgreSQL and Kafka broker on loopback,
# one job writing PostgreSQL, Kafka and Delta Lake, SIGKILLed mid-way and
# restarted, drained, and checked from the sinks. Extra arguments go to the demo
# (--orders N, --events N, --keep DIR).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
_began=$(date +%s)
source scripts/_venv.sh
echo "setup: $(( $(date +%s) - _began )) s"
exec .venv/bin/python examples/three_sinks.py "$@"
