"""Placement's invariants, checked at start and periodically, and repaired where a crash left them.

The commit is three writes (quota, ledger, claim record) and an event; a crash, a lost reply or an
exhausted delivery budget between them leaves the buckets disagreeing, and no later message comes to
fix it. What placement owns is repaired here, each repair fenced so that it can never undo a live
decision: by the compare-and-set of the record or ledger it writes, by re-reading the claim's record
right before acting, and by leaving alone anything in flight in this process or younger than
``grace`` seconds (a peer may be between two writes).

- a record ``allocated`` whose event may never have gone out: the event is published again (its
  msg-id makes a copy within the dedup window one message; the enforcer treats a later one as the
  redelivery it is);
- a ledger entry whose claim is released or was never recorded: removed; one whose claim is still
  unplaced (ledger written, record not): the claim is finished through the ordinary place path;
- a claim on a node with no ledger entry: the entry is written back where it still fits;
- quota held for a claim that ended: returned; a live claim of a limited tenant not counted: charged;
- (Kubernetes mode) a claim waiting for room, or allocated and not yet running, whose ResourceClaim
  another allocator allocated meanwhile (kube-scheduler allocating it itself, after taking ours
  back: the translator may see that as one change, or miss it): adopted into the ledger or refused
  (`adoption`), by the status sync; a read of the ResourceClaim (and the ledger) per such claim per
  pass.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.shared import subjects
from tessera.shared.bus import Outgoing
from tessera.shared.errors import ConflictError
from tessera.shared.events import ClaimAllocated, ClaimRecord, ClaimRequested, LedgerEntry, NodeLedger
from tessera.shared.ledger import check_fit, claim_quota
from tessera.shared.lifecycle import ON_NODE, UNPLACED, allocated_msg_id

from tessera.placement.quota import has_limits

if TYPE_CHECKING:
    from tessera.placement.service import PlacementService

log = logging.getLogger("tessera.placement.reconcile")


@dataclass(frozen=True)
class Snapshot:
    records: dict[str, tuple[ClaimRecord, int]]
    nodes: dict[str, NodeLedger]
    where: dict[str, str]  # claim -> the node whose ledger holds it


class Reconciler:
    def __init__(self, service: "PlacementService", period: float, grace: float) -> None:
        self.svc = service
        self.period = period
        self.grace = grace
        self.repairs: Counter[str] = Counter()
        # (claim, record revision) announced again by this process: once is enough (a record that
        # stays ``allocated`` because its node is down must not be announced every pass).
        self.announced: set[tuple[str, int]] = set()

    async def run(self) -> None:
        while True:
            try:
                await self.run_once()
            except Exception:  # a pass that could not read the buckets: the next one tries again
                log.exception("reconcile pass failed; next in %.0fs", self.period)
            await asyncio.sleep(self.period)

    async def run_once(self) -> Counter[str]:
        """One pass over the buckets; returns what it repaired this time, by kind."""
        before = Counter(self.repairs)
        svc = self.svc
        records = await svc.claims.all_with_revisions()
        nodes = await svc.ledger.all_nodes()
        where = {claim: node for node, ledger in nodes.items() for claim in ledger.entries}
        snap = Snapshot(records, nodes, where)
        now = time.time()
        announce = []
        for claim, (record, revision) in records.items():
            if self._busy(claim) or now - record.updated < self.grace:
                continue
            if record.state == "allocated" and not record.release_requested \
                    and (claim, revision) not in self.announced:
                announce.append((record, revision))
            if record.state in ON_NODE and not record.release_requested and claim not in where:
                await self._restore_entry(record)
            if (record.state in UNPLACED or record.state == "allocated") and record.kube is not None \
                    and not record.release_requested:
                svc._kube_recheck(record)
        for node, ledger in nodes.items():
            for claim, entry in ledger.entries.items():
                if not self._busy(claim) and now - entry.ts >= self.grace:
                    await self._check_entry(node, entry, snap)
        await self._check_quota(snap, now)
        await self._announce(announce)
        done = self.repairs - before
        if done:
            log.warning("reconciled: %s", ", ".join(f"{k} {v}" for k, v in sorted(done.items())))
        return done

    def _busy(self, claim: str) -> bool:
        return claim in self.svc.claim_locks or any(claim in t for t in self.svc.tentative.values())

    async def _announce(self, records: list[tuple[ClaimRecord, int]]) -> None:
        if not records:
            return
        await self.svc.bus.publish_many([
            Outgoing(subjects.claim(r.tenant, r.claim, "allocated", r.node),
                     ClaimAllocated(claim=r.claim, tenant=r.tenant, node=r.node, devices=list(r.devices), spec=r.spec),
                     allocated_msg_id(r.claim, len(r.withdrawn)))
            for r, _ in records])
        self.announced.update((r.claim, revision) for r, revision in records)
        self.repairs["allocated republished"] += len(records)

    async def _check_entry(self, node: str, entry: LedgerEntry, snap: Snapshot) -> None:
        claim = entry.claim
        if claim not in snap.records or snap.records[claim][0].state == "released":
            current, _ = await self.svc.claims.get(claim)  # the fence: what the record says now
            if current is None or current.state == "released":
                if await self.svc.ledger.release_entry(node, claim, list(entry.shares)) is not None:
                    self.repairs["orphan entry removed"] += 1
            return
        record = snap.records[claim][0]
        if record.state in UNPLACED and not record.release_requested:
            # Ledger written, record not: finish it the way a redelivery would (the record's CAS fences it).
            try:
                if await self.svc.place(ClaimRequested(claim=claim, tenant=record.tenant, spec=record.spec,
                                                       kube=record.kube)):
                    self.repairs["unrecorded allocation finished"] += 1
            except ConflictError:
                pass  # moved meanwhile: the next pass looks again

    async def _restore_entry(self, record: ClaimRecord) -> None:
        ledger, revision = await self.svc.ledger.read_node(record.node)
        if record.claim in ledger.entries:
            return
        current, _ = await self.svc.claims.get(record.claim)
        if current is None or current.state not in ON_NODE or current.node != record.node \
                or current.release_requested or time.time() - current.updated < self.grace:
            return  # (a record touched meanwhile: a claim being taken off the node, `deallocation`)
        entry = LedgerEntry(claim=record.claim, tenant=record.tenant, shares=list(current.devices),
                            cpu_millis=current.spec.cpu_millis, host_memory_mib=current.spec.host_memory_mib,
                            pod_uid=current.kube.pod_uid if current.kube is not None else "")
        inventory = self.svc.inventories.get(record.node)
        why = "the node left the fleet" if inventory is None else check_fit(inventory.devices, ledger, entry)
        if why is not None:
            self.repairs["claim without entry, GPU taken"] += 1
            log.error("%s runs on %s with no ledger entry, and its GPUs cannot be booked again (%s); "
                      "release it with 'tessera claim release %s'", record.claim, record.node, why, record.claim)
            return
        entries = dict(ledger.entries)
        entries[record.claim] = entry
        try:
            await self.svc.ledger.write_node(NodeLedger(node=record.node, entries=entries), revision)
        except ConflictError:
            return  # the ledger moved: the next pass looks again
        self.repairs["entry restored"] += 1

    async def _check_quota(self, snap: Snapshot, now: float) -> None:
        usages = await self.svc.ledger.all_tenants()
        for tenant, (usage, _) in usages.items():
            for claim in usage.claims:
                held = snap.records.get(claim)
                if self._busy(claim) or (held is not None and held[0].state != "released"):
                    continue
                current, _ = await self.svc.claims.get(claim)  # the fence
                if (current is None or current.state == "released") and claim not in snap.where:
                    if await self.svc.ledger.return_quota(tenant, claim):
                        self.repairs["quota returned"] += 1
        for claim, (record, _) in snap.records.items():
            if record.state not in ON_NODE or self._busy(claim) or now - record.updated < self.grace:
                continue
            counted = usages.get(record.tenant)
            if claim not in snap.where or (counted is not None and claim in counted[0].claims) \
                    or not has_limits(self.svc.quotas.get(record.tenant)):
                continue
            usage, revision = await self.svc.ledger.read_tenant(record.tenant)
            if claim in usage.claims:
                continue
            entry = snap.nodes[snap.where[claim]].entries[claim]
            try:
                await self.svc.ledger.reserve_quota(record.tenant, claim, claim_quota(entry), usage, revision)
                self.repairs["quota charged"] += 1
            except ConflictError:
                pass
