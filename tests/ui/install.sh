#!/usr/bin/env bash
# What the fleet view's browser test (tests/ui) needs on the machine: Debian's Chromium, driven
# headless by Playwright's Python package over the DevTools protocol (Playwright downloads no
# browser of its own here: the test hands it this executable). Installs only what is missing;
# "apt-get update" only when the package is unknown to apt or its list is stale.
set -euo pipefail

command -v chromium >/dev/null 2>&1 && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "the fleet view's browser test needs chromium: install it with your package manager (this is not a Debian system)" >&2
    exit 1
fi
sudo=()
if [[ $(id -u) != 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "installing chromium needs root: run 'apt-get install -y chromium' as root" >&2; exit 1; }
    sudo=(sudo)
fi
echo "installing chromium from Debian's packages (for tests/ui)"
export DEBIAN_FRONTEND=noninteractive
apt-cache show chromium >/dev/null 2>&1 || "${sudo[@]}" apt-get update -qq
install() { "${sudo[@]}" apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null; }
install || { "${sudo[@]}" apt-get update -qq && install; }
command -v chromium >/dev/null 2>&1 || { echo "apt-get installed chromium but it is not on PATH" >&2; exit 1; }
