#!/usr/bin/env bash
# Builds the real Kubernetes components the tests and the demo run (kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kubectl) from the Go modules pinned in
# tools/kube/<minor>/go.mod, with the ordinary `go` command, into a per-machine cache keyed by
# version: ${TESSERA_CACHE:-~/.cache/tessera}/kubernetes/<version>/bin. A component already built
# for that version is not built again. Prints the directory on its last line.
#
#   tools/kube/build.sh [v1.36|v1.37] [component ...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
minor="${1:-v1.36}"
shift || true
moddir="$here/$minor"
if [[ ! -f "$moddir/go.mod" ]]; then
    echo "tools/kube/build.sh: no pinned go.mod for '$minor' (have: $(cd "$here" && ls -d v1.* | tr '\n' ' '))" >&2
    exit 2
fi
if ! command -v go >/dev/null; then
    echo "tools/kube/build.sh: the 'go' command is missing; install Go 1.26 or later" >&2
    exit 2
fi
version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$moddir/go.mod")"
components=("$@")
[[ ${#components[@]} -gt 0 ]] || components=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)
out="${TESSERA_CACHE:-$HOME/.cache/tessera}/kubernetes/$version/bin"
mkdir -p "$out"

major="${version#v}"; major="${major%%.*}"
minor_n="${version#v*.}"; minor_n="${minor_n%%.*}"
pkg=k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor_n"
ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$version"

for c in "${components[@]}"; do
    if [[ -x "$out/$c" ]]; then
        continue
    fi
    start=$SECONDS
    echo "building $c $version (cold: minutes; cached afterwards in $out)" >&2
    (cd "$moddir" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -ldflags "$ldflags" \
        -o "$out/$c.partial" "k8s.io/kubernetes/cmd/$c")
    mv "$out/$c.partial" "$out/$c"
    echo "built $c in $((SECONDS - start)) s" >&2
done
echo "$out"
