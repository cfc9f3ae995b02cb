#!/usr/bin/env bash
# What the container tests need on the machine, from Debian's packages: Podman, runc (the OCI
# runtime the tests pin, since this kind of machine cannot run Podman's default crun with systemd),
# and debootstrap (the test image is built from Debian packages; no registry is reachable).
# Installs only what is missing; "apt-get update" only when a package is unknown to apt.
set -euo pipefail

need=()
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
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
echo "installing ${need[*]} from Debian's packages (for tests/containers)"
export DEBIAN_FRONTEND=noninteractive
for pkg in "${need[@]}"; do
    apt-cache show "$pkg" >/dev/null 2>&1 || { "${sudo[@]}" apt-get update -qq; break; }
done
install() { "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
# A package list that is known but stale names files the mirror no longer has: refresh once, retry.
install || { "${sudo[@]}" apt-get update -qq && install; }
for tool in "${need[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || { echo "apt-get installed ${tool} but it is not on PATH" >&2; exit 1; }
done
