"""Placement's reconciler repairs what a crash between the commit's writes leaves (window 5 and the
ledger / quota invariants of issue 12), and never touches a claim that is in flight."""

from __future__ import annotations

import asyncio

from tessera.shared import subjects
from tessera.shared.claimstore import ClaimStore
from tessera.shared.events import ClaimRecord, ClaimSpec, DeviceShare, GpuQuota, LedgerEntry, NodeLedger, \
    claim_decoder

from kit import eventually
from placementkit import replicas, requested, tenant


def share(node: str, gpu: int) -> DeviceShare:
    return DeviceShare(uuid=f"GPU-{node}-{gpu}", index=gpu, memory_mib=1000, cores=10)


def entry(claim: str, node: str, gpu: int = 0, tenant_name: str = "a") -> LedgerEntry:
    return LedgerEntry(claim=claim, tenant=tenant_name, shares=[share(node, gpu)], ts=0.0)


async def record(svc, claim: str, state: str, node: str = "", devices=(), tenant_name: str = "a") -> None:
    await ClaimStore(svc.claims.kv).create(ClaimRecord(claim=claim, tenant=tenant_name, state=state,
                                                       spec=ClaimSpec(memory_mib=1000, cores=10), node=node,
                                                       devices=list(devices), updated=0.0))


async def test_an_allocated_record_whose_event_never_went_out_is_announced_again(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        svc.reconciler.grace = 0
        got: list = []
        async def heard(msg) -> None:
            got.append(claim_decoder.decode(msg.data))

        sub = await svc.bus.listen(subjects.claims_of_kind("allocated"), heard)
        await svc.ledger.write_node(NodeLedger(node="n1", entries={"c": entry("c", "n1")}), None)
        await record(svc, "c", "allocated", "n1", [share("n1", 0)])
        done = await svc.reconciler.run_once()
        await eventually(lambda: _some(got))
        await sub.unsubscribe()
        assert done["allocated republished"] == 1
        assert got[0].claim == "c" and got[0].node == "n1" and got[0].devices == [share("n1", 0)]
        assert (await svc.reconciler.run_once())["allocated republished"] == 0  # once per revision


async def _some(items) -> bool:
    await asyncio.sleep(0)
    return bool(items)


async def test_ledger_entries_without_a_live_claim_go_and_unrecorded_allocations_are_finished(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        svc.reconciler.grace = 0
        await tenant(svc.bus, "a")
        await eventually(lambda: _known(svc, "a"))
        await record(svc, "gone", "released", "n1", [share("n1", 0)])
        event = await requested(svc.bus, "half")  # ledger written, record not (a crash)
        await svc.ledger.write_node(NodeLedger(node="n1", entries={
            "gone": entry("gone", "n1", 0), "never": entry("never", "n1", 1)}), None)
        await svc.ledger.write_node(NodeLedger(node="n2", entries={"half": entry("half", "n2", 0)}), None)
        await eventually(lambda: _holds(svc, "n2", "half"))
        done = await svc.reconciler.run_once()
        assert done["orphan entry removed"] == 2
        assert done["unrecorded allocation finished"] == 1
        assert (await svc.ledger.read_node("n1"))[0].entries == {}
        half = (await svc.claims.get("half"))[0]
        assert half.state == "allocated" and half.node == "n2" and half.devices == [share("n2", 0)]
        assert event.claim == "half"


async def _known(svc, name) -> bool:
    return name in svc.tenants_known


async def _holds(svc, node, claim) -> bool:
    return claim in svc.node_ledgers.get(node, (NodeLedger(node=node), None))[0].entries


async def test_a_live_claim_whose_entry_vanished_is_booked_again_where_it_still_fits(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        svc.reconciler.grace = 0
        await record(svc, "c", "running", "n1", [share("n1", 1)])
        done = await svc.reconciler.run_once()
        assert done["entry restored"] == 1
        assert (await svc.ledger.read_node("n1"))[0].entries["c"].shares == [share("n1", 1)]
        assert (await svc.reconciler.run_once())["entry restored"] == 0  # nothing left to do


async def test_quota_follows_the_live_claims(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        svc.reconciler.grace = 0
        await tenant(svc.bus, "a", GpuQuota(gpus=4))
        await eventually(lambda: _limited(svc, "a"))
        await record(svc, "ended", "released", "n1", [share("n1", 0)])
        await record(svc, "live", "prepared", "n1", [share("n1", 1)])
        await svc.ledger.write_node(NodeLedger(node="n1", entries={"live": entry("live", "n1", 1)}), None)
        usage, revision = await svc.ledger.read_tenant("a")
        await svc.ledger.reserve_quota("a", "ended", GpuQuota(gpus=1), usage, revision)
        done = await svc.reconciler.run_once()
        assert done["quota returned"] == 1 and done["quota charged"] == 1
        assert set((await svc.ledger.read_tenant("a"))[0].claims) == {"live"}


async def _limited(svc, name) -> bool:
    return svc.quotas.get(name) is not None and svc.quotas[name].gpus == 4


async def test_a_claim_in_flight_here_is_left_alone(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        svc.reconciler.grace = 0
        await record(svc, "busy", "released")
        await svc.ledger.write_node(NodeLedger(node="n1", entries={"busy": entry("busy", "n1")}), None)
        async with svc.claim_locks.setdefault("busy", asyncio.Lock()):
            assert not await svc.reconciler.run_once()
        assert "busy" in (await svc.ledger.read_node("n1"))[0].entries
