#!/usr/bin/env bash
# Builds the node's container runtime for tests/kubernetes (the real kubelet's CRI): containerd,
# its runc shim (containerd-shim-runc-v2) and ctr, from the containerd 2.x module pinned in
# tools/kube/containerd/go.mod, with the ordinary `go` command, into a per-machine cache keyed by
# version: ${TESSERA_CACHE:-~/.cache/tessera}/containerd/<version>/bin. A binary already built for
# that version is not built again. runc itself is Debian's (tests/kubernetes/install-node.sh).
# Prints the directory on its last line.
#
#   tools/kube/build-containerd.sh [component ...]
set -euo pipefail
moddir="$(cd "$(dirname "$0")" && pwd)/containerd"
if ! command -v go >/dev/null; then
    echo "tools/kube/build-containerd.sh: the 'go' command is missing; install Go 1.26 or later" >&2
    exit 2
fi
module=github.com/containerd/containerd/v2
version="$(awk -v m="$module" '$1 == m && $2 ~ /^v/ {print $2; exit}' "$moddir/go.mod")"
[[ -n "$version" ]] || { echo "tools/kube/containerd/go.mod pins no $module" >&2; exit 2; }
components=("$@")
[[ ${#components[@]} -gt 0 ]] || components=(containerd containerd-shim-runc-v2 ctr)
out="${TESSERA_CACHE:-$HOME/.cache/tessera}/containerd/$version/bin"
mkdir -p "$out"

# Static and cgo-free, as containerd's own static release: no btrfs snapshotter (it needs cgo),
# no devmapper or zfs (nothing here uses them); the CRI plugin and the overlayfs and native
# snapshotters are in.
tags="no_btrfs no_devmapper no_zfs"
ldflags="-s -w -X $module/version.Version=$version -X $module/version.Package=$module"
ldflags+=" -X $module/version.Revision=gomod-$version"

for c in "${components[@]}"; do
    if [[ -x "$out/$c" ]]; then
        continue
    fi
    start=$SECONDS
    echo "building $c $version (cold: minutes; cached afterwards in $out)" >&2
    (cd "$moddir" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -tags "$tags" -ldflags "$ldflags" \
        -o "$out/$c.partial" "$module/cmd/$c")
    mv "$out/$c.partial" "$out/$c"
    echo "built $c in $((SECONDS - start)) s" >&2
done
echo "$out"
