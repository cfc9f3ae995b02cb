"""Device taints on the real kube-apiserver (KEP-5055, DRADeviceTaints: beta and on in 1.36, GA in
1.37): the capacity publisher's taint on a sick GPU is kept as written, with the ``timeAdded`` the
server gives it kept across re-applies; with the gate off the server drops ``taints`` without a
word, and the publisher tells that from the slice it gets back, says so naming the gate, and leaves
the sick GPU out instead (it is never offered as if it were well). The whole path, with the real
node, placement and kube-scheduler: test_real_gpu_taint.py.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from tessera.shared.events import GpuDevice, NodeInventory
from tessera.shared.kubeapi import KubeApi, object_path

from tessera.capacity.kube import SliceWriter
from tessera.capacity.slices import API_VERSION, slice_name

from kit.kubecluster import node_bound_identity, remove, start_control_plane

GPU = {"model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}


def _sick(node: str) -> NodeInventory:
    return NodeInventory(node=node, devices=[
        GpuDevice(uuid=f"GPU-{node}-{i}", index=i, model=GPU["model"], memory_mib=GPU["memory_mib"], healthy=i == 0)
        for i in range(2)])


def _fields(gpu: GpuDevice) -> dict:
    return {f: getattr(gpu, f) for f in gpu.__struct_fields__}


async def _stored(writer: SliceWriter, node: str) -> dict:
    return await writer.api.get(object_path(API_VERSION, "resourceslices", slice_name(node)))


async def test_the_taint_is_kept_with_the_time_the_server_gave_it(kube_cluster):
    node = "taints-on-0"
    writer = SliceWriter(KubeApi.for_kubeconfig(node_bound_identity(kube_cluster, "capacity.yaml", node)))
    try:
        assert await writer.publish(_sick(node)) == 1
        stored = await _stored(writer, node)
        [taint] = stored["spec"]["devices"][1]["taints"]
        assert (taint["key"], taint["effect"], bool(taint.get("timeAdded"))) == (
            "gpu.tessera.dev/unhealthy", "NoSchedule", True)
        assert await writer.publish(_sick(node)) is None  # read back: the same, whatever the server stamped
        await asyncio.sleep(1.1)  # (the server stamps whole seconds: a new stamp would now differ)
        worse = _sick(node)
        worse = NodeInventory(node=node, devices=[GpuDevice(**{**_fields(worse.devices[0]), "healthy": False}),
                                                  worse.devices[1]])
        assert await writer.publish(worse) == 2  # gpu-0 falls sick too: the slice is applied again...
        again = (await _stored(writer, node))["spec"]["devices"]
        assert again[1]["taints"] == [taint]  # ...and gpu-1's taint keeps the time it was first written
        assert again[0]["taints"][0]["key"] == "gpu.tessera.dev/unhealthy"
    finally:
        await writer.close()


@pytest.fixture(scope="module")
def taints_off():
    """A second API server with DRADeviceTaints off (no controllers: nothing here needs them)."""
    plane = start_control_plane(extra_apiserver_flags=("--feature-gates=DRADeviceTaints=false",), controllers=False)
    try:
        yield plane
    finally:
        remove(plane)


async def test_without_the_gate_the_sick_gpu_is_left_out_and_the_gate_named(taints_off, caplog):
    caplog.set_level(logging.WARNING, "tessera.capacity")
    node = "taints-off-0"
    writer = SliceWriter(KubeApi.for_kubeconfig(node_bound_identity(taints_off, "capacity.yaml", node)))
    try:
        await writer.publish(_sick(node))
        stored = await _stored(writer, node)
        assert [d["name"] for d in stored["spec"]["devices"]] == ["gpu-0"]  # never offered as if it were well
        assert "DRADeviceTaints feature gate is off" in caplog.text
        assert await writer.publish(_sick(node)) is None  # and that is what it keeps writing
    finally:
        await writer.close()
