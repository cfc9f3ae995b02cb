"""Fair share across tenants (issue 26), on real buckets: a tenant's quota is what it is guaranteed,
idle capacity may be borrowed beyond it up to its borrowing limit and no further, a claim so placed
is marked borrowing in its ledger entry, and a tenant asking within its own guarantee reclaims
other tenants' borrowing claims (whatever their priority), never a claim within its tenant's
guarantee; when several borrowers wait for the same room the one of the lowest share over weight
goes first. Without a borrowing limit the quota is the hard wall it was.

Placement's fleet here: two nodes of two 81,920 MiB GPUs; each claim asks half a GPU, so the fleet
holds eight, and a quota of ``gpus`` counts shares (one a claim)."""

from __future__ import annotations

import asyncio

from tessera.placement.settings import PlacementSettings
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.events import GpuQuota

from kit import eventually
from placementkit import replicas, requested, tenant

HALF = 40960  # MiB: two fill one GPU
ON = PlacementSettings(preemption=True)


async def _tenants(svc, **records) -> None:
    for name, fields in records.items():
        await tenant(svc.bus, name, **fields)
    await eventually(lambda: all(n in svc.view.tenant_records for n in records), what="the tenants known")


async def _entry(svc, claim: str):
    ledger, _ = await svc.ledger.read_node(svc.claim_nodes[claim])
    return ledger.entries[claim]


async def _ask(svc, claim: str, who: str, **spec) -> bool:
    return await svc.place(await requested(svc.bus, claim, who, memory_mib=HALF, cores=0, **spec))


async def _record(svc, claim: str):
    return (await svc.claims.get(claim))[0]


async def _marked(svc, claims) -> list[str]:
    return [c for c in claims if (await _record(svc, c)).release_requested]


async def _stopped(svc, claim: str) -> None:
    """What the victim's enforcer does once its processes are gone: its ledger entry and quota given back."""
    record = await _record(svc, claim)
    await svc.ledger.give_back(record.tenant, claim, svc.claim_nodes[claim])
    await eventually(lambda: claim not in svc.claim_nodes, what=f"{claim} gone from the view")


async def test_a_tenant_borrows_idle_capacity_up_to_its_limit_and_no_further(nats_url):
    async with replicas(nats_url, settings=ON) as [r0]:
        svc = r0.svc
        await _tenants(svc, b={"quota": GpuQuota(gpus=2), "borrowing_limit": GpuQuota(gpus=2)},
                       c={"quota": GpuQuota(gpus=2)})
        for i in range(4):
            assert await _ask(svc, f"b{i}", "b")
        assert [(await _entry(svc, f"b{i}")).borrowing for i in range(4)] == [False, False, True, True]

        assert not await _ask(svc, "b4", "b")  # the fleet has room; the limit has not
        record = await _record(svc, "b4")
        assert record.state == "unschedulable"
        assert record.reason == "tenant quota and borrowing limit exceeded: gpus 5 > 4 GPUs", record.reason

        # No borrowing limit: the quota is the wall it was, said as before, with room to spare.
        assert await _ask(svc, "c0", "c") and await _ask(svc, "c1", "c")
        assert not (await _entry(svc, "c1")).borrowing
        assert not await _ask(svc, "c2", "c")
        assert (await _record(svc, "c2")).reason == "tenant quota exceeded: gpus 3 > 2 GPUs"


async def test_a_non_preemptible_claim_may_not_borrow(nats_url):
    async with replicas(nats_url, settings=ON) as [r0]:
        svc = r0.svc
        await _tenants(svc, b={"quota": GpuQuota(gpus=1), "borrowing_limit": GpuQuota(gpus=4)})
        assert await _ask(svc, "kept", "b", preemptible=False)  # within the guarantee: placed
        assert not await _ask(svc, "more", "b", preemptible=False)
        reason = (await _record(svc, "more")).reason
        assert reason.startswith("tenant quota exceeded: gpus 2 > 1 GPUs; a non-preemptible claim may not borrow"), \
            reason


async def test_the_owner_reclaims_only_other_tenants_borrowing_and_never_below_their_guarantee(nats_url):
    async with replicas(nats_url, settings=ON) as [r0]:
        svc = r0.svc
        await _tenants(svc, a={"quota": GpuQuota(gpus=8)},
                       b={"quota": GpuQuota(gpus=2), "borrowing_limit": GpuQuota(gpus=6)},
                       c={})  # no quota: nothing it holds is borrowed
        assert await _ask(svc, "c0", "c")
        lender = [f"b{i}" for i in range(7)]
        for claim in lender:  # b's claims outrank a's: reclaim goes by the guarantee, not priority
            assert await _ask(svc, claim, "b", priority=100)
        assert [(await _entry(svc, c)).borrowing for c in lender] == [False] * 2 + [True] * 5
        # b gives back its two guaranteed claims: of the five marked borrowing, three are beyond
        # its guarantee of two now; the last two are within it and must not be reclaimed.
        for claim in ("b0", "b1"):
            await _stopped(svc, claim)
        assert await _ask(svc, "a0", "a") and await _ask(svc, "a1", "a")  # the idle room first

        victims: list[str] = []
        for claim in ("a2", "a3", "a4"):
            assert not await _ask(svc, claim, "a")  # no room: b's borrowing is reclaimed for it
            marked = [c for c in await _marked(svc, lender) if c not in victims]
            assert len(marked) == 1, marked
            record = await _record(svc, marked[0])
            assert record.reason == (f"preempted by {claim} of tenant a: reclaimed by tenant a for its guarantee "
                                     f"({marked[0]} was borrowing beyond tenant b's quota)"), record.reason
            waiting = await _record(svc, claim)
            assert f"preempting {marked[0]}" in waiting.reason and waiting.nominated.reclaim, waiting
            await _stopped(svc, marked[0])
            if claim == "a2":  # the room is held for a, even against a borrower of higher priority
                assert not await _ask(svc, "b7", "b", priority=100)
                assert (await _record(svc, "b7")).state == "unschedulable"
            assert await _ask(svc, claim, "a")  # placed once the victim is gone
            victims += marked

        # b holds exactly its guarantee now; c never borrowed: nothing more is reclaimed for a.
        assert not await _ask(svc, "a5", "a")
        left = [c for c in lender[2:] if c not in victims]
        assert len(left) == 2 and await _marked(svc, left + ["c0"]) == []
        reason = (await _record(svc, "a5")).reason
        assert "nothing to preempt" in reason and "borrowing" in reason, reason


async def test_reclaim_never_takes_a_tenant_below_its_guarantee(nats_url):
    """Claims of 50,000 MiB, one a GPU. b's two claims on n1 were both placed as borrowing, but with
    its guaranteed one given back only one of them lies beyond its guarantee: a claim of a's that
    needs both of n1's GPUs may not have both."""
    big = {"memory_mib": 50000, "cores": 0}
    async with replicas(nats_url, settings=ON) as [r0]:
        svc = r0.svc
        await _tenants(svc, a={"quota": GpuQuota(gpus=8)},
                       b={"quota": GpuQuota(gpus=1), "borrowing_limit": GpuQuota(gpus=3)}, c={})
        assert await svc.place(await requested(svc.bus, "c0", "c", node="n2", **big))
        for claim, node in (("b0", "n2"), ("b1", "n1"), ("b2", "n1")):
            assert await svc.place(await requested(svc.bus, claim, "b", node=node, **big))
        assert [(await _entry(svc, c)).borrowing for c in ("b1", "b2")] == [True, True]
        await _stopped(svc, "b0")
        assert await svc.place(await requested(svc.bus, "a0", "a", node="n2", **big))

        assert not await svc.place(await requested(svc.bus, "pair", "a", gpus=2, node="n1", **big))
        assert await _marked(svc, ["b1", "b2", "c0"]) == []
        reason = (await _record(svc, "pair")).reason
        assert "nothing to preempt" in reason, reason


async def test_a_claim_beyond_its_own_guarantee_reclaims_nothing(nats_url):
    async with replicas(nats_url, settings=ON) as [r0]:
        svc = r0.svc
        await _tenants(svc, a={"quota": GpuQuota(gpus=1), "borrowing_limit": GpuQuota(gpus=8)},
                       b={"quota": GpuQuota(gpus=1), "borrowing_limit": GpuQuota(gpus=8)})
        assert await _ask(svc, "a0", "a")
        for i in range(7):
            assert await _ask(svc, f"b{i}", "b")
        assert not await _ask(svc, "a1", "a")  # a would borrow too: it may not take b's borrowing
        assert await _marked(svc, [f"b{i}" for i in range(7)]) == []
        assert "beyond its tenant's guarantee" in (await _record(svc, "a1")).reason


async def test_the_borrower_of_the_lowest_share_over_weight_goes_first(nats_url):
    async with replicas(nats_url, settings=ON) as [r0]:
        svc = r0.svc
        fair = {"quota": GpuQuota(gpus=1), "borrowing_limit": GpuQuota(gpus=8)}
        await _tenants(svc, filler={}, light=fair | {"weight": 1}, heavy=fair | {"weight": 3})
        fillers = [f"f{i}" for i in range(6)]
        for claim in fillers:
            assert await _ask(svc, claim, "filler")
        assert await _ask(svc, "light0", "light") and await _ask(svc, "heavy0", "heavy")
        # Both want to borrow a share of a full fleet; light asked first.
        assert not await _ask(svc, "light1", "light")
        assert not await _ask(svc, "heavy1", "heavy")
        retry = asyncio.create_task(svc._retry_loop())
        try:
            await _stopped(svc, "f0")  # room for one: heavy's share over weight is the lower (1/8 / 3)
            await eventually(lambda: "heavy1" in svc.claim_nodes, what="heavy1 placed")
            assert "light1" in svc.pending and (await _entry(svc, "heavy1")).borrowing
            await _stopped(svc, "f1")
            await eventually(lambda: "light1" in svc.claim_nodes, what="light1 placed")
        finally:
            await cancel_and_wait([retry])
