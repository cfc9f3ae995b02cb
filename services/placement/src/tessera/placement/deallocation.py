"""A claim kube-scheduler took back is placed again: a pod is never left without an allocation.

Placement honours the scheduler's node filters (`nodefilters`), but the cluster moves after a
decision (a node cordoned or tainted the moment after, a label removed, a filter placement does not
mirror), and then kube-scheduler, unable to bind the pod where the claim is allocated, removes the
allocation (its DynamicResources PostFilter). The translator, which watches the ResourceClaims,
says so with a ``deallocated`` event naming the node, carrying the pod's constraints as they are
now. Here placement:

1. checks that the claim's record still says ``allocated`` on that node (not released, not placed
   again already: the event is then a repeat, and nothing is done) and that the ResourceClaim really
   shows no allocation now (one written again meanwhile, by a resumed status write, is live; one
   another allocator wrote — kube-scheduler allocating the claim itself on its next try — goes to
   the status sync, which adopts it into the ledger where it fits or refuses it: `adoption`);
2. gives back the claim's ledger entry on that node and its quota (nothing else of it is there: the
   kubelet prepares a claim only for a pod bound to the node, and the pod never was), the record
   touched first so that no reconciler writes the entry back meanwhile (it leaves records younger
   than its grace period alone, and re-reads the record right before it restores an entry);
3. moves the record back to ``requested`` with the fresh constraints and the node added to
   ``withdrawn`` (a compare-and-set on the revision read in 1);
4. places it as any requested claim: honouring the filters, and elsewhere than the withdrawn nodes
   while another node fits (only then on one of them again: waiting is worse than retrying).

Each step is idempotent and the event is acknowledged only at the end: a placement that stops
between two steps is redelivered the event and finds what it had done (an entry already given
back, a record already ``requested`` with the node in ``withdrawn``: go on placing it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from tessera.shared.errors import ConflictError, PermanentError
from tessera.shared.events import ClaimDeallocated, ClaimRecord, ClaimRequested
from tessera.shared.lifecycle import UNPLACED

from tessera.placement import spans
from tessera.placement.claimstatus import describes
from tessera.placement.lease import unleased

if TYPE_CHECKING:
    from tessera.placement.service import PlacementService

log = logging.getLogger("tessera.placement.deallocation")

WITHDRAWN_KEPT = 16  # the nodes a claim remembers it was taken back from, latest last


class Deallocations:
    def __init__(self, svc: "PlacementService") -> None:
        self.svc = svc

    async def handle(self, event: ClaimDeallocated) -> bool:
        """Take the claim off ``event.node`` and place it again; True if it was placed now."""
        svc = self.svc
        lock = svc.claim_locks.setdefault(event.claim, asyncio.Lock())  # (this replica's reconciler waits)
        try:
            async with lock:
                record = await self._off_the_node(event)
        finally:
            if not lock.locked() and not lock._waiters:
                svc.claim_locks.pop(event.claim, None)
        if record is None:
            return False
        # (from a redelivery, after a stop between the steps, too: the record says what was done)
        return await svc.place(ClaimRequested(claim=record.claim, tenant=record.tenant, spec=record.spec,
                                              source="kubernetes", kube=record.kube))

    async def _off_the_node(self, event: ClaimDeallocated) -> ClaimRecord | None:
        """Steps 1 to 3: the record to place again, or None if there is nothing to do."""
        svc = self.svc
        record, revision = await svc.claims.get(event.claim)
        if record is None:
            spans.settled(event, "unchanged", "no such claim")
            return None
        if record.tenant != event.tenant:
            raise PermanentError(f"deallocation of {event.claim} for tenant {event.tenant!r}: the claim is not theirs")
        if record.kube is None or record.release_requested:
            spans.settled(event, "unchanged", "released, or not a ResourceClaim's claim")
            return None
        if record.state == "allocated" and record.node == event.node:
            shown = await self._shown(record)
            if shown != "none":
                if shown == "another":  # kube-scheduler allocated it itself meanwhile, or someone else did
                    svc._kube_resume(record)  # the status sync adopts it or refuses it (`adoption`)
                spans.settled(event, "unchanged", f"the ResourceClaim is gone or shows an allocation again "
                                                  f"({shown})")
                return None
            assert revision is not None  # (ClaimStore.get gives a record with its revision)
            return await self._withdraw(record, revision, event)
        if record.state in UNPLACED and event.node in record.withdrawn:
            return record
        spans.settled(event, "unchanged", f"the claim is {record.state} on {record.node or 'no node'}")
        return None

    async def _shown(self, record: ClaimRecord) -> str:
        """What the ResourceClaim shows now: ``none`` (no allocation: taken back), ``ours`` (the
        record's node and shares, whoever wrote them), ``another`` allocation, or ``gone``."""
        sync = self.svc.kube
        if sync is None or record.kube is None:
            return "none"
        try:
            claim = await sync.writer.read_claim(record.kube)
        except PermanentError:  # gone or being deleted (ClaimGone): its release follows, nothing to redo
            return "gone"
        current = (claim.get("status") or {}).get("allocation")
        if not current:
            return "none"
        return "ours" if describes(current, record.node, list(record.devices)) else "another"

    async def _withdraw(self, record: ClaimRecord, revision: int, event: ClaimDeallocated) -> ClaimRecord:
        svc, node = self.svc, record.node
        # The record touched first: a reconciler (a peer's) restores the ledger entry of an
        # ``allocated`` claim only once the record is older than its grace period, and re-reads
        # it right before it would, so it cannot write the entry back between the two steps below.
        touched = msgspec.structs.replace(record, updated=time.time())
        revision_now = await svc.claims.replace(touched, revision)
        if revision_now is None:
            raise ConflictError(f"{record.claim}: its record moved while it was taken off {node}")
        record, revision = touched, revision_now
        await svc.ledger.give_back(record.tenant, record.claim, node)
        spec = record.spec if event.pod is None else msgspec.structs.replace(record.spec, pod=event.pod)
        withdrawn = [n for n in record.withdrawn if n != node][-(WITHDRAWN_KEPT - 1):] + [node]
        moved = msgspec.structs.replace(
            unleased(record), state="requested", node="", devices=[], spec=spec, withdrawn=withdrawn,
            reason=f"kube-scheduler took its allocation on {node} back (it could not bind the pod there)",
            updated=time.time())
        if await svc.claims.replace(moved, revision) is None:
            raise ConflictError(f"{record.claim}: its record moved while it was taken off {node}")
        svc.counts["withdrawn"] += 1
        spans.settled(event, "withdrawn", moved.reason, node=node)
        log.warning("%s: %s; placing it again", record.claim, moved.reason)
        return moved
