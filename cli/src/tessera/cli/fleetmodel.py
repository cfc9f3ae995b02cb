"""The fleet as the fleet view, `tessera top` and `tessera status -o json` describe it.

One model of what the public buckets and the usage events say (nodes and their GPUs, the slices
each tenant holds on them, what those slices use, each node's fragmentation as placement measures
it, claims by state, tenants and their quota use), and one JSON snapshot of it: the browser page
draws exactly what `tessera status -o json` prints. The model is fed by `tessera.cli.feed` (watches
of the buckets and the usage stream) or built once from a read of the buckets; it never reads NATS
itself. The snapshot's fields are documented in docs/cli.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Any

import msgspec

from tessera.shared import fragmentation, subjects
from tessera.shared.events import (
    ClaimRecord,
    ClaimUsage,
    NodeInventory,
    NodeLedger,
    TenantRecord,
    TenantUsage,
)
from tessera.shared.inventory import is_lost
from tessera.shared.ledger import tenant_totals

MIB = 1 << 20
CLAIM_STATES = ("requested", "allocated", "unschedulable", "prepared", "running", "released", "failed")

_decoders = {
    subjects.KV_INVENTORY: msgspec.json.Decoder(NodeInventory),
    subjects.KV_CLAIMS: msgspec.json.Decoder(ClaimRecord),
    subjects.KV_TENANTS: msgspec.json.Decoder(TenantRecord),
}
_node_ledger = msgspec.json.Decoder(NodeLedger)
_tenant_usage = msgspec.json.Decoder(TenantUsage)


class FleetModel:
    """Latest values by bucket and key (a value older than the one held is ignored), and the latest
    usage report per claim. ``version`` grows with every change; `changed` waits for the next."""

    def __init__(self) -> None:
        self.inventories: dict[str, NodeInventory] = {}
        self.ledgers: dict[str, NodeLedger] = {}
        self.tenant_usage: dict[str, TenantUsage] = {}
        self.claims: dict[str, ClaimRecord] = {}
        self.tenants: dict[str, TenantRecord] = {}
        self.usage: dict[str, ClaimUsage] = {}
        self.skipped: Counter[str] = Counter()  # values that did not decode, by bucket
        self._revisions: dict[tuple[str, str], int] = {}
        self.version = 0
        self._next: asyncio.Event | None = None  # set (and replaced) by the next change

    # --- feeding ------------------------------------------------------------------------------

    def apply(self, bucket: str, key: str, value: bytes | None, revision: int) -> bool:
        """One bucket entry (``value`` None or empty: the key was deleted). Returns whether it changed
        the model."""
        seen = self._revisions.get((bucket, key), 0)
        if revision and revision <= seen:
            return False
        self._revisions[(bucket, key)] = revision
        table, decoded = self._decode(bucket, key, value)
        if table is None:
            return False
        if decoded is None:
            table.pop(self._name(bucket, key), None)
        else:
            table[self._name(bucket, key)] = decoded
        self._bump()
        return True

    def _decode(self, bucket: str, key: str, value: bytes | None):
        if bucket == subjects.KV_LEDGER:
            table = self.ledgers if key.startswith("node.") else self.tenant_usage if key.startswith("tenant.") else None
            decoder = _node_ledger if key.startswith("node.") else _tenant_usage
        else:
            table = {subjects.KV_INVENTORY: self.inventories, subjects.KV_CLAIMS: self.claims,
                     subjects.KV_TENANTS: self.tenants}.get(bucket)
            decoder = _decoders.get(bucket)
        if table is None or not value:
            return table, None
        try:
            return table, decoder.decode(value)
        except (msgspec.ValidationError, msgspec.DecodeError):
            self.skipped[bucket] += 1  # shown, not fatal: a reader never stops over one bad value
            return None, None

    @staticmethod
    def _name(bucket: str, key: str) -> str:
        return key.split(".", 1)[1] if bucket == subjects.KV_LEDGER and "." in key else key

    def apply_usage(self, event: Any) -> bool:
        if not isinstance(event, ClaimUsage):
            return False
        held = self.usage.get(event.claim)
        if held is not None and held.ts > event.ts:
            return False
        self.usage[event.claim] = event
        self._bump()
        return True

    def _bump(self) -> None:
        self.version += 1
        if self._next is not None:  # wakes every waiter now, in this call (no task to schedule)
            self._next.set()
            self._next = None

    async def changed(self, after: int, timeout: float | None = None) -> int:
        """Wait until ``version`` passes ``after`` (or ``timeout``); returns the version."""
        if self.version <= after:
            if self._next is None:
                self._next = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._next.wait(), timeout)
        return self.version

    # --- reading ------------------------------------------------------------------------------

    def mix(self) -> tuple[str, list]:
        specs = [c.spec for c in self.claims.values()]
        kinds = fragmentation.mix_from_specs(specs)
        return ("observed" if len(specs) >= 16 else "default"), kinds

    def snapshot(self) -> dict:
        """The documented JSON document (docs/cli.md, "The fleet document")."""
        mix_name, kinds = self.mix()
        tenants_seen = sorted(set(self.tenants) | {c.tenant for c in self.claims.values()})
        nodes = [self._node(name, kinds) for name in sorted(self.inventories)]
        by_state = Counter(c.state for c in self.claims.values())
        gpus = [g for n in nodes for g in n["gpus"]]
        return {
            "time": time.time(),
            "totals": {
                "nodes": len(nodes),
                "lost_nodes": sum(1 for n in nodes if n["lost"]),
                "gpus": len(gpus),
                "memory_mib": sum(g["memory_mib"] for g in gpus),
                "allocated_mib": sum(g["allocated_mib"] for g in gpus),
                "used_mib": sum(g["used_mib"] for g in gpus),
                "fragmentation": round(sum(n["fragmentation"] for n in nodes), 4),
                "free_gpu_units": round(sum(n["free_gpu_units"] for n in nodes), 4),
            },
            "mix": mix_name,
            "claims": {"total": len(self.claims), "by_state": {s: by_state.get(s, 0) for s in CLAIM_STATES}},
            "tenants": [self._tenant(t) for t in tenants_seen],
            "nodes": nodes,
            "skipped": dict(self.skipped),
        }

    def _node(self, name: str, kinds: list) -> dict:
        inv = self.inventories[name]
        ledger = self.ledgers.get(name)
        states = fragmentation.gpu_states(inv, ledger)
        cpu_free, mem_free = fragmentation.host_free(inv, ledger)
        frag = fragmentation.node_fragmentation(list(states.values()), cpu_free, mem_free, kinds)
        free_units = sum(s.free for s in states.values())
        slices: dict[str, list[dict]] = {}
        for entry in (ledger.entries.values() if ledger else ()):
            usage = self.usage.get(entry.claim)
            used = {d.uuid: d.used_bytes for d in usage.devices} if usage else {}
            for share in entry.shares:
                slices.setdefault(share.uuid, []).append({
                    "claim": entry.claim, "tenant": entry.tenant, "memory_mib": share.memory_mib,
                    "cores": share.cores, "used_mib": round(used.get(share.uuid, 0) / MIB, 1),
                })
        gpus = []
        for d in sorted(inv.devices, key=lambda d: d.index):
            mine = sorted(slices.get(d.uuid, []), key=lambda s: (s["tenant"], s["claim"]))
            st = states[d.uuid]
            gpus.append({
                "uuid": d.uuid, "index": d.index, "model": d.model, "memory_mib": d.memory_mib,
                "healthy": d.healthy, "max_shares": d.max_shares, "shares": st.shares,
                "exclusive": st.exclusive, "allocated_mib": st.mem_used, "cores_allocated": st.cores_used,
                "used_mib": round(sum(s["used_mib"] for s in mine), 1), "free_gpu_units": round(st.free, 4),
                "slices": mine,
            })
        return {
            "node": name, "lost": is_lost(inv), "cpu_millis": inv.cpu_millis, "cpu_free_millis": cpu_free,
            "host_memory_mib": inv.host_memory_mib, "host_memory_free_mib": mem_free,
            "fragmentation": round(frag, 4), "free_gpu_units": round(free_units, 4),
            "fragmentation_ratio": round(frag / free_units, 4) if free_units else 0.0,
            "gpus": gpus,
        }

    def _tenant(self, name: str) -> dict:
        record = self.tenants.get(name)
        usage = self.tenant_usage.get(name)
        used = tenant_totals(usage) if usage else None
        quota = msgspec.to_builtins(record.quota) if record else {}
        return {
            "tenant": name, "known": record is not None, "phase": record.phase if record else "",
            "quota": {k: quota.get(k) for k in ("gpus", "memory_mib", "cores")},
            "used": {"gpus": used.gpus if used else 0, "memory_mib": used.memory_mib if used else 0,
                     "cores": used.cores if used else 0},
            "claims": dict(Counter(c.state for c in self.claims.values() if c.tenant == name)),
        }

    def claim_list(self) -> list[dict]:
        """Every claim record as JSON (`tessera claims -o json`), oldest update first."""
        return [msgspec.to_builtins(c) for c in sorted(self.claims.values(), key=lambda c: c.updated)]
