"""An allocation of a Tessera claim that Tessera did not write is adopted when it fits: never two allocators.

Placement is meant to be the one allocator of ``gpu.tessera.dev`` devices, but anyone with the rights
can write a ResourceClaim's ``status.allocation``: kube-scheduler itself, which after taking
placement's allocation back (its PostFilter, when it cannot bind the pod there) finds the devices in
the node's ResourceSlices and allocates the claim on its next try, often before placement has placed
it again; another DRA allocator; a person. The ledger would then hold one thing and the cluster
another: the node's enforcer refuses to prepare an allocation its ledger does not hold (the pod never
starts), or the ledger hands the same share to a second claim. Placement makes the two agree:

- the allocation fits — its devices are GPUs of a node in the fleet, kube-scheduler's filters let
  the claim's pod run there (a cordon, taints, its nodeSelector and affinity, the node's room: the
  check placement's own decisions make, `clusternodes`; a pod bound there already is past them),
  its shares fit in that node's ledger beside everything but this claim's own entry, the tenant's
  quota allows it — and it is
  adopted: the claim's ledger entry becomes the allocation's (the record touched first, so that no
  reconciler writes the old entry back meanwhile; the new entry written by compare-and-set; the old
  one, on another node, removed; the quota charged for what it holds now), the record says
  ``allocated`` there with those shares, and ``allocated`` goes out;
- it does not, and `tessera.placement.kubesync` refuses it: the allocation is taken out of the
  ResourceClaim and the pod gets a Warning that says why and what happens next.

Each step is idempotent: a caller that stops midway adopts again from the top and finds its own work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from tessera.shared import subjects
from tessera.shared.errors import ConflictError
from tessera.shared.events import ClaimAllocated, ClaimRecord, LedgerEntry, NodeLedger
from tessera.shared.ledger import check_fit, claim_quota, tenant_totals
from tessera.shared.lifecycle import ON_NODE, TERMINAL

from tessera.placement.claimstatus import describes, held_shares
from tessera.placement.kubesync import Adopted
from tessera.placement.lease import unleased
from tessera.placement.quota import has_limits, over_quota

if TYPE_CHECKING:
    from tessera.placement.service import PlacementService

log = logging.getLogger("tessera.placement.adoption")

ATTEMPTS = 5  # ledger or record writes lost to a concurrent writer before giving up for now


class Adoptions:
    def __init__(self, svc: "PlacementService") -> None:
        self.svc = svc

    async def adopt_locked(self, claim: str, found: dict) -> Adopted | str:
        """`adopt` under the claim's lock (placement's own paths on the claim wait meanwhile)."""
        lock = self.svc.claim_locks.setdefault(claim, asyncio.Lock())
        try:
            async with lock:
                return await self.adopt(claim, found)
        finally:
            if not lock.locked() and not lock._waiters:
                self.svc.claim_locks.pop(claim, None)

    async def adopt(self, claim: str, found: dict) -> Adopted | str:
        """Adopt ResourceClaim allocation ``found`` for ``claim``: what was adopted, or why it cannot be."""
        svc = self.svc
        for _ in range(ATTEMPTS):
            record, revision = await svc.claims.get(claim)
            if record is None or record.state in TERMINAL or record.release_requested:
                return "the claim is released or being released"
            if record.state in ON_NODE and describes(found, record.node, list(record.devices)):
                ledger, _ = await svc.ledger.read_node(record.node)
                held = ledger.entries.get(claim)
                if held is not None and _by_index(held.shares) == _by_index(record.devices):
                    # adopted before (a restart resuming the claim's status sync): nothing to judge
                    return Adopted(record.node, _by_index(record.devices), now=False)
            try:
                node, shares = held_shares(found, lambda n: (inv.devices if (inv := svc.inventories.get(n)) else None))
            except ValueError as exc:
                return str(exc)
            entry = LedgerEntry(claim=claim, tenant=record.tenant, shares=shares, cpu_millis=record.spec.cpu_millis,
                                host_memory_mib=record.spec.host_memory_mib,
                                pod_uid=record.kube.pod_uid if record.kube is not None else "")
            why = self._refused_node(record, node)
            if why is not None:
                return why
            ledger, at = await svc.ledger.read_node(node)
            why = await self._over_quota(record, entry)
            if why is not None:
                return why
            assert revision is not None  # (ClaimStore.get gives a record with its revision)
            # The record touched first: a reconciler restores a missing entry only for a record
            # older than its grace period, re-read right before, so none writes the old one back.
            touched = msgspec.structs.replace(record, updated=time.time())
            revision = await svc.claims.replace(touched, revision)
            if revision is None:
                continue
            others = NodeLedger(node=node, entries={k: v for k, v in ledger.entries.items() if k != claim})
            inventory = svc.inventories.get(node)
            why = check_fit(inventory.devices if inventory else [], others, entry)
            if why is not None:
                return f"its devices are not free in Tessera's ledger: {why}"
            try:
                await svc.ledger.write_node(NodeLedger(node=node, entries={**others.entries, claim: entry}), at)
            except ConflictError:
                continue
            for elsewhere in {record.node, svc.claim_nodes.get(claim) or ""} - {node, ""}:
                await svc.ledger.release_entry(elsewhere, claim)
            await self._charge(record.tenant, claim, entry)
            moved = msgspec.structs.replace(
                unleased(touched), state=touched.state if touched.state in ON_NODE else "allocated", node=node,
                devices=shares, reason=f"adopted the allocation another allocator wrote on {node}",
                updated=time.time())
            if await svc.claims.replace(moved, revision) is None:
                continue
            svc._forget(claim)
            await svc.bus.publish(
                subjects.claim(moved.tenant, claim, "allocated", node),
                ClaimAllocated(claim=claim, tenant=moved.tenant, node=node, devices=shares, spec=moved.spec),
                msg_id=f"{claim}:adopted:{node}:{revision}")
            svc.counts["adopted"] += 1
            log.warning("%s: adopted the allocation another allocator wrote on %s: %s", claim, node,
                        ", ".join(f"gpu-{s.index}" for s in shares))
            return Adopted(node, shares, now=True)
        raise ConflictError(f"{claim}: its record or ledger kept moving while its allocation was adopted")

    def _refused_node(self, record: ClaimRecord, node: str) -> str | None:
        """Why the claim's pod may not run on ``node`` as kube-scheduler's filters judge it, or None
        (no cluster table, a claim without a pod, or a pod bound there already)."""
        cluster, pod = self.svc.cluster, record.spec.pod
        if cluster is None or pod is None:
            return None
        uid = record.kube.pod_uid if record.kube is not None else ""
        use = cluster.pods.get(uid)
        if use is not None and use.node == node:
            return None
        why = cluster.refusal(pod, node, self.svc.view.pod_nodes, own_pod=uid)
        if why is None:
            return None
        return (f"kube-scheduler's {why.filter} filter refuses the pod on node {node} "
                f"({', '.join(why.reasons)})")

    async def _over_quota(self, record: ClaimRecord, entry: LedgerEntry) -> str | None:
        quota = self.svc.quotas.get(record.tenant)
        if not has_limits(quota):
            return None
        assert quota is not None
        usage, _ = await self.svc.ledger.read_tenant(record.tenant)
        rest = msgspec.structs.replace(usage, claims={k: v for k, v in usage.claims.items() if k != record.claim})
        over = over_quota(quota, tenant_totals(rest), claim_quota(entry))
        return f"it is beyond tenant {record.tenant}'s quota: {over}" if over else None

    async def _charge(self, tenant: str, claim: str, entry: LedgerEntry) -> None:
        """The tenant's quota reservation for ``claim`` set to what it holds now."""
        if not has_limits(self.svc.quotas.get(tenant)):
            return
        for _ in range(ATTEMPTS):
            usage, revision = await self.svc.ledger.read_tenant(tenant)
            if usage.claims.get(claim) == claim_quota(entry):
                return
            try:
                await self.svc.ledger.reserve_quota(tenant, claim, claim_quota(entry), usage, revision)
                return
            except ConflictError:
                continue


def _by_index(shares) -> list:
    return sorted(shares, key=lambda s: s.index)
