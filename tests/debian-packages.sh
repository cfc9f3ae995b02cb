#!/usr/bin/env bash
# Installs Debian packages some tests need, for the per-suite install scripts (tests/containers,
# tests/ui, tests/metrics): each decides what is missing and why; this is how it is installed, once.
#   tests/debian-packages.sh "<what needs them>" PACKAGE...
# Root or sudo; "apt-get update" only when a package is unknown to apt, or when its list is stale
# (an install that fails on files the mirror no longer has is retried once after an update).
set -euo pipefail

purpose=$1
shift
(($# == 0)) && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "$purpose needs $*: install them with your package manager (this is not a Debian system)" >&2
    exit 1
fi
sudo=()
if [[ $(id -u) != 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "installing $* needs root: run 'apt-get install -y $*' as root" >&2; exit 1; }
    sudo=(sudo)
fi
echo "installing $* from Debian's packages (for $purpose)"
export DEBIAN_FRONTEND=noninteractive
for pkg in "$@"; do
    apt-cache show "$pkg" >/dev/null 2>&1 || { "${sudo[@]}" apt-get update -qq; break; }
done
# --no-install-recommends: the package alone (Prometheus without its node exporter, Chromium
# without its extras).
install() { "${sudo[@]}" apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }
install "$@" || { "${sudo[@]}" apt-get update -qq && install "$@"; }
