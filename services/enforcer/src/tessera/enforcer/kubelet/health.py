"""Device health for the kubelet: the DRAResourceHealth stream (dra-health v1alpha1).

The kubelet (ResourceHealthStatus, beta and on from 1.36) opens ``NodeWatchResources`` on the
plugin's DRA socket once the plugin registers, and shows each device's health in the status of the
pods it is allocated to (``containerStatuses[].allocatedResourcesStatus``): a user whose job fails
sees that its GPU is the reason. A device is named as in the node's ResourceSlice (the pool and
``gpu-<index>``); its health is the one the capacity publisher records in the node's inventory
(NVML's view on real hardware, the profile on simulated). The stream says every device at once,
again as soon as one changes, and at least every ``refresh`` seconds, well inside the timeout it
gives the kubelet, after which an unrefreshed answer counts as unknown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable

from tessera.shared.events import GpuDevice
from tessera.shared.kubeclaims import device_name, pool_name

from tessera.enforcer.kubelet.api import dra_health_v1alpha1_pb2 as pb2
from tessera.enforcer.kubelet.api import dra_health_v1alpha1_pb2_grpc as pb2_grpc

REFRESH_SECONDS = 10.0
TIMEOUT_SECONDS = 45
POLL_SECONDS = 1.0


def report(node: str, devices: Iterable[GpuDevice], now: float) -> pb2.NodeWatchResourcesResponse:
    """Every device of ``node`` with its health as of ``now``."""
    return pb2.NodeWatchResourcesResponse(devices=[
        pb2.DeviceHealth(
            device=pb2.DeviceIdentifier(pool_name=pool_name(node), device_name=device_name(d.index)),
            health=pb2.HEALTHY if d.healthy else pb2.UNHEALTHY,
            last_updated_time=int(now), health_check_timeout_seconds=TIMEOUT_SECONDS,
            message="" if d.healthy else f"{d.model} {d.uuid} is reported unhealthy by the node's capacity publisher",
        ) for d in sorted(devices, key=lambda d: d.index)])


class DeviceHealth(pb2_grpc.DRAResourceHealthServicer):
    def __init__(self, node: str, devices: Callable[[], Awaitable[Iterable[GpuDevice]]],
                 refresh: float = REFRESH_SECONDS, poll: float = POLL_SECONDS) -> None:
        self.node = node
        self.devices = devices
        self.refresh = refresh
        self.poll = poll

    async def NodeWatchResources(self, request, context):  # noqa: N802 - the gRPC method's name
        last: tuple | None = None
        sent = 0.0
        while True:
            devices = list(await self.devices())
            state = tuple(sorted((d.index, d.healthy) for d in devices))
            now = time.time()
            if devices and (state != last or now - sent >= self.refresh):
                yield report(self.node, devices, now)
                last, sent = state, now
            await asyncio.sleep(self.poll)
