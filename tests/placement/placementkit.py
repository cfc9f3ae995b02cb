"""One placement replica (or two) against a real nats-server, driven call by call.

The windows of issue 12 are races between a commit's steps; a test reproduces one by calling the
service's steps in the order the race would interleave them, on real buckets, instead of hoping a
full cluster hits the window by chance.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

from tessera.placement.service import PlacementService, PlacementSettings
from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.claimstore import ClaimStore
from tessera.shared.events import ClaimRecord, ClaimRequested, ClaimSpec, GpuQuota, TenantRecord, encode
from tessera.shared.runner import ServiceContext
from tessera.shared.settings import BusSettings
from tessera.shared.telemetry import Telemetry

from fleetkit import inventory
from kit import eventually


class Replica:
    def __init__(self, svc: PlacementService, tasks: dict[str, asyncio.Task]) -> None:
        self.svc = svc
        self.tasks = tasks

    def alive(self) -> list[str]:
        return [name for name, task in self.tasks.items() if not task.done()]


@contextlib.asynccontextmanager
async def replicas(nats_url: str, count: int = 1, *, watch: bool = True, nodes=("n1", "n2"),
                   settings: PlacementSettings | None = None):
    """``count`` placement replicas with their watchers running (not their consumers)."""
    buses, made = [], []
    try:
        for i in range(count):
            bus = await Bus.connect(BusSettings(url=nats_url, max_deliver=3, ack_wait=5), f"placement-{i}")
            buses.append(bus)
            if i == 0:
                await bus.ensure_topology()
                inv = await bus.kv(subjects.KV_INVENTORY)
                for name in nodes:
                    await inv.put(name, encode(inventory(name, gpus=2)))
            ctx = ServiceContext(settings=SimpleNamespace(instance=f"r{i}", service="placement", metrics_legacy=True), bus=bus,
                                 telemetry=Telemetry("placement", None))
            svc = PlacementService(ctx, settings or PlacementSettings())
            roots = await svc.start()
            tasks = {}
            for name, coroutine in roots.items():
                if name.startswith("watch-") and watch:
                    tasks[name] = asyncio.create_task(coroutine, name=name)
                else:
                    coroutine.close()
            made.append(Replica(svc, tasks))
        if watch:
            for r in made:
                await eventually(lambda r=r: r.svc.ctx.ready, every=0.01, what="the replica ready")
        yield made
    finally:
        for r in made:
            await cancel_and_wait(r.tasks.values())
        for bus in buses:
            await bus.close()


async def tenant(bus: Bus, name: str, quota: GpuQuota | None = None, **fair) -> None:
    """Tenant ``name`` as the control-plane manager publishes it (``fair``: its borrowing limit, weight)."""
    await (await bus.kv(subjects.KV_TENANTS)).put(
        name, encode(TenantRecord(tenant=name, quota=quota or GpuQuota(), **fair)))


async def requested(bus: Bus, claim: str, tenant_name: str = "a", **spec) -> ClaimRequested:
    """The claim's record as the translator creates it, and the event it publishes."""
    spec = ClaimSpec(**({"memory_mib": 1000, "cores": 10} | spec))
    revision = await ClaimStore(await bus.kv(subjects.KV_CLAIMS)).create(
        ClaimRecord(claim=claim, tenant=tenant_name, state="requested", spec=spec))
    return ClaimRequested(claim=claim, tenant=tenant_name, spec=spec, record_revision=revision)

