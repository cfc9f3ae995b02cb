"""A tenant being deleted gives back its GPUs first: every live claim released, its quota usage zero.

Removing a tenant's quota, account and datastore while its claims still hold GPUs left those GPUs
sold to nobody: the ledger kept the shares, the tenant's usage record kept its count, and the
workloads kept running. So the manager's teardown begins here. It releases each claim of the tenant
the way any release travels (`tessera.shared.lifecycle.release_route`: to placement while the claim
is on no node, to the enforcer of its node otherwise, on the claim's ``release`` subject), then
watches the ``claims`` and ``ledger`` buckets until no claim of the tenant holds anything, no node
ledger holds one of its entries and its usage record is empty. The wait is bounded; what is left
then is returned (and shown on the tenant), and the next pass starts again from the buckets.

Releases are sent once per destination during one drain (the message id is the route's, so a
release the translator or placement already sent for the same destination is one message to the
stream); a claim that moves meanwhile (allocated while its release went to placement) gets a
release addressed to its new owner on the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import msgspec

from tessera.shared.claimstore import ClaimStore
from tessera.shared.events import ClaimRecord, ClaimReleaseRequested
from tessera.shared.ledger import Ledger
from tessera.shared.lifecycle import TERMINAL, release_route
from tessera.shared.telemetry import claim_attributes, decided

log = logging.getLogger("tessera.controlplane.claimdrain")

Publish = Callable[[str, msgspec.Struct, str], Awaitable[object]]

REASON = "tenant deleted"
POLL_SECONDS = 0.2


def holds_something(record: ClaimRecord) -> bool:
    """Whether a claim is still live (on a node, or waiting for one): it is released. A failed one
    is not (nobody releases it again); if it still holds a ledger entry or quota, the ledger and
    usage checks say so."""
    return record.state not in TERMINAL


@dataclass
class Remaining:
    """What a tenant still holds: its claims that hold something, the ledger entries of its claims
    on nodes, and the claims its quota usage record counts."""

    claims: list[ClaimRecord] = field(default_factory=list)
    entries: dict[str, str] = field(default_factory=dict)  # claim -> node whose ledger holds it
    usage: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.claims or self.entries or self.usage)

    def describe(self, limit: int = 5) -> str:
        parts = []
        if self.claims:
            shown = ", ".join(
                f"{r.claim} ({r.state}{' on ' + r.node if r.node and r.state != 'requested' else ''})"
                for r in self.claims[:limit])
            more = f" and {len(self.claims) - limit} more" if len(self.claims) > limit else ""
            parts.append(f"{len(self.claims)} claim(s) not released: {shown}{more}")
        if self.entries:
            shown = ", ".join(f"{c} on {n}" for c, n in sorted(self.entries.items())[:limit])
            parts.append(f"ledger entries left: {shown}")
        if self.usage:
            parts.append(f"quota usage still counts {len(self.usage)} claim(s): {', '.join(self.usage[:limit])}")
        return "; ".join(parts) or "nothing"


class ClaimDrain:
    def __init__(self, claims: ClaimStore, ledger: Ledger, publish: Publish, span=None) -> None:
        self.claims = claims
        self.ledger = ledger
        self.publish = publish
        # `Telemetry.span`: each release sent is a span in its claim's own trace.
        self.span = span or (lambda *a, **k: contextlib.nullcontext())

    async def remaining(self, tenant: str) -> Remaining:
        """What the tenant holds now, read from the buckets (never from memory)."""
        records = [r for r in await self.claims.all() if r.tenant == tenant]
        left = Remaining(claims=[r for r in records if holds_something(r)])
        for node in sorted({r.node for r in records if r.node}):
            ledger, _ = await self.ledger.read_node(node)
            for claim, entry in ledger.entries.items():
                if entry.tenant == tenant:
                    left.entries[claim] = node
        usage, _ = await self.ledger.read_tenant(tenant)
        left.usage = sorted(usage.claims)
        return left

    async def drain(self, tenant: str, wait_seconds: float,
                    progress: Callable[[Remaining], Awaitable[None]] | None = None) -> Remaining:
        """Release every claim of ``tenant`` and wait up to ``wait_seconds`` until it holds nothing;
        returns what is left (empty: done). ``progress`` hears each change of what is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        sent: set[str] = set()
        shown = ""
        while True:
            left = await self.remaining(tenant)
            for record in left.claims:
                await self._release(record, sent)
            summary = left.describe()
            if progress is not None and summary != shown:
                await progress(left)
            shown = summary
            if not left or loop.time() >= deadline:
                return left
            await asyncio.sleep(min(POLL_SECONDS, max(0.0, deadline - loop.time())))

    async def _release(self, record: ClaimRecord, sent: set[str]) -> None:
        route = release_route(record.state, record.node)
        if route is None:
            return
        msg_id = route.msg_id(record.claim)
        if msg_id in sent:
            return
        parent = {"traceparent": record.traceparent} if record.traceparent else None
        with self.span("controlplane drain claim", parent_headers=parent, attributes=claim_attributes(record)):
            await self.publish(route.subject(record.tenant, record.claim),
                               ClaimReleaseRequested(claim=record.claim, tenant=record.tenant, reason=REASON), msg_id)
            decided(record, "release", f"{REASON}: sent to {route.node or route.owner}")
        sent.add(msg_id)
        log.info("tenant %s deleted: release of %s (%s) sent to %s", record.tenant, record.claim, record.state,
                 route.node or route.owner)
