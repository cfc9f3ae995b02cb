"""Placement's part of releasing a claim, routed by `tessera.shared.lifecycle.release_route`.

A claim that never reached a node is placement's to end: its record moves to ``released``, and
whatever a placement that stopped midway took (the quota reserved before its ledger write, a ledger
entry whose record was never written) is given back in the same step. A claim on a node is its
enforcer's: a release that names no node is passed on to it, addressed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.shared import subjects
from tessera.shared.errors import PermanentError
from tessera.shared.events import ClaimReleased, ClaimReleaseRequested
from tessera.shared.lifecycle import UNPLACED, ReleaseRoute, release_route

from tessera.placement import spans
from tessera.placement.kubesync import Allocated

if TYPE_CHECKING:
    from tessera.placement.service import PlacementService


class Releases:
    def __init__(self, svc: "PlacementService") -> None:
        self.svc = svc

    async def cancel(self, event: ClaimReleaseRequested, addressed: bool = False) -> None:
        svc = self.svc
        record, _ = await svc.claims.get(event.claim)
        svc._forget(event.claim)
        if record is not None and record.tenant != event.tenant:
            raise PermanentError(f"release of {event.claim} by tenant {event.tenant!r}: the claim is not theirs")
        if record is None:
            spans.settled(event, "unchanged", "no such claim")
            return
        route = release_route(record.state, record.node)
        if route is None or route.owner != "placement":
            if route is not None and not addressed:
                await svc.bus.publish(route.subject(record.tenant, record.claim), event,
                                      msg_id=route.msg_id(record.claim))
                spans.settled(event, "forwarded", f"the claim is {record.state} on {record.node}", node=record.node)
            else:
                spans.settled(event, "unchanged", "the node's enforcer releases it")
            return  # on a node: the enforcer releases it
        if record.state not in UNPLACED:
            spans.settled(event, "unchanged", f"the claim is {record.state}: nothing of it is held")
            return  # failed before it was placed: nothing of it is held
        done = await svc.claims.transition(event.claim, "released", expect=lambda r: r.state in UNPLACED)
        if done is None:
            return
        spans.settled(event, "released", event.reason)
        await svc.ledger.give_back(event.tenant, event.claim, svc.claim_nodes.get(event.claim))
        await svc.bus.publish(
            subjects.claim(event.tenant, event.claim, "released"),
            ClaimReleased(claim=event.claim, tenant=event.tenant, reason=event.reason),
            msg_id=f"{event.claim}:released",
        )

    async def unannounced(self, job: Allocated, reason: str) -> None:
        """An allocation the cluster could not be told about is released as any other: a release
        addressed to the node, whose enforcer returns the ledger entry and the quota and records
        the claim released (the same message id as a forwarded release, so the two are one)."""
        route = ReleaseRoute("enforcer", job.node)
        # Marked first, as every release is: the translator then knows the allocation it sees go
        # from the ResourceClaim was ours to withdraw, not one kube-scheduler took back.
        await self.svc.claims.mark_release_requested(job.claim, f"kubernetes: {reason}")
        await self.svc.bus.publish(
            route.subject(job.tenant, job.claim),
            ClaimReleaseRequested(claim=job.claim, tenant=job.tenant, reason=f"kubernetes: {reason}"),
            msg_id=route.msg_id(job.claim),
        )
