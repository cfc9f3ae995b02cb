"""The manager's Prometheus series: the platform's books per tenant. Tenants by phase, each tenant's
quota and what it holds against it, and every claim by tenant and state.

The manager already owns the tenants and reads the claims and the ledger (a deleted tenant's drain),
so it keeps these books and placement does not: three watches (tenants, claims, ledger), each
applying one change at a time to a small table, and scrapes count the tables. Nothing here runs
without a metrics listener (`tessera.shared.metrics`). Quota use is summed from the node ledgers'
entries, so it is known for every tenant, also one without limits (whose ``tenant.<tenant>`` usage
record placement does not keep).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Coroutine

import msgspec
from prometheus_client.core import GaugeMetricFamily

from tessera.shared import subjects
from tessera.shared.events import GpuQuota, NodeLedger, TenantRecord
from tessera.shared.ledger import claim_quota
from tessera.shared.lifecycle import ON_NODE, TERMINAL, UNPLACED

log = logging.getLogger("tessera.controlplane.metrics")

RESOURCES = ("gpus", "memory_mib", "cores")
CLAIM_STATES = tuple(sorted(UNPLACED | ON_NODE | TERMINAL))
_GONE = ("DEL", "PURGE")


class _ClaimState(msgspec.Struct):
    """The two fields of a claim record the books need."""

    tenant: str
    state: str


_claim = msgspec.json.Decoder(_ClaimState)
_tenant = msgspec.json.Decoder(TenantRecord)
_node = msgspec.json.Decoder(NodeLedger)


class TenantBooks:
    def __init__(self, bus) -> None:
        self.bus = bus
        self.tenants: dict[str, TenantRecord] = {}
        self.claims: dict[str, tuple[str, str]] = {}  # claim -> (tenant, state)
        self.held: dict[str, dict[str, GpuQuota]] = {}  # node -> tenant -> what its entries hold

    def tasks(self) -> dict[str, Coroutine]:
        return {
            "books-tenants": self._follow(subjects.KV_TENANTS, self.on_tenant),
            "books-claims": self._follow(subjects.KV_CLAIMS, self.on_claim),
            "books-ledger": self._follow(subjects.KV_LEDGER, self.on_ledger),
        }

    async def _follow(self, bucket: str, apply: Callable[[str, bytes | None], None]) -> None:
        kv = await self.bus.kv(bucket)
        watcher = await kv.watchall()
        try:
            async for entry in watcher:
                if entry is None:  # end of the current values
                    continue
                value = None if entry.operation in _GONE else entry.value
                try:
                    apply(entry.key, value or None)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("%s/%s not counted: %s", bucket, entry.key, exc)
        finally:
            await watcher.stop()

    # --- one change at a time -------------------------------------------------------------------

    def on_tenant(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.tenants.pop(key, None)
        else:
            self.tenants[key] = _tenant.decode(value)

    def on_claim(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.claims.pop(key, None)
        else:
            c = _claim.decode(value)
            self.claims[key] = (c.tenant, c.state)

    def on_ledger(self, key: str, value: bytes | None) -> None:
        if not key.startswith("node."):
            return
        node = key[5:]
        if value is None:
            self.held.pop(node, None)
            return
        by_tenant: dict[str, list[int]] = {}
        for entry in _node.decode(value).entries.values():
            q = claim_quota(entry)
            t = by_tenant.setdefault(entry.tenant, [0, 0, 0])
            t[0] += q.gpus or 0
            t[1] += q.memory_mib or 0
            t[2] += q.cores or 0
        self.held[node] = {t: GpuQuota(gpus=v[0], memory_mib=v[1], cores=v[2]) for t, v in by_tenant.items()}

    # --- the scrape -----------------------------------------------------------------------------

    def collect(self):
        phases = GaugeMetricFamily("tessera_tenants", "tenants by phase", labels=["phase"])
        for phase, n in sorted(Counter(r.phase for r in self.tenants.values()).items()):
            phases.add_metric([phase], n)
        yield phases

        limit = GaugeMetricFamily("tessera_tenant_quota_limit",
                                  "a tenant's quota per resource (gpus; memory_mib; cores: the sum of per-GPU "
                                  "percents); absent where the tenant has no limit", labels=["tenant", "resource"])
        used = GaugeMetricFamily("tessera_tenant_quota_used",
                                 "what a tenant's claims hold in the ledger, per resource (as the quota counts it)",
                                 labels=["tenant", "resource"])
        totals: dict[str, list[int]] = {}
        for node_held in self.held.values():
            for tenant, q in node_held.items():
                t = totals.setdefault(tenant, [0, 0, 0])
                t[0] += q.gpus or 0
                t[1] += q.memory_mib or 0
                t[2] += q.cores or 0
        for tenant in sorted(set(self.tenants) | set(totals)):
            record = self.tenants.get(tenant)
            held = totals.get(tenant, [0, 0, 0])
            for i, resource in enumerate(RESOURCES):
                used.add_metric([tenant, resource], held[i])
                ceiling = getattr(record.quota, resource) if record is not None else None
                if ceiling is not None:
                    limit.add_metric([tenant, resource], ceiling)
        yield from (limit, used)

        claims = GaugeMetricFamily("tessera_claims_by_state",
                                   "claim records in the claims bucket by tenant and state (released ones stay "
                                   "until their retention, TESSERA_CLAIM_RETENTION)", labels=["tenant", "state"])
        counted = Counter(self.claims.values())
        for tenant in sorted({t for t, _ in counted} | set(self.tenants)):
            for state in CLAIM_STATES:
                claims.add_metric([tenant, state], counted.get((tenant, state), 0))
        yield claims
