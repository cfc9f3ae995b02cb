"""Consumable capacity on the real kube-apiserver: with `DRAConsumableCapacity` on (1.36's default)
the capacity publisher's slices are kept as written; with it off (1.35's default, or turned off) the
server silently drops `allowMultipleAllocations` and `requestPolicy` — every GPU offered once, to one
claim — and each of Tessera's writers refuses, naming the gate, instead of running on a wrong fleet.
"""

from __future__ import annotations

import pytest

from tessera.shared.events import ClaimSpec, GpuDevice, NodeInventory
from tessera.shared.featuregates import FeatureGateOff
from tessera.shared.kubeapi import KubeApi, object_path

from tessera.capacity.kube import SliceWriter, says
from tessera.capacity.slices import API_VERSION, resource_slice, slice_name
from tessera.translator.dra import resource_claim_template
from tessera.translator.kube import TemplateWriter
from tessera.translator.webhook import ContainerRequest, PodClaim

from kit.kubecluster import node_bound_identity, remove, service_identity, start_control_plane

GPU = GpuDevice(uuid="GPU-11111111-1111-4111-8111-111111111111", index=0, model="NVIDIA H100 80GB HBM3",
                memory_mib=81559)


def inventory(node: str) -> NodeInventory:
    return NodeInventory(node=node, devices=[GPU])


@pytest.fixture(scope="module")
def gate_off():
    """A second API server, with the gate off as on 1.35 (no controllers: nothing here needs them)."""
    plane = start_control_plane(extra_apiserver_flags=("--feature-gates=DRAConsumableCapacity=false",),
                                controllers=False)
    try:
        yield plane
    finally:
        remove(plane)


async def test_the_publisher_s_slice_is_kept_as_written_with_the_gate_on(kube_cluster):
    node = "gate-on-0"
    writer = SliceWriter(KubeApi.for_kubeconfig(node_bound_identity(kube_cluster, "capacity.yaml", node)))
    try:
        assert await writer.publish(inventory(node)) == 1
        stored = await writer.api.get(object_path(API_VERSION, "resourceslices", slice_name(node)))
        assert says(stored, resource_slice(inventory(node), 1))  # the server's spelling is the one written
        assert stored["spec"]["devices"][0]["allowMultipleAllocations"] is True
        assert await writer.publish(inventory(node)) is None  # read back: nothing to re-apply
    finally:
        await writer.close()


async def test_the_publisher_refuses_naming_the_gate_when_it_is_off(gate_off):
    writer = SliceWriter(KubeApi.for_kubeconfig(node_bound_identity(gate_off, "capacity.yaml", "gate-off-0")))
    try:
        with pytest.raises(FeatureGateOff, match=r"allowMultipleAllocations.*DRAConsumableCapacity feature gate is off"):
            await writer.publish(inventory("gate-off-0"))
    finally:
        await writer.close()


async def test_the_translator_refuses_a_template_the_server_would_make_whole_card(gate_off):
    gate_off.kubectl("create", "namespace", "team-a", check=False)
    spec = ClaimSpec(memory_mib=20480, cores=30)
    claim = PodClaim(namespace="team-a", pod="train", spec=spec, template_name="main-gpu",
                     template=resource_claim_template(spec, "main-gpu", "team-a"),
                     containers=(ContainerRequest(container="main", index=0, spec=spec, request=None),))
    writer = TemplateWriter(KubeApi.for_kubeconfig(service_identity(gate_off, "translator.yaml")))
    try:
        with pytest.raises(FeatureGateOff, match=r"capacity.*DRAConsumableCapacity"):
            await writer("team-a", [claim])
        # what the server mangled is not left for a pod to use
        admin = KubeApi.for_kubeconfig(gate_off.admin_kubeconfig)
        try:
            assert await admin.get(object_path("resource.k8s.io/v1", "resourceclaimtemplates",
                                               "main-gpu", "team-a")) is None
        finally:
            await admin.close()
    finally:
        await writer.close()
