"""Two placement replicas preempting at once, on real buckets: each decides from its own view of
the ledger, and since the victim choice is a function of the ledger alone, two claims that fit
nowhere preempt the same victim, not one each; the release requests are one message per victim
(the same message id). Each preemptor waits, saying which victim it waits for."""

from __future__ import annotations

import asyncio

from tessera.placement.settings import PlacementSettings
from tessera.shared.events import GpuQuota

from kit import eventually
from placementkit import replicas, requested, tenant

HALF = 40960  # MiB: two fill one 81,920 MiB GPU of placementkit's nodes


async def test_two_replicas_preempting_at_once_choose_the_same_victim(nats_url):
    async with replicas(nats_url, 2, settings=PlacementSettings(preemption=True)) as [r0, r1]:
        await tenant(r0.svc.bus, "a", GpuQuota())
        await eventually(lambda: "a" in r0.svc.tenants_known and "a" in r1.svc.tenants_known)
        low = [f"low{i}" for i in range(8)]  # two nodes of two GPUs, two halves each
        for claim in low:
            assert await r0.svc.place(await requested(r0.svc.bus, claim, memory_mib=HALF, cores=0))
        await eventually(lambda: set(low) <= set(r1.svc.claim_nodes), what="replica 1 sees every entry")

        h1 = await requested(r0.svc.bus, "high1", memory_mib=HALF, cores=0, priority=50)
        h2 = await requested(r1.svc.bus, "high2", memory_mib=HALF, cores=0, priority=50)
        assert await asyncio.gather(r0.svc.place(h1), r1.svc.place(h2)) == [False, False]

        marked = [c for c in low if (await r0.svc.claims.get(c))[0].release_requested]
        assert marked == ["low7"], marked  # one victim, the youngest of equals
        for claim in ("high1", "high2"):
            record, _ = await r0.svc.claims.get(claim)
            assert record.state == "unschedulable"
            assert "preempting low7 on" in record.reason, record.reason


async def test_without_the_setting_nothing_is_preempted(nats_url):
    async with replicas(nats_url) as [r0]:
        await tenant(r0.svc.bus, "a", GpuQuota())
        await eventually(lambda: "a" in r0.svc.tenants_known)
        low = [f"low{i}" for i in range(8)]
        for claim in low:
            assert await r0.svc.place(await requested(r0.svc.bus, claim, memory_mib=HALF, cores=0))
        assert not await r0.svc.place(await requested(r0.svc.bus, "high", memory_mib=HALF, cores=0, priority=50))
        assert [c for c in low if (await r0.svc.claims.get(c))[0].release_requested] == []
        record, _ = await r0.svc.claims.get("high")
        assert "preempt" not in record.reason
