"""Fair share across tenants (issue 26): whose borrowing may be reclaimed, and which borrower goes first.

A tenant's quota is what it is guaranteed; with a borrowing limit it may hold more, out of idle
capacity, and each claim placed beyond its guarantee is marked borrowing in its ledger entry
(`quota.admit`). The rules built on that, stated once here:

- **Reclaim.** A claim that fits nowhere while its tenant, holding it, stays within its own quota
  (`Reclaim.covers`) may preempt other tenants' borrowing claims, whatever the priorities: through
  the same victim choice (`preemption`, in the same order) and the same release path (`preempting`)
  as priority preemption. Only claims marked borrowing, of another tenant, and only so far as that
  tenant stays at or above its guarantee: a set of victims is allowed only where, for each tenant
  in it, every one of its victims still lies beyond that tenant's quota with the others of the set
  gone (`Reclaim.allows`). So a claim within its own tenant's guarantee is never reclaimed, even
  one marked borrowing when placed whose tenant has released others since. A tenant with no quota
  has no guarantee to reclaim (and cannot borrow: it has no ceiling).
- **Weights.** When several waiting claims want the same idle capacity, the retry pass tries them
  by their tenant's share after placing the claim, lowest first (`share`): what the tenant would
  hold beyond its guarantee, as a fraction of the fleet's capacity in the dimension where that
  fraction is largest (the dominant resource share), divided by the tenant's weight — Kueue's fair
  sharing rule. A claim within its guarantee has share 0; ties go by priority, then age. Several
  replicas each keep this order in their own pass; between replicas it is first come, first served.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from tessera.shared.events import GpuQuota, LedgerEntry, NodeInventory, TenantRecord
from tessera.shared.ledger import borrowed, claim_quota, summed

from tessera.placement.preemption import Need
from tessera.placement.quota import has_limits, over_quota

_DIMENSIONS = ("gpus", "memory_mib", "cores")


def minus(a: GpuQuota, b: GpuQuota) -> GpuQuota:
    return GpuQuota(**{d: (getattr(a, d) or 0) - (getattr(b, d) or 0) for d in _DIMENSIONS})


def amount_of(need: Need, smallest_mib: int) -> GpuQuota:
    """What a claim of ``need`` counts against its quota (a whole card: the smallest one's memory)."""
    memory = smallest_mib if need.memory_mib is None else need.memory_mib
    return GpuQuota(gpus=need.gpus, memory_mib=memory * need.gpus, cores=need.cores * need.gpus)


@dataclass(frozen=True)
class Reclaim:
    """A claim's tenant, its guarantee and what it holds: which borrowing claims it may reclaim."""

    tenant: str
    quota: GpuQuota | None
    held: GpuQuota  # what the claim's tenant holds now (its ``tenant.<name>`` usage record)
    others: Mapping[str, GpuQuota]  # what each tenant holds, from the ledger
    records: Mapping[str, TenantRecord]

    def covers(self, amount: GpuQuota) -> bool:
        """Whether a claim of ``amount`` lies within its tenant's guarantee (then it may reclaim)."""
        return has_limits(self.quota) and over_quota(self.quota, self.held, amount) is None

    def candidates(self, entries: Iterable[LedgerEntry]) -> set[str]:
        """The claims among ``entries`` this tenant may reclaim: borrowing, preemptible, another
        tenant's, and that tenant still beyond its guarantee."""
        return {e.claim for e in entries
                if e.borrowing and e.preemptible and e.tenant != self.tenant and self._lending(e.tenant)}

    def allows(self, group: Sequence[LedgerEntry], reclaimed: Collection[str]) -> bool:
        """Whether taking ``group`` leaves each tenant whose claims in it are ``reclaimed`` at or
        above its guarantee: every such victim still beyond the quota with the others gone."""
        by_tenant: dict[str, list[LedgerEntry]] = {}
        for e in group:
            if e.claim in reclaimed:
                by_tenant.setdefault(e.tenant, []).append(e)
        for tenant, victims in by_tenant.items():
            quota = self._quota(tenant)
            if quota is None:
                return False
            left = minus(self.others.get(tenant, GpuQuota()), summed(claim_quota(v) for v in victims))
            if any(over_quota(quota, left, claim_quota(v)) is None for v in victims):
                return False
        return True

    def reason(self, victim: LedgerEntry) -> str:
        return (f"reclaimed by tenant {self.tenant} for its guarantee ({victim.claim} was borrowing beyond "
                f"tenant {victim.tenant}'s quota)")

    def _quota(self, tenant: str) -> GpuQuota | None:
        record = self.records.get(tenant)
        return record.quota if record is not None and has_limits(record.quota) else None

    def _lending(self, tenant: str) -> bool:
        quota = self._quota(tenant)
        if quota is None:
            return False
        over = borrowed(quota, self.others.get(tenant, GpuQuota()))
        return any(getattr(over, d) for d in _DIMENSIONS)


def capacity(inventories: Iterable[NodeInventory]) -> GpuQuota:
    """The fleet's healthy GPUs, their memory and their cores (100 a GPU)."""
    devices = [d for inv in inventories for d in inv.devices if d.healthy]
    return GpuQuota(gpus=len(devices), memory_mib=sum(d.memory_mib for d in devices), cores=100 * len(devices))


def share(record: TenantRecord | None, held_after: GpuQuota, fleet: GpuQuota) -> float:
    """A tenant's fair-sharing share once it holds ``held_after``: its dominant borrowed fraction of
    the fleet over its weight (0 within its guarantee, or for a tenant without one)."""
    if record is None or not has_limits(record.quota):
        return 0.0
    over = borrowed(record.quota, held_after)
    fractions = [(getattr(over, d) or 0) / getattr(fleet, d) for d in _DIMENSIONS if getattr(fleet, d)]
    return max(fractions, default=0.0) / record.weight
