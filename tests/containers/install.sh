#!/usr/bin/env bash
# What the container tests, `make images` and the compose set need on the machine, from Debian's
# packages: Podman, runc (the OCI runtime pinned here, since this kind of machine cannot run Podman's
# default crun with systemd), debootstrap (the base image is built from Debian packages; no registry
# is reachable), and netavark with aardvark-dns (the network backend deploy/podman/podmanhost.py
# configures: containers on a compose network find each other by name).
# Installs only what is missing; "apt-get update" only when a package is unknown to apt.
set -euo pipefail

need=()
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
[[ -x /usr/lib/podman/netavark ]] || need+=(netavark)
[[ -x /usr/lib/podman/aardvark-dns ]] || need+=(aardvark-dns)
((${#need[@]} == 0)) && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "container tests need ${need[*]}: install them with your package manager (this is not a Debian system)" >&2
    exit 1
fi
sudo=()
if [[ $(id -u) != 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "installing ${need[*]} needs root: run 'apt-get install -y ${need[*]}' as root" >&2; exit 1; }
    sudo=(sudo)
fi
echo "installing ${need[*]} from Debian's packages (for tests/containers and make images)"
export DEBIAN_FRONTEND=noninteractive
for pkg in "${need[@]}"; do
    apt-cache show "$pkg" >/dev/null 2>&1 || { "${sudo[@]}" apt-get update -qq; break; }
done
install() { "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
# A package list that is known but stale names files the mirror no longer has: refresh once, retry.
install || { "${sudo[@]}" apt-get update -qq && install; }
for tool in "${need[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || [[ -x /usr/lib/podman/$tool ]] \
        || { echo "apt-get installed ${tool} but it is not on PATH (nor in /usr/lib/podman)" >&2; exit 1; }
done
