"""An allocation of a Tessera claim that Tessera did not write is adopted into the ledger when it fits,
and refused otherwise: never two allocators, on the real control plane.

Defect 8 of the review, its second half: anyone with the rights can write a ResourceClaim's
``status.allocation`` — kube-scheduler itself, which after taking placement's allocation back finds
the devices in the ResourceSlices and allocates the claim on its next try; another allocator; a
person. Placement then found "another allocation" where it meant to write its own, gave its GPUs
back and left the other standing: the ledger held nothing for a claim the cluster said was
allocated (the enforcer refuses to prepare it, the pod never starts; or the ledger hands the same
GPU to a second claim). Now an allocation that fits is adopted into the ledger (the pod is told),
one that does not is taken out of the claim with a Warning on the pod, and Tessera allocates the
claim itself.

Real: kube-apiserver, kube-scheduler (allocating from ResourceSlices in the race test, its identity
writing the foreign allocations elsewhere), the resourceclaim and node lifecycle controllers;
translator and placement as their service accounts (`tesseraworld`).
"""

from __future__ import annotations

import datetime as dt
import uuid

from tessera.shared import subjects
from tessera.shared.events import ClaimSpec
from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import DRIVER, RESOURCE_API_VERSION, claim_id
from tessera.shared.ledger import Ledger
from tessera.shared.quantity import whole_mib

from tessera.placement.claimstatus import node_selector, share_id

from kit import eventually
from tesseraworld import NOT_READY, ZONE, World


async def _as_scheduler(world: World, claim: dict, node: str, memory: str, cores: str) -> str:
    """Write an allocation of ``node``'s gpu-0 into ``claim`` as kube-scheduler would (its identity,
    a share id of its own); the share id."""
    api = KubeApi.for_kubeconfig(world.plane.workdir / "scheduler.kubeconfig")
    share = str(uuid.uuid4())
    meta = claim["metadata"]
    path = object_path(RESOURCE_API_VERSION, "resourceclaims", meta["name"], meta["namespace"])
    try:
        current = await api.get(path)
        assert current is not None
        current["status"] = {**(current.get("status") or {}), "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0",
                                     "shareID": share,
                                     "consumedCapacity": {"memory": memory, "cores": cores, "shares": "1"}}]},
            "nodeSelector": node_selector(node),
            # (kube-scheduler stamps what it allocates; one without a stamp it cannot reserve for the pod)
            "allocationTimestamp": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}}
        await api.replace_status(path, current)
    finally:
        await api.close()
    return share


async def _entries(world: World) -> dict:
    return {node: ledger.entries for node, ledger in (await Ledger(await world.bus.kv(subjects.KV_LEDGER)).all_nodes()).items()}


def _results(allocation: dict | None) -> list[dict]:
    return ((allocation or {}).get("devices") or {}).get("results") or []


async def _reasons(world: World, pod: str) -> dict[str, str]:
    return {e["reason"]: e["message"] for e in await world.events(pod)}


async def test_an_allocation_another_allocator_wrote_that_fits_is_adopted_and_the_pod_binds(world, nats_url):
    await world.node("one")
    two = await world.node("two")
    # The claim is allocated before Tessera places it, on a node of kube-scheduler's choosing
    _, claim = await world.pods.create(world.ns, "adopted", ClaimSpec(memory_mib=10240, cores=20),
                                       pod_spec={"tolerations": NOT_READY})
    cid = claim_id(claim["metadata"]["uid"])
    share = await _as_scheduler(world, claim, two, "12Gi", "25")
    async with world.tessera(nats_url):
        assert await eventually(lambda: world.bound_to("adopted"), timeout=90, what="the pod bound") == two
        [result] = _results(await world.allocation(claim))
        assert result["shareID"] == share  # the allocation written is the one that stands
        entries = await _entries(world)
        [held] = entries[two][cid].shares
        assert (held.index, held.memory_mib, held.cores) == (0, 12288, 25)
        assert all(cid not in e for node, e in entries.items() if node != two)
        record = await world.record(cid)
        assert record.state == "allocated" and record.node == two and list(record.devices) == [held]
        assert record.reason == f"adopted the allocation another allocator wrote on {two}"
        reasons = await eventually(lambda: _has(world, "adopted", "AllocationAdopted"), timeout=30)
        assert "another allocator on node" in reasons["AllocationAdopted"]


async def test_an_allocation_on_a_node_the_scheduler_would_not_bind_the_pod_to_is_refused(world, nats_url):
    # Its devices are free, but kube-scheduler's filters refuse the pod there: a cordon, a taint it
    # does not tolerate, its nodeSelector, too little CPU. Adopted, the gate lifted, the pod could
    # be bound nowhere (the allocation pins it there): each is refused, placed where it can run.
    bad = {"cordoned": ("NodeUnschedulable", await world.node("cordoned", unschedulable=True)),
           "tainted": ("TaintToleration", await world.node("tainted", taints=(
               {"key": "example.com/maintenance", "value": "true", "effect": "NoSchedule"},))),
           "elsewhere": ("NodeAffinity", await world.node("elsewhere", zone="b")),
           "small": ("NodeResourcesFit", await world.node("small", cpu="1"))}
    good = await world.node("good")
    claims = {}
    for pod, (_, node) in bad.items():
        _, claim = await world.pods.create(world.ns, pod, ClaimSpec(memory_mib=10240, cores=20),
                                           pod_spec={"nodeSelector": {ZONE: "a"}, "tolerations": NOT_READY},
                                           requests={"cpu": "2"})
        claims[pod] = claim
        await _as_scheduler(world, claim, node, "10Gi", "20")
    async with world.tessera(nats_url):
        for pod, (filter_, node) in bad.items():
            assert await eventually(lambda p=pod: world.bound_to(p), timeout=90, what=f"pod {pod} bound") == good
            [result] = _results(await world.allocation(claims[pod]))
            cid = claim_id(claims[pod]["metadata"]["uid"])
            assert (result["pool"], result["shareID"]) == (good, share_id(cid, good, 0))  # Tessera's own
            reasons = await eventually(lambda p=pod: _has(world, p, "AllocationRefused"), timeout=30)
            assert f"kube-scheduler's {filter_} filter refuses the pod on node {node}" in reasons["AllocationRefused"]
            assert "AllocationAdopted" not in reasons
        entries = await _entries(world)
        assert all(not entries.get(node) for _, node in bad.values())
        assert len(entries[good]) == len(bad)


async def test_an_allocation_that_does_not_fit_is_refused_and_tessera_allocates_the_claim(world, nats_url):
    one = await world.node("one")
    async with world.tessera(nats_url):
        await world.pods.create(world.ns, "first", ClaimSpec(memory_mib=60000, cores=50),
                                pod_spec={"tolerations": NOT_READY})
        assert await eventually(lambda: world.bound_to("first"), timeout=90, what="the first pod bound") == one
        # a pod no node fits yet (the one GPU has too little memory left), whose claim someone else
        # allocates on the GPU the first pod holds most of: 60000 + 30720 MiB > 81559 MiB
        _, claim = await world.pods.create(world.ns, "second", ClaimSpec(memory_mib=30000, cores=20),
                                           pod_spec={"tolerations": NOT_READY})
        cid = claim_id(claim["metadata"]["uid"])
        await eventually(lambda: _unschedulable(world, cid), timeout=60, what="the second claim waiting")
        await _as_scheduler(world, claim, one, "30Gi", "40")
        two = await world.node("two")  # Tessera places the claim now, and finds that allocation
        assert await eventually(lambda: world.bound_to("second"), timeout=90, what="the second pod bound") == two
        [result] = _results(await world.allocation(claim))
        assert (result["pool"], result["shareID"]) == (two, share_id(cid, two, 0))  # Tessera's own
        entries = await _entries(world)
        assert cid in entries[two] and cid not in entries[one]
        assert (await world.record(cid)).reason == ""  # (placed, not adopted)
        reasons = await eventually(lambda: _has(world, "second", "AllocationRefused"), timeout=30)
        assert "refused that allocation and removed it: its devices are not free in Tessera's ledger" \
            in reasons["AllocationRefused"] and f"allocates the claim itself on node {two}" in reasons["AllocationRefused"]


async def test_an_allocation_written_into_a_waiting_claim_that_does_not_fit_is_refused(world, nats_url):
    one = await world.node("one")
    async with world.tessera(nats_url, reconcile_seconds=1.0, reconcile_grace_seconds=0.5):
        await world.pods.create(world.ns, "whole", ClaimSpec(memory_mib=40000, cores=100),
                                pod_spec={"tolerations": NOT_READY})
        assert await eventually(lambda: world.bound_to("whole"), timeout=90, what="the first pod bound") == one
        _, claim = await world.pods.create(world.ns, "waits", ClaimSpec(memory_mib=10240, cores=20),
                                           pod_spec={"tolerations": NOT_READY})
        cid = claim_id(claim["metadata"]["uid"])
        await eventually(lambda: _unschedulable(world, cid), timeout=60, what="the claim waiting for the GPU")
        # someone else allocates the waiting claim on the GPU the first pod has to itself
        await _as_scheduler(world, claim, one, "10Gi", "20")
        reasons = await eventually(lambda: _has(world, "waits", "AllocationRefused"), timeout=60,
                                   what="the refusal reported")
        assert "its devices are not free in Tessera's ledger" in reasons["AllocationRefused"]
        assert "Tessera allocates the claim itself once it fits" in reasons["AllocationRefused"]
        assert await world.allocation(claim) is None
        assert cid not in (await _entries(world))[one]
        assert (await world.record(cid)).state == "unschedulable" and await world.bound_to("waits") is None


async def test_the_scheduler_allocating_a_claim_it_took_back_leaves_ledger_and_cluster_agreeing(world, nats_url):
    # ResourceSlices too: once kube-scheduler takes placement's allocation back, it can allocate
    # the claim itself on its next try, racing placement placing it again (the deallocation race).
    # Where it wins and binds the pod at once, the translator may see the claim go from one
    # allocation to the other and the pod bound, no deallocation: placement's reconciler finds it.
    one = await world.node("one", slices=True)
    two = await world.node("two", slices=True)
    async with world.tessera(nats_url, reconcile_seconds=2.0, reconcile_grace_seconds=1.0):
        claim, placed = await world.held_pod("raced", ClaimSpec(memory_mib=10240, cores=20))
        cid = claim_id(claim["metadata"]["uid"])
        other = two if placed == one else one
        await world.cordon_and_let_go(placed, "raced")
        assert await eventually(lambda: world.bound_to("raced"), timeout=90, what="the pod bound") == other
        # whoever won, the ledger holds exactly what the claim says, and nothing on the cordoned node
        async def agreeing():
            [result] = _results(await world.allocation(claim))
            entries = await _entries(world)
            held = entries.get(other, {}).get(cid)
            record = await world.record(cid)
            if held is None or cid in entries.get(placed, {}) or record.node != other:
                return None
            [share] = held.shares
            return (result["pool"], result["device"], whole_mib(result["consumedCapacity"]["memory"])) == \
                (other, f"gpu-{share.index}", share.memory_mib)
        assert await eventually(agreeing, timeout=60, what="the ledger agreeing with the claim")


async def test_a_claim_the_scheduler_took_back_and_allocated_itself_while_tessera_was_down_is_adopted(world, nats_url):
    # The deallocation race decided the scheduler's way every time: no Tessera to place the claim
    # again while kube-scheduler takes the allocation back and allocates the claim itself.
    one = await world.node("one", slices=True)
    two = await world.node("two", slices=True)
    async with world.tessera(nats_url):
        claim, placed = await world.held_pod("moved", ClaimSpec(memory_mib=10240, cores=20))
    cid = claim_id(claim["metadata"]["uid"])
    other = two if placed == one else one
    await world.cordon_and_let_go(placed, "moved")
    assert await eventually(lambda: world.bound_to("moved"), timeout=90, what="the pod bound by the scheduler") == other
    [result] = _results(await world.allocation(claim))
    assert result["pool"] == other and result["shareID"] != share_id(cid, other, 0)  # the scheduler's own
    async with world.tessera(nats_url):
        reasons = await eventually(lambda: _has(world, "moved", "AllocationAdopted"), timeout=60,
                                   what="the adoption reported")
        assert f"another allocator on node {other}" in reasons["AllocationAdopted"]
        entries = await _entries(world)
        [held] = entries[other][cid].shares
        assert (f"gpu-{held.index}", held.memory_mib) == (result["device"], whole_mib(result["consumedCapacity"]["memory"]))
        assert cid not in entries.get(placed, {})
        record = await world.record(cid)
        assert record.state == "allocated" and record.node == other and list(record.devices) == [held]
        assert _results(await world.allocation(claim)) == [result]  # the scheduler's allocation stands


async def _has(world: World, pod: str, reason: str) -> dict[str, str] | None:
    reasons = await _reasons(world, pod)
    return reasons if reason in reasons else None


async def _unschedulable(world: World, cid: str):
    record = await world.record(cid)
    return record if record is not None and record.state == "unschedulable" else None
