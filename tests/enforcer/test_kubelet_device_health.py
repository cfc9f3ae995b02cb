"""The kubelet's device-health stream (dra-health v1alpha1 NodeWatchResources), over the plugin's
real DRA socket: every device of the node at once, named as in its ResourceSlice, and again as soon
as one's health changes in the inventory."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import grpc

from tessera.shared.events import GpuDevice
from tessera.shared.kubeclaims import DRIVER, pool_name

from tessera.enforcer.kubelet.api import dra_health_v1alpha1_pb2 as pb2
from tessera.enforcer.kubelet.api import dra_health_v1alpha1_pb2_grpc as pb2_grpc
from tessera.enforcer.kubelet.health import DeviceHealth
from tessera.enforcer.kubelet.server import serve

NODE = "gpu-0"


def gpu(index: int, healthy: bool = True) -> GpuDevice:
    return GpuDevice(uuid=f"GPU-{index:08d}-0000-4000-8000-000000000000", index=index,
                     model="NVIDIA H100 80GB HBM3", memory_mib=81559, healthy=healthy)


async def test_the_stream_names_every_device_and_follows_a_health_change():
    devices = [gpu(0), gpu(1)]

    async def current():
        return list(devices)

    root = Path(tempfile.mkdtemp(prefix="health-", dir="/tmp"))
    ready = asyncio.Event()
    serving = asyncio.create_task(serve(None, root / "registry", root / "plugins" / DRIVER, ready.set,  # type: ignore[arg-type]
                                        health=DeviceHealth(NODE, current, poll=0.05)))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        async with grpc.aio.insecure_channel(f"unix://{root / 'plugins' / DRIVER / 'dra.sock'}") as channel:
            stream = pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(pb2.NodeWatchResourcesRequest())
            first = await asyncio.wait_for(stream.read(), 10)
            assert [(d.device.pool_name, d.device.device_name, d.health) for d in first.devices] == [
                (pool_name(NODE), "gpu-0", pb2.HEALTHY), (pool_name(NODE), "gpu-1", pb2.HEALTHY)]
            assert all(d.health_check_timeout_seconds > 0 and d.last_updated_time > 0 for d in first.devices)

            devices[1] = gpu(1, healthy=False)  # the capacity publisher marks gpu-1 unhealthy
            changed = await asyncio.wait_for(stream.read(), 10)
            health = {d.device.device_name: d for d in changed.devices}
            assert health["gpu-0"].health == pb2.HEALTHY
            assert health["gpu-1"].health == pb2.UNHEALTHY and "unhealthy" in health["gpu-1"].message
            stream.cancel()
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
