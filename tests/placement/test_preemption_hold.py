"""What keeps preemption from evicting more than it must, on real buckets (issue 26): a claim
whose PriorityClass says ``preemptionPolicy: Never`` preempts nothing."""

from __future__ import annotations

from tessera.placement.settings import PlacementSettings
from tessera.shared.events import GpuQuota

from kit import eventually
from placementkit import replicas, requested, tenant

HALF = 40960  # MiB: two fill one 81,920 MiB GPU of placementkit's nodes
ON = PlacementSettings(preemption=True)


async def _full(svc, priority: int = 0) -> list[str]:
    """Tenant ``a`` and eight half-GPU claims of ``priority`` filling both nodes' GPUs."""
    await tenant(svc.bus, "a", GpuQuota())
    await eventually(lambda: "a" in svc.tenants_known)
    low = [f"low{i}" for i in range(8)]
    for claim in low:
        assert await svc.place(await requested(svc.bus, claim, memory_mib=HALF, cores=0, priority=priority))
    return low


async def _marked(svc, claims: list[str]) -> list[str]:
    return [c for c in claims if (await svc.claims.get(c))[0].release_requested]


async def _stopped(svc, claim: str) -> None:
    """What the victim's enforcer does once its processes are gone: its ledger entry removed."""
    node = svc.claim_nodes[claim]
    await svc.ledger.release_entry(node, claim)
    await eventually(lambda: claim not in svc.claim_nodes, what=f"{claim} gone from the view")


async def test_a_claim_whose_priority_class_never_preempts_waits_saying_so(nats_url):
    async with replicas(nats_url, settings=ON) as [r0]:
        low = await _full(r0.svc)
        event = await requested(r0.svc.bus, "polite", memory_mib=HALF, cores=0, priority=50, may_preempt=False)
        assert not await r0.svc.place(event)
        assert await _marked(r0.svc, low) == []
        record, _ = await r0.svc.claims.get("polite")
        assert record.state == "unschedulable"
        assert "preemptionPolicy: Never" in record.reason, record.reason
