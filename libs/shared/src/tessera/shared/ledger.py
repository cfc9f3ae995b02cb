"""The allocation ledger: compare-and-set records of what is allocated on every GPU.

The ``ledger`` KV bucket is the single source of truth for allocations. Key ``node.<node>`` holds
every live allocation on that node (a NodeLedger), key ``tenant.<tenant>`` what each tenant holds
(for quota). Every write is a compare-and-set at the revision read (`tessera.shared.kv.Bucket`):
two placement replicas that race for the same GPU cannot both win, the loser gets a ConflictError
and re-reads. This is the
Kubernetes resourceVersion conflict, without node locks. Placement commits; the enforcer (or
placement, for a claim that never reached a node) releases.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from tessera.shared import subjects
from tessera.shared.bus import KeyValue
from tessera.shared.errors import ConflictError
from tessera.shared.events import GpuQuota, LedgerEntry, NodeLedger, TenantUsage, encode
from tessera.shared.jspub import kv_update_many
from tessera.shared.kv import Bucket

_node_decoder = msgspec.json.Decoder(NodeLedger)


@dataclass
class DeviceTotals:
    memory_mib: int = 0
    cores: int = 0
    shares: int = 0
    exclusive: bool = False


def device_totals(ledger: NodeLedger) -> dict[str, DeviceTotals]:
    """Per-GPU sums derived from the entries (the entries, not the sums, are what is stored)."""
    totals: dict[str, DeviceTotals] = {}
    for entry in ledger.entries.values():
        for share in entry.shares:
            t = totals.setdefault(share.uuid, DeviceTotals())
            t.memory_mib += share.memory_mib
            t.cores += share.cores
            t.shares += 1
            t.exclusive = t.exclusive or share.cores >= 100
    return totals


def claim_quota(entry: LedgerEntry) -> GpuQuota:
    return GpuQuota(
        gpus=len(entry.shares),
        memory_mib=sum(s.memory_mib for s in entry.shares),
        cores=sum(s.cores for s in entry.shares),
    )


def tenant_totals(usage: TenantUsage) -> GpuQuota:
    return summed(usage.claims.values())


def summed(amounts: Iterable[GpuQuota]) -> GpuQuota:
    """The sum of amounts, per dimension (None counted as 0)."""
    totals = [0, 0, 0]
    for q in amounts:
        totals[0] += q.gpus or 0
        totals[1] += q.memory_mib or 0
        totals[2] += q.cores or 0
    return GpuQuota(gpus=totals[0], memory_mib=totals[1], cores=totals[2])


def held_by_tenant(ledgers: Iterable[NodeLedger]) -> dict[str, GpuQuota]:
    """What each tenant's ledger entries hold on these nodes, by tenant."""
    amounts: dict[str, list[GpuQuota]] = {}
    for ledger in ledgers:
        for entry in ledger.entries.values():
            amounts.setdefault(entry.tenant, []).append(claim_quota(entry))
    return {tenant: summed(held) for tenant, held in amounts.items()}


def borrowed(quota: GpuQuota, held: GpuQuota) -> GpuQuota:
    """What ``held`` exceeds ``quota`` by, per dimension (0 where it is within it, or where the
    quota has no limit): what a tenant holds beyond its guarantee, borrowed from idle capacity."""
    def over(name: str) -> int:
        limit = getattr(quota, name)
        return 0 if limit is None else max(0, (getattr(held, name) or 0) - limit)

    return GpuQuota(gpus=over("gpus"), memory_mib=over("memory_mib"), cores=over("cores"))


def ceiling(quota: GpuQuota, limit: GpuQuota | None) -> GpuQuota:
    """The most a tenant may hold: its guarantee ``quota`` plus its borrowing ``limit`` (None: it
    borrows nothing); unlimited in a dimension either leaves unlimited."""
    if limit is None:
        return quota

    def most(name: str) -> int | None:
        guaranteed, extra = getattr(quota, name), getattr(limit, name)
        return None if guaranteed is None or extra is None else guaranteed + extra

    return GpuQuota(gpus=most("gpus"), memory_mib=most("memory_mib"), cores=most("cores"))


class Ledger:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        # Two typed views of the one bucket (its keys say which type a value is).
        self.nodes: Bucket[NodeLedger] = Bucket(kv, NodeLedger, "ledger")
        self.tenants: Bucket[TenantUsage] = Bucket(kv, TenantUsage, "ledger")

    # --- nodes -----------------------------------------------------------------------------

    async def read_node(self, node: str) -> tuple[NodeLedger, int | None]:
        """The node's ledger and its revision (an empty one and None where there is none yet)."""
        stored = await self.nodes.get(subjects.ledger_node_key(node))
        return (stored.value, stored.revision) if stored else (NodeLedger(node=node), None)

    async def commit(
        self, node: str, entry: LedgerEntry, ledger: NodeLedger, revision: int | None
    ) -> tuple[NodeLedger, int]:
        """Add ``entry`` to the node's ledger as read at ``revision``; ConflictError if it moved.

        Returns the new ledger and its revision, so the caller's next write needs no re-read."""
        entries = dict(ledger.entries)
        entries[entry.claim] = entry
        new = NodeLedger(node=node, entries=entries)
        return new, await self.nodes.put(subjects.ledger_node_key(node), new, revision=revision)

    async def write_node(self, ledger: NodeLedger, revision: int | None) -> int:
        """Replace a node's ledger as read at ``revision`` (None: must not exist); ConflictError if it moved."""
        return await self.nodes.put(subjects.ledger_node_key(ledger.node), ledger, revision=revision)

    async def write_nodes(self, items: list[tuple[NodeLedger, int | None]]) -> list[int | Exception]:
        """``write_node`` for many nodes at once, pipelined: per node its new revision, a
        ConflictError where the ledger moved since the revision given, or the error that stopped it."""
        results = await kv_update_many(self.kv, [(subjects.ledger_node_key(ledger.node), encode(ledger), revision or 0)
                                                 for ledger, revision in items])  # 0: the key must not exist
        return [ConflictError(f"ledger of {ledger.node} changed since revision {revision}") if result is None
                else result for (ledger, revision), result in zip(items, results)]

    async def release(self, node: str, claim: str) -> LedgerEntry | None:
        """Remove a claim's allocation from a node; idempotent (None if it was not there)."""
        return await self.release_entry(node, claim)

    async def all_nodes(self) -> dict[str, NodeLedger]:
        """Every node's ledger, by node (one batched read of the bucket)."""
        return {key[5:]: stored.value for key, stored in (await self.nodes.items("node.")).items()}

    async def all_tenants(self) -> dict[str, tuple[TenantUsage, int]]:
        """Every tenant's usage record with its revision (a malformed one is logged and skipped)."""
        return {key[7:]: (s.value, s.revision) for key, s in (await self.tenants.items("tenant.")).items()}

    # --- tenants (quota) -------------------------------------------------------------------

    async def read_tenant(self, tenant: str) -> tuple[TenantUsage, int | None]:
        """The tenant's quota usage and its revision (none used and None where there is no record yet)."""
        stored = await self.tenants.get(subjects.ledger_tenant_key(tenant))
        return (stored.value, stored.revision) if stored else (TenantUsage(tenant=tenant), None)

    async def reserve_quota(self, tenant: str, claim: str, amount: GpuQuota, usage: TenantUsage, revision: int | None) -> None:
        claims = dict(usage.claims)
        claims[claim] = amount
        await self.tenants.put(subjects.ledger_tenant_key(tenant), TenantUsage(tenant=tenant, claims=claims),
                               revision=revision)

    async def return_quota(self, tenant: str, claim: str) -> bool:
        """Take the claim's reservation out of its tenant's usage: whether there was one."""
        returned = False

        def without(usage: TenantUsage | None) -> TenantUsage | None:
            nonlocal returned
            returned = usage is not None and claim in usage.claims
            if usage is None or not returned:
                return usage  # nothing to write
            return TenantUsage(tenant=tenant, claims={k: v for k, v in usage.claims.items() if k != claim})

        await self.tenants.modify(subjects.ledger_tenant_key(tenant), without)
        return returned

    async def release_entry(self, node: str, claim: str, shares: list | None = None) -> LedgerEntry | None:
        """Remove a claim's entry from a node, but only if it is the one with ``shares`` (when
        given): a replica rolling back its own attempt never removes a peer's winning entry."""
        removed: LedgerEntry | None = None

        def without(ledger: NodeLedger | None) -> NodeLedger | None:
            nonlocal removed
            removed = ledger.entries.get(claim) if ledger is not None else None
            if ledger is None or removed is None or (shares is not None and list(removed.shares) != list(shares)):
                removed = None
                return ledger  # nothing to write
            return NodeLedger(node=node, entries={k: v for k, v in ledger.entries.items() if k != claim})

        await self.nodes.modify(subjects.ledger_node_key(node), without)
        return removed

    async def give_back(self, tenant: str, claim: str, node: str | None, *, shares: list | None = None,
                        quota: bool = True) -> GiveBack:
        """Return what a claim holds: its ledger entry on ``node`` (only the one with ``shares``, when
        given) and, with ``quota``, its tenant's quota reservation. The one operation every release
        and every rollback goes through, so none of them returns one half and forgets the other."""
        entry = await self.release_entry(node, claim, shares) if node else None
        returned = await self.return_quota(tenant, claim) if quota else False
        return GiveBack(entry=entry, quota_returned=returned)


@dataclass(frozen=True)
class GiveBack:
    entry: LedgerEntry | None  # the ledger entry removed (None: there was none, or not ours)
    quota_returned: bool


def decode_node_ledger(data: bytes) -> NodeLedger:
    return _node_decoder.decode(data)


def check_fit(devices: list, ledger: NodeLedger, entry: LedgerEntry) -> str | None:
    """Why ``entry`` cannot be added to ``ledger`` on a node with ``devices`` (None: it fits).

    This is the last line of defence against over-commit: placement runs it on the ledger it is
    about to overwrite, whatever its (possibly stale) in-memory view of the fleet said.
    """
    held = ledger.entries.get(entry.claim)
    if held is not None:  # the same claim twice: already placed there, or placed differently
        if list(held.shares) == list(entry.shares):
            return None
        return (f"{entry.claim} is already placed on {ledger.node} on other GPUs "
                f"({', '.join(s.uuid for s in held.shares)})")
    by_uuid = {d.uuid: d for d in devices}
    totals = device_totals(ledger)
    seen: set[tuple[str, str]] = set()
    for share in entry.shares:
        device = by_uuid.get(share.uuid)
        if device is None:
            return f"GPU {share.uuid} is not in the node's inventory"
        # One request's GPUs are distinct; two requests of a claim (two containers) may share one,
        # each share counted on top of the other.
        if (share.uuid, share.request) in seen:
            return f"GPU {share.uuid} appears twice in one request of a claim"
        seen.add((share.uuid, share.request))
        t = totals.setdefault(share.uuid, DeviceTotals())
        if t.exclusive or (share.cores >= 100 and t.shares > 0):
            return f"GPU {share.uuid} is used exclusively or cannot be shared"
        if t.memory_mib + share.memory_mib > device.memory_mib:
            return f"GPU {share.uuid} memory {t.memory_mib}+{share.memory_mib} > {device.memory_mib} MiB"
        if t.cores + share.cores > 100:
            return f"GPU {share.uuid} cores {t.cores}+{share.cores} > 100%"
        if t.shares + 1 > device.max_shares:
            return f"GPU {share.uuid} already has {t.shares} of {device.max_shares} shares"
        t.memory_mib += share.memory_mib
        t.cores += share.cores
        t.shares += 1
        t.exclusive = t.exclusive or share.cores >= 100
    return None
