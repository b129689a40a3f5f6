#!/bin/sh
# The postgres service under Podman (deploy/compose/podman.yml), run as the image's postgres user:
# what Docker's postgres:17 entrypoint does with the same variables, for Debian's PostgreSQL 17.
# On first start (an empty volume) initdb with POSTGRES_USER and POSTGRES_PASSWORD (the C locale:
# the image has no locale data; UTF-8 encoding) and create
# POSTGRES_DB; then the server, on loopback only (the services share one network namespace).
set -eu
: "${PGDATA:?}" "${POSTGRES_USER:?}" "${POSTGRES_DB:?}"
: "${POSTGRES_PASSWORD:?set FRACTAL_POSTGRES_PASSWORD to the fleet database's password}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    printf '%s\n' "$POSTGRES_PASSWORD" | initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile=/dev/stdin \
        --auth-local=trust --auth-host=scram-sha-256 -E UTF8 --no-locale
    # single-user mode: nothing listens before the database exists
    echo "CREATE DATABASE \"$POSTGRES_DB\"" | postgres --single -D "$PGDATA" postgres >/dev/null
fi
exec postgres -D "$PGDATA" -c listen_addresses=127.0.0.1 -c unix_socket_directories=/run/postgresql \
    -c jit=off
