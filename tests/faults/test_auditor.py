"""The auditor fails when it must: an over-commit in one ledger revision that a later one repairs, a
claim on two nodes at once, an accepted claim with no record, a ledger entry with no live claim, a
dead letter without a reason; and it passes a consistent state."""

from __future__ import annotations

import msgspec
import pytest

from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.events import (
    ClaimRecord, ClaimSpec, DeadLetter, DeviceShare, GpuDevice, GpuQuota, LedgerEntry, NodeInventory,
    NodeLedger, TenantRecord, TenantUsage,
)
from tessera.shared.settings import BusSettings

from auditor import Accepted, Auditor

GPU = GpuDevice(uuid="GPU-a", index=0, model="H100", memory_mib=80000, max_shares=4)


def entry(claim: str, memory: int, cores: int = 10, uuid: str = "GPU-a") -> LedgerEntry:
    return LedgerEntry(claim=claim, tenant="alpha",
                       shares=[DeviceShare(uuid=uuid, index=0, memory_mib=memory, cores=cores)])


async def _system(nats_url):
    bus = await Bus.connect(BusSettings(url=nats_url, file_storage=False), "audit-test")
    await bus.ensure_topology()
    enc = msgspec.json.encode
    for node in ("n0", "n1"):
        await (await bus.kv(subjects.KV_INVENTORY)).put(node, enc(NodeInventory(node=node, devices=[GPU])))
    await (await bus.kv(subjects.KV_TENANTS)).put("alpha", enc(TenantRecord(tenant="alpha", quota=GpuQuota(gpus=4))))
    return bus


@pytest.fixture
async def system(nats_url):
    """The buckets with two one-GPU nodes and a tenant, and an auditor watching from the start."""
    bus = await _system(nats_url)
    auditor = await Auditor.start(nats_url)
    try:
        yield bus, auditor
    finally:
        await auditor.close()
        await bus.close()


async def _put_ledger(bus, node: str, *entries: LedgerEntry) -> None:
    await (await bus.kv(subjects.KV_LEDGER)).put(
        subjects.ledger_node_key(node), msgspec.json.encode(NodeLedger(node=node, entries={e.claim: e for e in entries})))


async def _live(bus, claim: str, node: str, e: LedgerEntry) -> None:
    record = ClaimRecord(claim=claim, tenant="alpha", state="prepared", spec=ClaimSpec(), node=node, devices=e.shares)
    await (await bus.kv(subjects.KV_CLAIMS)).put(claim, msgspec.json.encode(record))
    usage = TenantUsage(tenant="alpha", claims={claim: GpuQuota(gpus=1, memory_mib=e.shares[0].memory_mib,
                                                                cores=e.shares[0].cores)})
    await (await bus.kv(subjects.KV_LEDGER)).put(subjects.ledger_tenant_key("alpha"), msgspec.json.encode(usage))


async def test_a_consistent_state_is_clean(system):
    bus, auditor = system
    e = entry("c1", 20000)
    await _put_ledger(bus, "n0", e)
    await _live(bus, "c1", "n0", e)
    findings = await auditor.audit({"c1": Accepted("c1", "alpha")})
    assert findings.lines() == [] and findings.completed == 1
    assert auditor.ledger.revisions >= 2


async def test_an_overcommit_in_one_revision_is_found_though_the_end_state_is_fine(system):
    bus, auditor = system
    good = entry("c1", 20000)
    await _put_ledger(bus, "n0", good, entry("c2", 70000))  # 90000 MiB on an 80000 MiB GPU
    await _put_ledger(bus, "n0", good)
    await _live(bus, "c1", "n0", good)
    findings = await auditor.audit({"c1": Accepted("c1", "alpha")})
    assert len(findings.revision_overcommits) == 1 and "memory 90000 > 80000" in findings.revision_overcommits[0]
    assert findings.settled and not findings.clean
    assert findings.lost == [] and findings.inconsistent == []


async def test_a_claim_on_two_nodes_a_lost_claim_and_an_orphan_entry_are_found(system):
    bus, auditor = system
    e = entry("c1", 1000)
    await _put_ledger(bus, "n0", e)
    await _put_ledger(bus, "n1", e, entry("orphan", 1000))
    await _live(bus, "c1", "n0", e)
    await bus.publish(subjects.dlq("placement"), DeadLetter(service="placement", subject="x", reason=" ", payload=""))
    findings = await auditor.audit({"c1": Accepted("c1", "alpha"), "gone": Accepted("gone", "alpha")},
                                   expected_letters={"tessera.claims.alpha.bad.requested._"})
    assert any("c1" in d for d in findings.duplicated) and any("c1" in d for d in findings.revision_doubles)
    assert findings.lost == ["gone: accepted but has no record"]
    assert any("orphan" in i for i in findings.inconsistent)
    assert len(findings.dead_letters_without_reason) == 2  # the empty reason, the missing letter



async def test_a_claim_released_for_a_higher_priority_one_is_preempted_any_other_release_lost(system):
    bus, auditor = system
    claims = await bus.kv(subjects.KV_CLAIMS)
    for claim, reason in (("high", "released by its tenant"),
                          ("low", "preempted by high of tenant alpha (priority 100 > 0)"),
                          ("peer", "preempted by low of tenant alpha (priority 0 > 0)"),
                          ("stray", "preempted by nobody of tenant alpha (priority 100 > 0)")):
        record = ClaimRecord(claim=claim, tenant="alpha", state="released", spec=ClaimSpec(), reason=reason)
        await claims.put(claim, msgspec.json.encode(record))
    accepted = {"high": Accepted("high", "alpha", release_requested=True, priority=100),
                "low": Accepted("low", "alpha"), "peer": Accepted("peer", "alpha"), "stray": Accepted("stray", "alpha")}
    findings = await auditor.audit(accepted)
    assert findings.preempted == ["low: by high"]
    assert sorted(f.split(":")[0] for f in findings.lost) == ["peer", "stray"], findings.lost
    assert findings.completed == 2
