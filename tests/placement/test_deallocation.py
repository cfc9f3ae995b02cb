"""A claim kube-scheduler took back is taken off its node and placed again (`deallocation`), on real
buckets: the ledger entry and quota given back, the record back through ``requested`` with the node
in ``withdrawn``, placed elsewhere; a repeat, a stale event and a stop between the steps change
nothing or finish what was begun."""

from __future__ import annotations

from functools import partial

import msgspec

from tessera.shared.events import ClaimDeallocated, ClaimRecord, ClaimRequested, ClaimSpec, GpuQuota
from tessera.shared.kubeclaims import KubeClaimRef
from tessera.shared.podconstraints import PodConstraints, Toleration

from kit import eventually
from placementkit import replicas, tenant

REF = KubeClaimRef(namespace="ns", name="train-gpu", uid="00000000-0000-4000-8000-000000000001", pod="train",
                   pod_uid="00000000-0000-4000-8000-0000000000aa")
CLAIM = "k8s-00000000-0000-4000-8000-000000000001"


async def _allocated_on(svc, node: str) -> ClaimRecord:
    """The claim placed by placement on ``node`` (the record, the ledger entry, the quota)."""
    spec = ClaimSpec(memory_mib=1000, cores=10, pod=PodConstraints())
    await svc.claims.create(ClaimRecord(claim=CLAIM, tenant="a", state="requested", spec=spec, kube=REF))
    place = svc.placer.place
    svc.placer.place = partial(place, exclude_nodes={"n1", "n2"} - {node})
    try:
        assert await svc.place(ClaimRequested(claim=CLAIM, tenant="a", spec=spec, kube=REF))
    finally:
        svc.placer.place = place
    record, _ = await svc.claims.get(CLAIM)
    assert record.state == "allocated" and record.node == node
    return record


async def _state(svc) -> tuple[ClaimRecord, dict[str, set[str]], set[str]]:
    record, _ = await svc.claims.get(CLAIM)
    nodes = {n: set(lg.entries) for n, lg in (await svc.ledger.all_nodes()).items()}
    usage, _ = await svc.ledger.read_tenant("a")
    return record, nodes, set(usage.claims)


def _dealloc(node: str, pod: PodConstraints | None = None) -> ClaimDeallocated:
    return ClaimDeallocated(claim=CLAIM, tenant="a", node=node, pod=pod, kube=REF)


async def test_a_claim_taken_back_is_placed_on_another_node_with_the_pods_constraints_of_now(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a", GpuQuota(gpus=4))
        await eventually(lambda: "a" in svc.tenants_known)
        await _allocated_on(svc, "n1")
        tighter = PodConstraints(tolerations=[Toleration(key="gpu", operator="Exists")])
        assert await svc.deallocations.handle(_dealloc("n1", tighter))
        record, nodes, quota = await _state(svc)
        assert record.state == "allocated" and record.node == "n2" and record.withdrawn == ["n1"]
        assert record.spec.pod == tighter
        assert CLAIM in nodes["n2"] and CLAIM not in nodes.get("n1", set())
        assert quota == {CLAIM}  # given back on n1, charged again for n2
        entry = (await svc.ledger.read_node("n2"))[0].entries[CLAIM]
        assert entry.pod_uid == REF.pod_uid
        assert svc.counts["withdrawn"] == 1
        # the same event again (a redelivery), and one about a node it is not on: nothing changes
        assert not await svc.deallocations.handle(_dealloc("n1", tighter))
        assert not await svc.deallocations.handle(_dealloc("n3"))
        assert (await _state(svc))[0].node == "n2" and svc.counts["withdrawn"] == 1


async def test_taken_back_from_every_node_it_goes_where_it_fits_rather_than_nowhere(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a")
        await eventually(lambda: "a" in svc.tenants_known)
        await _allocated_on(svc, "n1")
        assert await svc.deallocations.handle(_dealloc("n1"))
        assert (await _state(svc))[0].node == "n2"
        assert await svc.deallocations.handle(_dealloc("n2"))
        record, nodes, _ = await _state(svc)
        assert record.node == "n1" and record.withdrawn == ["n1", "n2"]
        assert CLAIM in nodes["n1"] and CLAIM not in nodes.get("n2", set())


async def test_a_stop_between_the_steps_is_finished_by_the_redelivery(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a")
        await eventually(lambda: "a" in svc.tenants_known)
        await _allocated_on(svc, "n1")
        # stopped after the ledger entry was given back, before the record moved
        await svc.ledger.give_back("a", CLAIM, "n1")
        assert await svc.deallocations.handle(_dealloc("n1"))
        record, nodes, _ = await _state(svc)
        assert record.node == "n2" and record.withdrawn == ["n1"] and CLAIM in nodes["n2"]
        # stopped after the record moved back to requested, before the claim was placed again
        current, revision = await svc.claims.get(CLAIM)
        await svc.ledger.give_back("a", CLAIM, "n2")
        await svc.claims.replace(msgspec.structs.replace(current, state="requested", node="", devices=[],
                                                         withdrawn=["n1", "n2"]), revision)
        assert await svc.deallocations.handle(_dealloc("n2"))
        record, nodes, _ = await _state(svc)
        assert record.state == "allocated" and CLAIM in nodes[record.node]


async def test_a_claim_being_released_is_not_placed_again(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a")
        await eventually(lambda: "a" in svc.tenants_known)
        await _allocated_on(svc, "n1")
        await svc.claims.mark_release_requested(CLAIM, "resourceclaim-deleted")
        assert not await svc.deallocations.handle(_dealloc("n1"))
        record, nodes, _ = await _state(svc)
        assert record.node == "n1" and CLAIM in nodes["n1"]
