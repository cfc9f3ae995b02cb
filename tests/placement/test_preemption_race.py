"""Two placement replicas preempting at once, on real buckets: each decides from its own view of
the ledger, so both choose the same victim first; the victim's record, marked by compare-and-set,
goes to one of them, and the other chooses anew without it. Each victim is preempted for one claim
only, each preemptor is nominated to its own victims (and says which it waits for), and once those
have stopped both are placed in their room, with no victim more."""

from __future__ import annotations

import asyncio

from tessera.placement.settings import PlacementSettings
from tessera.shared.events import GpuQuota

from kit import eventually
from placementkit import replicas, requested, tenant

HALF = 40960  # MiB: two fill one 81,920 MiB GPU of placementkit's nodes


async def test_two_replicas_preempting_at_once_preempt_each_victim_for_one_claim(nats_url):
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
        assert marked == ["low6", "low7"], marked  # one victim each, the youngest of equals
        nominated = {}
        for claim in ("high1", "high2"):
            record, _ = await r0.svc.claims.get(claim)
            assert record.state == "unschedulable"
            [victim] = [v.claim for v in record.nominated.victims]
            assert f"preempting {victim} on" in record.reason, record.reason
            nominated[claim] = victim
        assert sorted(nominated.values()) == ["low6", "low7"], nominated
        for victim in ("low6", "low7"):
            reason = (await r0.svc.claims.get(victim))[0].reason
            assert [c for c in nominated if f"preempted by {c} " in reason] == [c for c, v in nominated.items()
                                                                               if v == victim], reason

        for victim in ("low6", "low7"):  # what their enforcer does once their processes are gone
            await r0.svc.ledger.release_entry(r0.svc.claim_nodes[victim], victim)
        await eventually(lambda: not {"low6", "low7"} & (set(r0.svc.claim_nodes) | set(r1.svc.claim_nodes)))
        assert await asyncio.gather(r0.svc.place(h1), r1.svc.place(h2)) == [True, True]
        assert [c for c in low if (await r0.svc.claims.get(c))[0].release_requested] == ["low6", "low7"]


async def test_with_the_setting_off_nothing_is_preempted(nats_url):
    async with replicas(nats_url, settings=PlacementSettings(preemption=False)) as [r0]:
        await tenant(r0.svc.bus, "a", GpuQuota())
        await eventually(lambda: "a" in r0.svc.tenants_known)
        low = [f"low{i}" for i in range(8)]
        for claim in low:
            assert await r0.svc.place(await requested(r0.svc.bus, claim, memory_mib=HALF, cores=0))
        assert not await r0.svc.place(await requested(r0.svc.bus, "high", memory_mib=HALF, cores=0, priority=50))
        assert [c for c in low if (await r0.svc.claims.get(c))[0].release_requested] == []
        record, _ = await r0.svc.claims.get("high")
        assert "preempt" not in record.reason
