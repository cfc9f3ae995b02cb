"""The two outcomes placement writes: ``allocated`` and ``unschedulable``, one writer each.

The batch path and the one-claim path used to write each outcome their own way (and so decided the
lost-race cases twice). Here a writer takes any number of outcomes: the claim records go out
pipelined by compare-and-set against the revision each was based on, an outcome whose record moved
meanwhile is decided again from what the record says now (the careful path), and the events of
those written go out pipelined. A lost race of an allocation gives back only what this attempt
took: its own ledger entry, and the quota only if the claim lives nowhere else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import msgspec

from tessera.shared import subjects
from tessera.shared.bus import Outgoing
from tessera.shared.events import ClaimAllocated, ClaimRecord, ClaimRequested, ClaimUnschedulable, LedgerEntry, Nomination
from tessera.shared.lifecycle import ON_NODE, UNPLACED, allocated_msg_id

from tessera.placement.lease import unleased

if TYPE_CHECKING:
    from tessera.placement.service import PlacementService


@dataclass(frozen=True)
class Allocation:
    event: ClaimRequested
    node: str
    entry: LedgerEntry
    record: ClaimRecord  # as read (or, on the fast path, as the ``requested`` event implies)
    revision: int | None  # the record's revision it was read at (None: unknown, re-read)
    headers: dict[str, str] | None = None  # a traceparent captured where it was decided


@dataclass(frozen=True)
class Refusal:
    event: ClaimRequested
    reason: str
    filtered: dict[str, int]
    record: ClaimRecord
    revision: int | None
    headers: dict[str, str] | None = None
    first: bool = True  # the claim was not waiting here before (so it is news even if unchanged)


class OutcomeWriter:
    def __init__(self, svc: "PlacementService") -> None:
        self.svc = svc

    # --- allocated --------------------------------------------------------------------------

    async def allocated(self, items: list[Allocation]) -> list[BaseException | bool]:
        """Record and announce allocations; per item True (allocated), False (the claim had
        moved on: what this attempt took is given back) or the error that stopped it."""
        svc = self.svc
        now = time.time()
        records = [msgspec.structs.replace(unleased(a.record), state="allocated", node=a.node,
                                           devices=list(a.entry.shares), reason="", updated=now) for a in items]
        fast = [(i, a.revision) for i, a in enumerate(items) if a.revision]  # (index, the revision it was read at)
        revisions = await svc.claims.replace_many([(records[i], read) for i, read in fast]) if fast else []
        written: dict[int, ClaimRecord | None] = {i: records[i] for (i, _), rev in zip(fast, revisions)
                                                  if rev is not None}
        out: list[BaseException | bool] = [True] * len(items)
        now, latency = time.time(), svc.metrics.allocated.observe
        for i, a in enumerate(items):
            if i in written:
                continue
            try:  # the record moved since (a release request, a peer): the careful path decides
                written[i] = await self._settle_allocation(a)
            except Exception as exc:
                out[i] = exc
                continue
            if written[i] is None:
                out[i] = False
        announce = []
        for i, a in enumerate(items):
            record = written.get(i)
            if record is None:
                continue
            event = a.event
            svc._forget(event.claim)
            svc.counts["allocated"] += 1
            latency(now - event.ts)
            svc._kube_allocated(event.claim, event.tenant, a.node, a.entry.shares, event.kube or record.kube)
            announce.append(Outgoing(
                subjects.claim(event.tenant, event.claim, "allocated", a.node),
                ClaimAllocated(claim=event.claim, tenant=event.tenant, node=a.node, devices=list(a.entry.shares),
                               spec=event.spec),
                allocated_msg_id(event.claim, len(record.withdrawn)), a.headers))
        if announce:
            await svc.bus.publish_many(announce)
        return out

    async def _settle_allocation(self, a: Allocation) -> ClaimRecord | None:
        """Write ``allocated`` from the record as it is now; None if the claim has moved on."""
        svc, claim = self.svc, a.event.claim
        while True:
            current, revision = await svc.claims.get(claim)
            if current is None or current.state not in UNPLACED or current.release_requested:
                if current is not None and current.node == a.node and current.state in ON_NODE \
                        and list(current.devices) == list(a.entry.shares):
                    return current  # our own earlier write (a redelivery after a crash): say it again
                # A peer allocated it elsewhere, or it was released meanwhile: give back what we
                # took, our entry only (not a peer's), and the quota only if the claim lives nowhere
                # (the reservation is the claim's, so a winner's would go with it).
                live = current is not None and current.state in ON_NODE
                await svc.ledger.give_back(a.event.tenant, claim, a.node, shares=list(a.entry.shares), quota=not live)
                svc._forget(claim)
                return None
            new = msgspec.structs.replace(unleased(current), state="allocated", node=a.node,
                                          devices=list(a.entry.shares), reason="", updated=time.time())
            assert revision is not None  # ClaimStore.get gives a record with its revision
            if await svc.claims.replace(new, revision) is not None:
                return new

    # --- unschedulable ----------------------------------------------------------------------

    async def unschedulable(self, items: list[Refusal]) -> list[BaseException | None]:
        """Record and announce refusals; the claims wait in ``pending`` for a change."""
        svc = self.svc
        now = time.time()
        news: list[Refusal] = []
        at: list[int] = []  # news[k] is items[at[k]]
        for i, r in enumerate(items):
            svc.pending[r.event.claim] = r.event
            svc.counts["unschedulable"] += 1
            if not (r.record.state == "unschedulable" and r.record.reason == r.reason and not r.first):
                news.append(r)  # else nothing new to say
                at.append(i)
        records = [msgspec.structs.replace(unleased(r.record), state="unschedulable", reason=r.reason, updated=now)
                   for r in news]  # (with the claim's nomination, if it preempted)
        fast = [(i, r.revision) for i, r in enumerate(news) if r.revision]  # (index, the revision it was read at)
        revisions = await svc.claims.replace_many([(records[i], read) for i, read in fast]) if fast else []
        written = {i for (i, _), rev in zip(fast, revisions) if rev is not None}
        out: list[BaseException | None] = [None] * len(items)
        announce = []
        for i, r in enumerate(news):
            if i not in written:
                try:
                    done = await svc.claims.transition(r.event.claim, "unschedulable",
                                                       _refused_because(r.reason, r.record.nominated))
                except Exception as exc:
                    out[at[i]] = exc
                    continue
                if done is None:  # moved on (allocated by a peer, released): not waiting any more
                    svc._forget(r.event.claim)
                    continue
            svc._kube_unschedulable(r.event.claim, r.event.kube or r.record.kube, r.reason)
            announce.append(Outgoing(
                subjects.claim(r.event.tenant, r.event.claim, "unschedulable"),
                ClaimUnschedulable(claim=r.event.claim, tenant=r.event.tenant, reason=r.reason, filtered=r.filtered,
                                   nominated=r.record.nominated),
                None, r.headers))
        if announce:
            await svc.bus.publish_many(announce)
        return out


def _refused_because(reason: str, nominated: Nomination | None) -> Callable[[ClaimRecord], ClaimRecord]:
    """The update that records a refusal: the record unleased, with its reason (and nomination)."""
    return lambda rec: msgspec.structs.replace(unleased(rec), reason=reason, nominated=nominated)
