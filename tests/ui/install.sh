#!/usr/bin/env bash
# What the fleet view's browser test (tests/ui) needs on the machine: Debian's Chromium, driven
# headless by Playwright's Python package over the DevTools protocol (Playwright downloads no
# browser of its own here: the test hands it this executable). Installs it only when missing.
set -euo pipefail

command -v chromium >/dev/null 2>&1 && exit 0
"$(dirname "$0")/../debian-packages.sh" "tests/ui" chromium fonts-dejavu-core
command -v chromium >/dev/null 2>&1 || { echo "apt-get installed chromium but it is not on PATH" >&2; exit 1; }
