#!/usr/bin/env bash
# Run the test suite against the docker-compose services instead of the ones
# the tests start natively.  Start them first:  docker compose up -d
# Variables already set in the environment win over the compose defaults.
# Extra arguments go to pytest (via scripts/test.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export TWOPHASE_PG_DSN="${TWOPHASE_PG_DSN:-postgresql://app:app@127.0.0.1:5432/shop}"
export TWOPHASE_KAFKA_BOOTSTRAP="${TWOPHASE_KAFKA_BOOTSTRAP:-127.0.0.1:9092}"
export TWOPHASE_S3_ENDPOINT="${TWOPHASE_S3_ENDPOINT:-http://127.0.0.1:9000}"

# host:port out of a URL-ish value: strip scheme, userinfo, path/query;
# for a comma-separated list (Kafka bootstrap) take the first entry.
hostport() {
    local v="${1%%,*}" default_port="$2"
    v="${v#*://}"
    v="${v##*@}"
    v="${v%%[/?]*}"
    case "$v" in
        \[*\]:*) printf '%s\n' "$v" ;;                 # [::1]:port
        \[*\]) printf '%s:%s\n' "$v" "$default_port" ;;
        *:*) printf '%s\n' "$v" ;;
        *) printf '%s:%s\n' "${v:-127.0.0.1}" "$default_port" ;;
    esac
}

# probe NAME VAR HOST:PORT -- fail with a clear message if nothing listens.
probe() {
    local name="$1" var="$2" hp="$3" host port
    host="${hp%:*}"
    host="${host#[}"
    host="${host%]}"
    port="${hp##*:}"
    # shellcheck disable=SC2016  # $1/$2 expand in the inner bash
    if ! timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$host" "$port" 2>/dev/null; then
        echo "integration: $name is not reachable at $host:$port ($var=${!var})." >&2
        echo "  Start the services with 'docker compose up -d' (from the repo root)," >&2
        echo "  wait until 'docker compose ps' shows them healthy, or set $var." >&2
        exit 1
    fi
    echo "integration: $name at $host:$port"
}

if [[ "$TWOPHASE_PG_DSN" == *://* ]]; then
    probe postgres TWOPHASE_PG_DSN "$(hostport "$TWOPHASE_PG_DSN" 5432)"
else
    # keyword/value DSN ("host=... port=..."): not parsed here, psycopg will tell.
    echo "integration: TWOPHASE_PG_DSN is not a URL; skipping the postgres probe" >&2
fi
probe kafka TWOPHASE_KAFKA_BOOTSTRAP "$(hostport "$TWOPHASE_KAFKA_BOOTSTRAP" 9092)"
s3_default_port=80
[[ "$TWOPHASE_S3_ENDPOINT" == https://* ]] && s3_default_port=443
probe minio TWOPHASE_S3_ENDPOINT "$(hostport "$TWOPHASE_S3_ENDPOINT" "$s3_default_port")"

exec bash scripts/test.sh "$@"
