#!/usr/bin/env bash
# What the metrics test (tests/metrics) needs on the machine: Debian's Prometheus server, which it
# starts on loopback against a running Tessera and queries over its HTTP API (promtool comes with
# it; tests/deploy uses that to check deploy/compose/prometheus). Installs only what is missing;
# "apt-get update" only when the package is unknown to apt or its list is stale.
set -euo pipefail

command -v prometheus >/dev/null 2>&1 && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "the metrics test needs prometheus: install it with your package manager (this is not a Debian system)" >&2
    exit 1
fi
sudo=()
if [[ $(id -u) != 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "installing prometheus needs root: run 'apt-get install -y prometheus' as root" >&2; exit 1; }
    sudo=(sudo)
fi
echo "installing prometheus from Debian's packages (for tests/metrics)"
export DEBIAN_FRONTEND=noninteractive
apt-cache show prometheus >/dev/null 2>&1 || "${sudo[@]}" apt-get update -qq
# --no-install-recommends: the server alone, not the node exporter (the test runs its own server on
# a free port, not the package's service).
install() {
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends prometheus >/dev/null
}
install || { "${sudo[@]}" apt-get update -qq && install; }
command -v prometheus >/dev/null 2>&1 || { echo "apt-get installed prometheus but it is not on PATH" >&2; exit 1; }
