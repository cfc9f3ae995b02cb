"""Per-claim and per-node usage events, built from what the accounting files say.

A ClaimUsage carries, per allocated GPU, the bytes the workload's live processes hold (as libvgpu
counted them), the limit (as recorded in the accounting file, else as allocated) and the SM share;
plus the number of live processes. Events go out on ``tessera.usage.<node>`` when a value changed
or when ``heartbeat`` seconds passed since the last one, so a quiet node costs little and a reader
that joins late still hears every claim within one heartbeat. The NodeUsage doubles as the
enforcer's sign of life.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from tessera.shared.events import ClaimUsage, DeviceUsage, NodeUsage

from tessera.enforcer import accounting
from tessera.enforcer.observe import ClaimView, NodeView

MIB = 1 << 20


def claim_usage(node: str, cv: ClaimView) -> ClaimUsage | None:
    record = cv.record
    if record is None or not cv.live or record.node != node or not record.devices:
        return None
    ordered = sorted(record.devices, key=lambda s: s.index)
    by_uuid = {d.uuid: d for d in cv.snapshot.devices if d.uuid}
    devices = []
    for i, share in enumerate(ordered):
        # libvgpu numbers devices as the workload sees them; map by UUID where it recorded one.
        rec = by_uuid.get(share.uuid) or accounting.device(cv.snapshot, i)
        limit = rec.limit_bytes if rec is not None and rec.limit_bytes else share.memory_mib * MIB
        sm = rec.sm_limit_percent if rec is not None and rec.sm_limit_percent else (share.cores if 0 < share.cores < 100 else 0)
        devices.append(DeviceUsage(uuid=share.uuid, index=share.index, used_bytes=rec.used_bytes if rec else 0,
                                   limit_bytes=limit, sm_limit=sm))
    return ClaimUsage(node=node, claim=cv.claim, tenant=record.tenant, devices=devices, processes=len(cv.processes))


def node_usage(view: NodeView, claims: list[ClaimUsage]) -> NodeUsage:
    entries = view.ledger.entries.values() if view.ledger else []
    return NodeUsage(
        node=view.node,
        claims=sum(1 for cv in view.claims.values() if cv.live and cv.record and cv.record.node == view.node),
        allocated_memory_mib=sum(s.memory_mib for e in entries for s in e.shares),
        used_memory_bytes=sum(d.used_bytes for c in claims for d in c.devices),
    )


def _key(event: msgspec.Struct) -> bytes:
    """The event without its timestamp: what 'changed' compares."""
    return msgspec.json.encode(msgspec.structs.replace(event, ts=0.0))


@dataclass
class UsageGate:
    """Decides which usage events are worth publishing now."""

    heartbeat: float
    last: dict[str, tuple[bytes, float]] = field(default_factory=dict)

    def due(self, name: str, event: msgspec.Struct, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        key = _key(event)
        prev = self.last.get(name)
        if prev is not None and prev[0] == key and now - prev[1] < self.heartbeat:
            return False
        self.last[name] = (key, now)
        return True

    def forget_except(self, names: set[str]) -> None:
        for name in list(self.last):
            if name not in names:
                del self.last[name]
