"""The capacity publisher keeps its ResourceSlices true on the real kube-apiserver: the slices the
kubelet deletes when it starts, or that someone edits, come back (at the next heartbeat, and through
the watch as soon as it happens) at the same pool generation; a device change raises it.

As deployed: one publisher per node (the capacity DaemonSet's pod there), each with its pod's token
(`node_bound_identity`), which deploy/k8s's tessera-node-slices policy lets write its own node's
slice only; the kubelet's wipe is the node's own identity (system:node:<name>) deleting its node's
slices, as the kubelet does at start. Nodes are this test's own (tiny.yaml's, renamed)."""

from __future__ import annotations

import asyncio
import uuid
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
from tessera.shared.kubeapi import KubeApi, object_path
from kit import eventually
from kit.kubecluster import kubelet_deletes_slices, node_bound_identity

ROOT = Path(__file__).resolve().parents[2]
CAPACITY = "system:serviceaccount:tessera-system:tessera-capacity"


def fleet() -> list:
    """tests/profiles/tiny.yaml (two nodes, two H100s each), its nodes named for this test."""
    suffix = uuid.uuid4().hex[:6]
    return [msgspec.structs.replace(inv, node=f"{inv.node}-{suffix}")
            for inv in profile.load(ROOT / "tests/profiles/tiny.yaml")]


class Publishers:
    """A publisher per node, as its node's DaemonSet pod runs it; the admin to look."""

    def __init__(self, plane) -> None:
        self.plane = plane
        self.nodes = fleet()
        self.names = [inv.node for inv in self.nodes]
        self.admin = KubeApi.for_kubeconfig(plane.admin_kubeconfig)
        self.services = []
        for inv in self.nodes:  # (node_bound_identity makes the Node objects: the slices are owned by them)
            writer = SliceWriter(KubeApi.for_kubeconfig(node_bound_identity(plane, "capacity.yaml", inv.node)))
            settings = CapacitySettings(kubernetes=True, slices_need_plugin=False)  # (no kubelet plugin here)
            self.services.append(CapacityService(SimpleNamespace(bus=None), settings, [inv], slices=writer))

    async def publish(self, verify: bool = False) -> None:
        for svc in self.services:
            await svc._publish_slices(verify=verify)

    async def stored(self, node: int) -> dict | None:
        return await self.admin.get(object_path(slices.API_VERSION, "resourceslices", slices.slice_name(self.names[node])))

    async def edit(self, node: int, patch: dict) -> None:
        await self.admin.patch(object_path(slices.API_VERSION, "resourceslices", slices.slice_name(self.names[node])),
                               patch)

    async def kubelet_starts(self, node: int) -> None:
        await kubelet_deletes_slices(self.plane, self.names[node])

    async def close(self) -> None:
        for svc in self.services:
            await svc.slices.close()
        await self.admin.close()
        await asyncio.to_thread(self.plane.kubectl, "delete", "node", *self.names, "--wait=false", check=False)


@pytest.fixture
async def publishers(kube_plane):
    made = await asyncio.to_thread(Publishers, kube_plane)
    try:
        yield made
    finally:
        await made.close()


def one_gpu_sick(svc: CapacityService) -> None:
    inv = svc.nodes[0]
    svc.slice_view[inv.node] = msgspec.structs.replace(
        inv, devices=[inv.devices[0], msgspec.structs.replace(inv.devices[1], healthy=False)])
    svc.slices_due.add(inv.node)


async def test_a_slice_the_kubelet_deleted_is_back_after_one_heartbeat_at_the_same_generation(publishers):
    await publishers.publish()
    assert (await publishers.stored(0))["spec"]["pool"]["generation"] == 1
    one_gpu_sick(publishers.services[0])
    await publishers.publish()
    first = await publishers.stored(0)
    assert first["spec"]["pool"]["generation"] == 2 and first["spec"]["devices"][1]["taints"]
    assert first["metadata"]["ownerReferences"][0]["kind"] == "Node"

    other = (await publishers.stored(1))["metadata"]["resourceVersion"]
    await publishers.kubelet_starts(0)
    assert await publishers.stored(0) is None and await publishers.stored(1) is not None
    await publishers.publish(verify=True)  # the next heartbeat
    again = await publishers.stored(0)
    assert again is not None and again["metadata"]["uid"] != first["metadata"]["uid"]
    assert again["spec"] == first["spec"]  # same devices: the same pool generation
    assert (await publishers.stored(1))["metadata"]["resourceVersion"] == other  # the other node's: left alone


async def test_a_slice_edited_by_someone_else_is_restored_and_a_device_change_raises_the_generation(publishers):
    await publishers.publish()
    before = await publishers.stored(1)
    await publishers.edit(1, {"spec": {"devices": before["spec"]["devices"][:1]}})
    await publishers.publish(verify=True)
    assert (await publishers.stored(1))["spec"] == before["spec"]
    untouched_rv = (await publishers.stored(0))["metadata"]["resourceVersion"]
    await publishers.publish(verify=True)  # nothing changed: nothing written
    assert (await publishers.stored(0))["metadata"]["resourceVersion"] == untouched_rv

    one_gpu_sick(publishers.services[1])
    await publishers.publish(verify=True)
    after = await publishers.stored(1)
    assert after["spec"]["pool"]["generation"] == before["spec"]["pool"]["generation"] + 1
    assert [(d["name"], bool(d.get("taints"))) for d in after["spec"]["devices"]] == [("gpu-0", False), ("gpu-1", True)]


async def test_the_watch_puts_a_deleted_slice_back_without_waiting_for_a_heartbeat(kube_plane, publishers):
    seen = len(kube_plane.audit())
    await publishers.publish()
    first = await publishers.stored(0)
    publisher = publishers.services[0]
    watch = asyncio.create_task(publisher.slices.watch([n.node for n in publisher.nodes], publisher._slice_changed))
    try:
        # someone's edit, then the kubelet's wipe; no heartbeat runs here
        await publishers.edit(0, {"spec": {"devices": first["spec"]["devices"][:1]}})
        await eventually(lambda: _spec_is(publishers.stored(0), first["spec"]), timeout=10, every=0.02,
                         what="the edited slice put back")
        await publishers.kubelet_starts(0)
        back = await eventually(lambda: publishers.stored(0), timeout=10, every=0.02, what="the wiped slice put back")
        assert back["spec"] == first["spec"]
    finally:
        await cancel_and_wait([watch])
        if not watch.cancelled():
            watch.result()  # it ended before its cancel: raise what ended it
    # the publisher's ClusterRole grants exactly what it called (the server refuses anything else)
    role = next(d for d in yaml.safe_load_all((ROOT / "deploy/k8s/capacity.yaml").read_text())
                if d and d["kind"] == "ClusterRole")
    kube_rbac.check_audited(kube_plane.audit()[seen:], CAPACITY, role)


async def test_the_published_devices_carry_their_attributes_and_pass_the_servers_validation(publishers):
    await publishers.publish()  # (the real server validates every write against resource.k8s.io/v1)
    (gpu, _) = (await publishers.stored(0))["spec"]["devices"]
    assert set(gpu["attributes"]) == {"model", "productName", "uuid", "index", "architecture",
                                      "cudaComputeCapability", "driverVersion"}
    assert gpu["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
    assert gpu["capacity"]["memory"]["requestPolicy"]["validRange"] == {"min": "1Mi", "step": "1Mi"}
    assert gpu["capacity"]["cores"]["requestPolicy"]["default"] == "100"


async def _spec_is(stored, spec: dict) -> bool:
    return (await stored)["spec"] == spec
