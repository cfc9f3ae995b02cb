#!/usr/bin/env bash
# What the container tests, `make images` and the compose set need on the machine, from Debian's
# packages: Podman, runc (the OCI runtime pinned here, since this kind of machine cannot run Podman's
# default crun with systemd), debootstrap (the base image is built from Debian packages; no registry
# is reachable), netavark with aardvark-dns (the network backend deploy/podman/podmanhost.py
# configures: containers on a compose network find each other by name), and iptables, which
# netavark runs to set up every network's NAT and port forwarding: Podman only suggests it, so a
# machine that never had it fails every container start on a network with "netavark: No such file
# or directory (os error 2)" (issue 27; the container tests use --network none and never see it).
# Installs only what is missing (tests/debian-packages.sh).
set -euo pipefail

# A tool on PATH, or where Debian puts it (/usr/sbin is not on every user's PATH; Podman's helpers
# live in /usr/lib/podman).
have() { command -v "$1" >/dev/null 2>&1 || [[ -x /usr/sbin/$1 || -x /usr/lib/podman/$1 ]]; }

need=()
have podman || need+=(podman)
have runc || need+=(runc)
have debootstrap || need+=(debootstrap)
have netavark || need+=(netavark)
have aardvark-dns || need+=(aardvark-dns)
{ have iptables && have ip6tables; } || need+=(iptables)
((${#need[@]} == 0)) && exit 0

"$(dirname "$0")/../debian-packages.sh" "tests/containers, make images and the compose set" "${need[@]}"
for tool in "${need[@]}"; do
    have "$tool" || { echo "${tool} is still missing after 'apt-get install ${tool}' (not on PATH, nor in /usr/sbin or" \
                           "/usr/lib/podman): if dpkg lists it installed, its files are gone: 'apt-get install --reinstall ${tool}'" >&2
                      exit 1; }
done
