"""What keeps preemption from evicting more than it must, on real buckets (issue 26): a claim
whose PriorityClass says ``preemptionPolicy: Never`` preempts nothing; the room its victims free
is held for the preemptor (its nomination, kept in its claim record) so that another waiting
claim of no higher priority cannot take it first, also on a replica that starts afterwards; and a
retry of the preemptor while its victims are still stopping waits for them instead of choosing
more."""

from __future__ import annotations

from types import SimpleNamespace

from tessera.placement.clusternodes import ClusterNodes
from tessera.placement.preemption import NoVictims
from tessera.placement.service import PlacementService
from tessera.placement.settings import PlacementSettings
from tessera.shared.events import ClaimSpec, DeviceShare, GpuQuota, LedgerEntry, NodeLedger, encode
from tessera.shared.podconstraints import PodConstraints
from tessera.shared.runner import ServiceContext
from tessera.shared.telemetry import Telemetry

from fleetkit import inventory
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


async def test_the_room_freed_is_held_for_the_preemptor_also_on_a_replica_started_later(nats_url):
    async with replicas(nats_url, settings=ON) as [r0]:
        low = await _full(r0.svc)
        high = await requested(r0.svc.bus, "high", memory_mib=HALF, cores=0, priority=50)
        assert not await r0.svc.place(high)
        assert await _marked(r0.svc, low) == ["low7"]
        await _stopped(r0.svc, "low7")

        # A claim of lower priority asking after the victim is gone does not take its room ...
        assert not await r0.svc.place(await requested(r0.svc.bus, "other", memory_mib=HALF, cores=0))
        # ... nor on a replica that starts now (its nomination is read back from the claim record).
        async with replicas(nats_url, settings=ON) as [late]:
            await late.svc._load_pending()
            assert not await late.svc.place(await requested(late.svc.bus, "later", memory_mib=HALF, cores=0))
        record, _ = await r0.svc.claims.get("other")
        assert record.state == "unschedulable", record

        assert await r0.svc.place(high)
        assert await _marked(r0.svc, low) == ["low7"]  # one victim, and the preemptor in its place


async def test_a_retry_while_the_victims_are_stopping_chooses_no_more_of_them(nats_url):
    async with replicas(nats_url, settings=ON) as [r0]:
        low = await _full(r0.svc, priority=5)
        high = await requested(r0.svc.bus, "high", memory_mib=HALF, cores=0, priority=50)
        assert not await r0.svc.place(high)
        assert await _marked(r0.svc, low) == ["low7"]
        # Meanwhile low0 is released and a claim of lower priority takes its place: now the
        # cheapest victim anywhere, but low7 is already stopping for the preemptor.
        await _stopped(r0.svc, "low0")
        assert await r0.svc.place(await requested(r0.svc.bus, "cheap", memory_mib=HALF, cores=0, priority=1))

        assert not await r0.svc.place(high)  # its retry, low7 still stopping
        assert await _marked(r0.svc, low + ["cheap"]) == ["low7"]
        record, _ = await r0.svc.claims.get("high")
        assert "waiting for low7" in record.reason, record.reason

        await _stopped(r0.svc, "low7")
        assert await r0.svc.place(high)
        assert await _marked(r0.svc, low + ["cheap"]) == ["low7"]


def test_victims_are_chosen_only_where_kube_scheduler_could_bind_the_preemptor():
    """A pod that kube-scheduler can bind only to node ``a`` (its nodeSelector) has its victims
    chosen on ``a``, though ``b``'s would cost less: evicted on ``b``, they would free room the pod
    can never use."""
    ctx = ServiceContext(settings=SimpleNamespace(instance="t", service="placement", metrics_legacy=True), bus=None,
                         telemetry=Telemetry("placement", None))
    svc = PlacementService(ctx, ON)
    svc.cluster = ClusterNodes()
    for name, prio in (("a", 5), ("b", 1)):
        svc.view.on_inventory(name, encode(inventory(name, gpus=1)), 1, "PUT")
        svc.cluster.set_node({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                              "spec": {}, "status": {"allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"}}})
        full = LedgerEntry(claim=f"low-{name}", tenant="a", priority=prio,
                           shares=[DeviceShare(index=0, uuid=f"GPU-{name}-0", memory_mib=81920, cores=0)])
        svc.view.remember(name, NodeLedger(node=name, entries={full.claim: full}), 1)
    spec = ClaimSpec(memory_mib=HALF, priority=50, pod=PodConstraints(node_selector={"kubernetes.io/hostname": "a"}))
    chosen = svc.preemptions.choose("high", spec, set(), svc.excluded_nodes(spec))
    assert not isinstance(chosen, NoVictims), chosen
    node, victims = chosen
    assert (node, victims.claims) == ("a", ["low-a"])
