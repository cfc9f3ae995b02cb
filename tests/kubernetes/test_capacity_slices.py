"""The capacity publisher keeps its ResourceSlices true against the strict API-server emulator: the
slices the kubelet deletes when it starts, or that someone edits, come back (at the next heartbeat,
and through the watch as soon as it happens) at the same pool generation; a device change raises it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import yaml

import kube_rbac

from tessera.capacity import slices
from tessera.capacity.kube import SliceWriter
from tessera.capacity.service import CapacityService, CapacitySettings
from tessera.shared import profile
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.kubeapi import KubeApi
from kit import eventually

ROOT = Path(__file__).resolve().parents[2]
RS = ("resource.k8s.io/v1", "resourceslices")


def fleet() -> list:
    return profile.load(ROOT / "tests/profiles/tiny.yaml")  # gpu-0 and gpu-1, two H100s each


@pytest.fixture
async def publisher(apiserver):
    for inv in fleet():  # the real nodes' Node objects (the slices are owned by them)
        await apiserver.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": inv.node}})
    writer = SliceWriter(KubeApi.for_url(apiserver.url))
    svc = CapacityService(SimpleNamespace(bus=None), CapacitySettings(kubernetes=True, slices_need_plugin=False), fleet(), slices=writer)
    try:
        yield svc
    finally:
        await writer.close()


def stored(apiserver, node: str) -> dict | None:
    return apiserver.object(*RS, slices.slice_name(node))


async def kubelet_starts(apiserver, node: str) -> None:
    """What the kubelet does on start: delete every ResourceSlice of its node (a collection delete)."""
    api = KubeApi.for_url(apiserver.url)
    try:
        await api.call("DELETE", "/apis/resource.k8s.io/v1/resourceslices",
                       query=[("fieldSelector", f"spec.nodeName={node}")])
    finally:
        await api.close()


def one_gpu_sick(svc: CapacityService, node: int) -> None:
    inv = svc.nodes[node]
    svc.slice_view[inv.node] = msgspec.structs.replace(
        inv, devices=[inv.devices[0], msgspec.structs.replace(inv.devices[1], healthy=False)])
    svc.slices_due.add(inv.node)


async def test_a_slice_the_kubelet_deleted_is_back_after_one_heartbeat_at_the_same_generation(apiserver, publisher):
    await publisher._publish_slices()
    assert stored(apiserver, "gpu-0")["spec"]["pool"]["generation"] == 1
    one_gpu_sick(publisher, 0)
    await publisher._publish_slices()
    first = stored(apiserver, "gpu-0")
    assert first["spec"]["pool"]["generation"] == 2 and first["spec"]["devices"][1]["taints"]
    assert first["metadata"]["ownerReferences"][0]["kind"] == "Node"

    other = stored(apiserver, "gpu-1")["metadata"]["resourceVersion"]
    await kubelet_starts(apiserver, "gpu-0")
    assert stored(apiserver, "gpu-0") is None and stored(apiserver, "gpu-1") is not None
    await publisher._publish_slices(verify=True)  # the next heartbeat
    again = stored(apiserver, "gpu-0")
    assert again is not None and again["metadata"]["uid"] != first["metadata"]["uid"]
    assert again["spec"] == first["spec"]  # same devices: the same pool generation
    assert stored(apiserver, "gpu-1")["metadata"]["resourceVersion"] == other  # the other node's: left alone


async def test_a_slice_edited_by_someone_else_is_restored_and_a_device_change_raises_the_generation(
        apiserver, publisher):
    await publisher._publish_slices()
    before = stored(apiserver, "gpu-1")
    await apiserver.patch(*RS, slices.slice_name("gpu-1"), {"spec": {"devices": before["spec"]["devices"][:1]}})
    await publisher._publish_slices(verify=True)
    assert stored(apiserver, "gpu-1")["spec"] == before["spec"]
    untouched_rv = stored(apiserver, "gpu-0")["metadata"]["resourceVersion"]
    await publisher._publish_slices(verify=True)  # nothing changed: nothing written
    assert stored(apiserver, "gpu-0")["metadata"]["resourceVersion"] == untouched_rv

    one_gpu_sick(publisher, 1)
    await publisher._publish_slices(verify=True)
    after = stored(apiserver, "gpu-1")
    assert after["spec"]["pool"]["generation"] == before["spec"]["pool"]["generation"] + 1
    assert [(d["name"], bool(d.get("taints"))) for d in after["spec"]["devices"]] == [("gpu-0", False), ("gpu-1", True)]


async def test_the_watch_puts_a_deleted_slice_back_without_waiting_for_a_heartbeat(apiserver, publisher):
    await publisher._publish_slices()
    first = stored(apiserver, "gpu-0")
    watch = asyncio.create_task(publisher.slices.watch([n.node for n in publisher.nodes], publisher._slice_changed))
    try:
        # someone's edit, then the kubelet's wipe; no heartbeat runs here
        await apiserver.patch(*RS, slices.slice_name("gpu-0"), {"spec": {"devices": first["spec"]["devices"][:1]}})
        await eventually(lambda: stored(apiserver, "gpu-0")["spec"] == first["spec"], timeout=10, every=0.02,
                         what="the edited slice put back")
        await kubelet_starts(apiserver, "gpu-0")
        back = await eventually(lambda: stored(apiserver, "gpu-0"), timeout=10, every=0.02,
                                what="the wiped slice put back")
        assert back["spec"] == first["spec"]
    finally:
        await cancel_and_wait([watch])
        if not watch.cancelled():
            watch.result()  # it ended before its cancel: raise what ended it
    # the publisher's ClusterRole grants exactly what it called (the kubelet's deletes aside)
    role = next(d for d in yaml.safe_load_all((ROOT / "deploy/k8s/capacity.yaml").read_text())
                if d and d["kind"] == "ClusterRole")
    kube_rbac.check([r for r in apiserver.requests if r[0] != "DELETE"], role)


async def test_the_published_devices_carry_their_attributes_and_pass_the_servers_validation(apiserver, publisher):
    await publisher._publish_slices()  # (the emulator validates every write against resource.k8s.io/v1)
    (gpu, _) = stored(apiserver, "gpu-0")["spec"]["devices"]
    assert set(gpu["attributes"]) == {"model", "productName", "uuid", "index", "architecture",
                                      "cudaComputeCapability", "driverVersion"}
    assert gpu["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
    assert gpu["capacity"]["memory"]["requestPolicy"]["validRange"] == {"min": "1Mi", "step": "1Mi"}
    assert gpu["capacity"]["cores"]["requestPolicy"]["default"] == "100"
