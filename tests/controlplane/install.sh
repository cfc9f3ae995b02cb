#!/usr/bin/env bash
# What the datastore tests (tests/controlplane) need on the machine: Debian's PostgreSQL server
# binaries and its 'postgres' user. The tests start their own server on a free port
# (tests/kit/postgres.py); nothing here starts one. Installs it only when missing.
set -euo pipefail

have() { compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null && { [[ $(id -u) != 0 ]] || id postgres >/dev/null 2>&1; }; }
have && exit 0
"$(dirname "$0")/../debian-packages.sh" "tests/controlplane (PostgreSQL datastore)" postgresql
have || { echo "apt-get installed postgresql but no /usr/lib/postgresql/*/bin/postgres (or no 'postgres' user)" >&2; exit 1; }
