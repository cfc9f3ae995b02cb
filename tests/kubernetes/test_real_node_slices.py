"""Each node's ResourceSlices are written by that node's capacity pod alone (defect 9's policy half,
deploy/k8s/admission-policies.yaml `tessera-node-slices`), on the real kube-apiserver.

The capacity DaemonSet's pods share one ServiceAccount, and RBAC cannot scope it to "your own
node": before the policy the pod of any node could rewrite every node's slices (and so steer
placement). A pod's projected token names its node; the policy compares it with the slice's node.
"""

from __future__ import annotations

import pytest

from tessera.shared.events import GpuDevice, NodeInventory
from tessera.shared.kubeapi import KubeApi, Rejected

from tessera.capacity.kube import SliceWriter

from kit import eventually
from kit.kubecluster import apply, manifests, node_bound_identity, service_identity

GPU = GpuDevice(uuid="GPU-33333333-3333-4333-8333-333333333333", index=0, model="NVIDIA H100 80GB HBM3",
                memory_mib=81559)


@pytest.fixture
def policies(kube_cluster):
    apply(kube_cluster, manifests("admission-policies.yaml"))


async def test_a_node_s_pod_writes_its_own_slice_and_no_other(kube_cluster, policies):
    mine = SliceWriter(KubeApi.for_kubeconfig(node_bound_identity(kube_cluster, "capacity.yaml", "slices-a")))
    other = SliceWriter(KubeApi.for_kubeconfig(node_bound_identity(kube_cluster, "capacity.yaml", "slices-b")))
    unbound = SliceWriter(KubeApi.for_kubeconfig(service_identity(kube_cluster, "capacity.yaml")))
    try:
        async def refused(writer: SliceWriter, node: str) -> bool:
            """Whether ``writer`` is refused writing ``node``'s slice (one saying something else than
            what is there: a slice already as wanted is not written at all)."""
            lie = GpuDevice(uuid=GPU.uuid, index=0, model=GPU.model, memory_mib=GPU.memory_mib * 2)
            try:
                await writer.publish(NodeInventory(node=node, devices=[lie]))
            except Rejected as exc:
                return "may write only the ResourceSlices of node" in str(exc) or "bound to a node" in str(exc)
            return False

        # the policy is in force once the API server's informer has it: node b's pod writing a's
        # slice is refused (before the policy it was written)
        await eventually(lambda: refused(other, "slices-a"), timeout=30, what="node b refused node a's slice")
        assert await mine.publish(NodeInventory(node="slices-a", devices=[GPU])) is not None
        assert await refused(other, "slices-a")
        assert await refused(unbound, "slices-a")  # a token of no pod names no node
        assert await other.publish(NodeInventory(node="slices-b", devices=[GPU])) is not None
    finally:
        for writer in (mine, other, unbound):
            await writer.close()
