#!/usr/bin/env bash
# What the metrics test (tests/metrics) needs on the machine: Debian's Prometheus server, which it
# starts on loopback against a running Tessera and queries over its HTTP API (promtool comes with
# it; tests/deploy uses that to check deploy/compose/prometheus). Installs it only when missing.
set -euo pipefail

command -v prometheus >/dev/null 2>&1 && exit 0
"$(dirname "$0")/../debian-packages.sh" "tests/metrics" prometheus
command -v prometheus >/dev/null 2>&1 || { echo "apt-get installed prometheus but it is not on PATH" >&2; exit 1; }
