#!/usr/bin/env bash
# What the real node of tests/kubernetes (tests/kit/kubenode.py: containerd and the real kubelet)
# needs on the machine besides what tools/kube builds, from Debian's packages: runc (the OCI runtime
# containerd's runc shim calls), the CNI plugins (bridge, host-local, loopback: the pods' network),
# and busybox-static (the test image's one binary: tools/kube/images.py packs it; no registry is
# reachable). Installs only what is missing (tests/debian-packages.sh).
set -euo pipefail

need=()
command -v runc >/dev/null 2>&1 || need+=(runc)
[[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local && -x /usr/lib/cni/loopback ]] \
    || need+=(containernetworking-plugins)
[[ -x /bin/busybox ]] || need+=(busybox-static)
((${#need[@]} == 0)) && exit 0

"$(dirname "$0")/../debian-packages.sh" "the real node of tests/kubernetes" "${need[@]}"
command -v runc >/dev/null 2>&1 || { echo "apt-get installed runc but it is not on PATH" >&2; exit 1; }
[[ -x /usr/lib/cni/bridge ]] || { echo "containernetworking-plugins installed no /usr/lib/cni/bridge" >&2; exit 1; }
[[ -x /bin/busybox ]] || { echo "busybox-static installed no /bin/busybox" >&2; exit 1; }
