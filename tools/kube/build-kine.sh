#!/usr/bin/env bash
# Builds kine, the etcd API over PostgreSQL and NATS JetStream that a tenant's kube-apiserver talks
# to when its datastore is not etcd, from the module pinned in tools/kube/kine/go.mod, with the
# ordinary `go` command, into a per-machine cache keyed by version:
# ${TESSERA_CACHE:-~/.cache/tessera}/kine/<version>/bin. Already built: not built again.
# cgo-free (kine's SQLite falls back to its pure-Go driver, which no tenant uses) and without the
# `nats` tag (an embedded nats-server: tenants use the platform's). Prints the directory on its
# last line.
#
#   tools/kube/build-kine.sh
set -euo pipefail
moddir="$(cd "$(dirname "$0")" && pwd)/kine"
if ! command -v go >/dev/null; then
    echo "tools/kube/build-kine.sh: the 'go' command is missing; install Go 1.26 or later" >&2
    exit 2
fi
module=github.com/k3s-io/kine
version="$(awk -v m="$module" '$1 == m && $2 ~ /^v/ {print $2; exit}' "$moddir/go.mod")"
[[ -n "$version" ]] || { echo "tools/kube/kine/go.mod pins no $module" >&2; exit 2; }
out="${TESSERA_CACHE:-$HOME/.cache/tessera}/kine/$version/bin"
mkdir -p "$out"
if [[ ! -x "$out/kine" ]]; then
    start=$SECONDS
    echo "building kine $version (cold: minutes; cached afterwards in $out)" >&2
    (cd "$moddir" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath \
        -ldflags "-s -w -X $module/pkg/version.Version=$version -X $module/pkg/version.GitCommit=gomod-$version" \
        -o "$out/kine.partial" "$module")
    mv "$out/kine.partial" "$out/kine"
    echo "built kine in $((SECONDS - start)) s" >&2
fi
echo "$out"
