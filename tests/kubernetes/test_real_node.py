"""The real node: containerd 2.x (from its Go module, Debian's runc) and the real kubelet, joined to
the session's real control plane as a node identity (tests/kit/kubenode.py). A plain pod created
with kubectl is scheduled by kube-scheduler, started by the kubelet through CRI in the sandbox image
built here, and its logs and exec come back through the API server's kubelet client. Fails (never
skips) when a piece is missing: `make kube-node-binaries` builds and installs them."""

from __future__ import annotations

import ipaddress
import json
import time

from kit.kubecluster import kube_version
from kit.kubenode import containerd_version


def _node(kube_cluster, name: str) -> dict:
    return json.loads(kube_cluster.kubectl("get", "node", name, "-o", "json").stdout)


def test_the_kubelet_registers_the_node_with_its_own_identity(kube_cluster, kube_node):
    node = _node(kube_cluster, kube_node.name)
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert ready["Ready"] == "True", node["status"]["conditions"]
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == kube_version(kube_cluster.minor)
    assert info["containerRuntimeVersion"] == f"containerd://{containerd_version().lstrip('v')}"
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == kube_node.ip
    # the node's client certificate is a node identity: the Node authorizer lets it read its own
    # Node and refuses it cluster-wide lists an admin has
    own = kube_cluster.kubectl("get", "node", kube_node.name, kubeconfig=kube_node.kubeconfig, check=False)
    assert own.returncode == 0, own.stderr
    secrets = kube_cluster.kubectl("get", "secrets", "-A", kubeconfig=kube_node.kubeconfig, check=False)
    assert secrets.returncode != 0 and "forbidden" in secrets.stderr.lower(), secrets


def test_a_plain_pod_runs_on_the_real_node_and_its_logs_are_read(kube_cluster, kube_node, kube_namespace):
    marker = f"hello from {kube_namespace}"
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "namespace": kube_namespace},
        "spec": {
            # the scheduler places it (a selector, not nodeName): the node is a schedulable node
            "nodeSelector": {"kubernetes.io/hostname": kube_node.name},
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main", "image": kube_node.image("busybox"), "imagePullPolicy": "Never",
                "command": ["sh", "-c", f"echo '{marker}'; exec sleep 3600"],
            }],
        },
    }
    created = time.monotonic()
    kube_cluster.kubectl("create", "-f", "-", stdin=json.dumps(pod))
    waited = kube_cluster.kubectl("wait", "-n", kube_namespace, "pod/plain", "--for=condition=Ready",
                                  "--timeout=90s", check=False)
    running_after = time.monotonic() - created
    got = json.loads(kube_cluster.kubectl("get", "-n", kube_namespace, "pod/plain", "-o", "json").stdout)
    assert waited.returncode == 0, (
        f"pod not Ready: {got['status']}\n"
        f"{kube_cluster.kubectl('describe', '-n', kube_namespace, 'pod/plain').stdout[-3000:]}\n"
        f"kubelet:\n{kube_node.log('kubelet')[-4000:]}")
    assert got["spec"]["nodeName"] == kube_node.name
    assert got["status"]["phase"] == "Running"
    assert ipaddress.ip_address(got["status"]["podIP"]) in kube_node.subnet  # the node's bridge network

    # logs: API server -> kubelet (the API server's kubelet client certificate) -> containerd's log file
    deadline = time.monotonic() + 30
    logs = kube_cluster.kubectl("logs", "-n", kube_namespace, "plain", check=False)
    while marker not in logs.stdout and time.monotonic() < deadline:
        time.sleep(0.2)
        logs = kube_cluster.kubectl("logs", "-n", kube_namespace, "plain", check=False)
    assert marker in logs.stdout, logs

    # exec: the same path, streamed from containerd's CRI streaming server
    inside = kube_cluster.kubectl("exec", "-n", kube_namespace, "plain", "--", "cat", "/proc/1/cmdline")
    assert inside.stdout.replace("\0", " ").strip() == "sleep 3600"

    # the sandbox is the pause image built here (containerd's pinned sandbox image)
    sandboxes = [line for line in kube_node.ctr("containers", "list").stdout.splitlines()
                 if kube_node.image("pause") in line]
    assert sandboxes, kube_node.ctr("containers", "list").stdout

    kube_cluster.kubectl("delete", "-n", kube_namespace, "pod/plain", "--timeout=60s")
    assert kube_cluster.kubectl("get", "-n", kube_namespace, "pod/plain", check=False).returncode != 0
    print(f"node ready in {kube_node.timings['ready']:.1f} s ({kube_node.timings}); "
          f"pod created -> Ready in {running_after:.1f} s")
