#!/usr/bin/env bash
# What the container tests, `make images` and the compose set need on the machine, from Debian's
# packages: Podman, runc (the OCI runtime pinned here, since this kind of machine cannot run Podman's
# default crun with systemd), debootstrap (the base image is built from Debian packages; no registry
# is reachable), and netavark with aardvark-dns (the network backend deploy/podman/podmanhost.py
# configures: containers on a compose network find each other by name).
# Installs only what is missing (tests/debian-packages.sh).
set -euo pipefail

need=()
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
[[ -x /usr/lib/podman/netavark ]] || need+=(netavark)
[[ -x /usr/lib/podman/aardvark-dns ]] || need+=(aardvark-dns)
((${#need[@]} == 0)) && exit 0

"$(dirname "$0")/../debian-packages.sh" "tests/containers and make images" "${need[@]}"
for tool in "${need[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || [[ -x /usr/lib/podman/$tool ]] \
        || { echo "apt-get installed ${tool} but it is not on PATH (nor in /usr/lib/podman)" >&2; exit 1; }
done
