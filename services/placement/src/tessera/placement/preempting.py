"""Placement's part of preempting: releasing the victims a claim that fits nowhere may displace.

`preemption` chooses the victims on each node from placement's view of the ledger; this picks the
node whose victims cost least (the same order) and releases them the way any release of a claim on
a node travels: the claim's record is marked release-requested with the reason, and the request is
addressed to the node's enforcer, which stops the workload (SIGTERM, then SIGKILL after its grace
period), removes the ledger entry and records the claim released. The preempting claim stays
waiting meanwhile and is placed by the retry that the ledger's change wakes: it is committed only
where the ledger, read as it is then, has room, so no GPU is over-committed at any instant.

On Kubernetes the victims' pods are evicted first (the Eviction API, all or none: `evict_all`),
so their PodDisruptionBudgets can refuse and the kubelet stops their containers with the pods' own
grace period; the enforcer, which cannot signal a container's processes, waits for them to go.

The preemptor is nominated (`Nomination`, in its claim record and its ``unschedulable`` event):
every replica's view holds the room its victims free for it, against claims of no higher
priority, until it is placed (`FleetView.nominate`). A victim is preempted for one claim only:
it is marked release-requested by compare-and-set, and one already marked for another claim is
never chosen again (a replica that loses that race chooses anew without it). While any of its
victims is still stopping (its grace period running), a retry of the preemptor waits for them
and chooses no more; only once they are all gone and it still fits nowhere does it choose again.

A claim within its tenant's guarantee may also reclaim other tenants' borrowing claims, whatever
the priorities (`fairshare`): they are chosen among the victims on the same terms, released the
same way, and their records, events and spans say which tenant reclaimed them for its guarantee;
the room they free is held for the reclaiming claim against every other claim (`Nomination.reclaim`).

Not done here (yet): claims of several requests, host CPU and memory.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from collections.abc import Collection
from typing import TYPE_CHECKING

import msgspec

from tessera.shared.errors import TemporaryError
from tessera.shared.events import (
    ClaimRecord, ClaimReleaseRequested, ClaimRequested, ClaimSpec, GpuDevice, LedgerEntry, Nomination, now,
)
from tessera.shared.kubeclaims import KubeClaimRef
from tessera.shared.ledger import held_by_tenant, tenant_totals
from tessera.shared.lifecycle import TERMINAL, ReleaseRoute
from tessera.shared.telemetry import NODE, claim_attributes, decided

from tessera.placement.fairshare import Reclaim, amount_of
from tessera.placement.mix import demand_of
from tessera.placement.preemption import Need, NoVictims, Victims, choose_victims
from tessera.placement.quota import has_limits

if TYPE_CHECKING:
    from tessera.placement.kube import KubeWriter
    from tessera.placement.service import PlacementService

log = logging.getLogger(__name__)

PREEMPTED_BY = "tessera.preempted_by"  # span attribute: the claim that took the victim's place
RECLAIMED_FOR = "tessera.reclaimed_for"  # span attribute: the tenant whose guarantee a victim was reclaimed for
RACES = 3  # how often a choice is made anew after a peer took one of its victims first


def need_of(spec: ClaimSpec, devices: list[GpuDevice]) -> Need:
    """The claim's per-GPU demand on these GPUs (a memory percentage of the smallest of them)."""
    memory = spec.memory_mib
    if memory is None and spec.memory_percent is not None and devices:
        memory = min(d.memory_mib for d in devices) * spec.memory_percent // 100
    return Need(gpus=spec.gpus, memory_mib=memory, cores=spec.cores)


def eligible(spec: ClaimSpec, devices: list[GpuDevice]) -> list[GpuDevice]:
    """The GPUs the claim's own filters allow, by the engine's rules (`Demand`)."""
    demand = demand_of(spec)
    return [d for d in devices if demand.model_ok(d.model.lower()) and demand.uuid_ok(d.uuid)]


class Preemptions:
    def __init__(self, svc: "PlacementService") -> None:
        self.svc = svc
        self._retry: asyncio.TimerHandle | None = None

    def choose(self, claim: str, spec: ClaimSpec, spared: set[str],
               excluded: Collection[str] = (), reclaim: Reclaim | None = None) -> tuple[str, Victims] | NoVictims:
        """The node and victims that cost least for this claim, or why there are none; none of
        ``spared``, none on the ``excluded`` nodes (where its pod cannot be bound), and the room
        held for other preemptors counted as taken (`FleetView`). With ``reclaim``, other tenants'
        borrowing claims may be chosen too where the claim is within its tenant's guarantee."""
        if spec.requests:
            return NoVictims("a claim of several requests does not preempt (not supported yet)")
        if spec.cpu_millis or spec.host_memory_mib:
            return NoVictims("a claim asking for host CPU or memory does not preempt (not supported yet)")
        best: tuple[tuple, str, Victims] | None = None
        reasons: list[str] = []
        for node, inventory in sorted(self.svc.inventories.items()):
            if (spec.node is not None and node != spec.node) or node in excluded:
                continue
            devices = eligible(spec, list(inventory.devices))
            if len(devices) < spec.gpus:
                continue
            ledger, _ = self.svc.view.ledger_of(node)
            entries = {c: e for c, e in ledger.entries.items() if c != claim}
            entries.update(self.svc.view.held_for_others(node, claim, spec.priority))
            need = need_of(spec, devices)
            reclaimable: set[str] = set()
            admissible = None
            if reclaim is not None and reclaim.covers(amount_of(need, min(d.memory_mib for d in devices))):
                reclaimable = reclaim.candidates(entries.values())
                admissible = partial(reclaim.allows, reclaimed=reclaimable)
            elif spec.priority <= 0:
                reasons.append(f"{node}: priority 0 preempts nothing, and the claim is beyond its tenant's "
                               "guarantee (it may reclaim only within it)")
                continue
            got = choose_victims(need, devices, entries, spec.priority, eligible={d.index for d in devices},
                                 spared=spared, reclaimable=reclaimable, admissible=admissible)
            if isinstance(got, NoVictims):
                reasons.append(f"{node}: {got.reason}")
            elif got.claims:  # (none: it fits there by GPU, and what the engine refused is not a GPU)
                key = (got.order, node)
                if best is None or key < best[0]:
                    best = (key, node, got)
        if best is None:
            return NoVictims("; ".join(reasons) or "no node has GPUs this claim may use")
        return best[1], best[2]

    async def attempt(self, event: ClaimRequested) -> tuple[str | None, Nomination | None]:
        """Release the cheapest victims for this claim, or wait for those already released for it:
        what to tell about it (None: preemption is off) and its nomination (None: it has none)."""
        if not self.svc.settings.preemption:
            return None, None
        reclaim = await self._reclaim(event.tenant)
        if event.spec.priority <= 0 and reclaim is None:
            return "nothing to preempt: priority 0 is the lowest, and only lower priorities are preempted", None
        if not event.spec.may_preempt:
            return ("nothing preempted: this claim may not preempt (its PriorityClass says preemptionPolicy: "
                    "Never); it waits for room"), None
        own = self.svc.view.nominations.get(event.claim)
        if own is not None:
            ledger, _ = self.svc.view.ledger_of(own.node)
            stopping = [v.claim for v in own.victims if v.claim in ledger.entries]
            if stopping:  # room on the way: no more victims meanwhile
                return (f"waiting for {', '.join(stopping)} on {own.node} to stop (preempted for this claim): "
                        "placed once they are released"), own
        spared = self.svc.view.victims_taken(event.claim)
        excluded = self.svc.excluded_nodes(event.spec, event.kube)
        for _ in range(RACES):
            chosen = self.choose(event.claim, event.spec, spared, excluded, reclaim)
            if isinstance(chosen, NoVictims):
                return f"nothing to preempt: {chosen.reason}", None
            node, victims = chosen
            ledger, _ = self.svc.view.ledger_of(node)
            entries = [ledger.entries[v] for v in victims.claims]
            taken = await self._take(event, entries, reclaim)
            if taken:  # a peer preempted one of them for another claim first: choose without it
                spared |= taken
                continue
            refused = await self._evict(victims.claims)
            if refused:
                await self._give_up(event, entries)
                self._retry_later()
                return (f"nothing preempted: {refused}; tried again in "
                        f"{self.svc.settings.preemption_retry_seconds:g}s"), None
            await self._release(event, node, entries, reclaim)
            nomination = Nomination(node=node, victims=entries, priority=event.spec.priority,
                                    reclaim=any(self._reclaimed(event, e) for e in entries))
            return f"preempting {', '.join(victims.claims)} on {node}: placed once they are released", nomination
        return "nothing preempted: peers kept taking the victims chosen first; tried again with the next change", None

    async def _reclaim(self, tenant: str) -> Reclaim | None:
        """What reclaiming for ``tenant`` goes by (None: it has no guarantee to reclaim)."""
        quota = self.svc.quotas.get(tenant)
        if quota is None or not has_limits(quota):
            return None
        usage, _ = await self.svc.ledger.read_tenant(tenant)
        ledgers = [ledger for ledger, _ in self.svc.view.node_ledgers.values()]
        return Reclaim(tenant=tenant, quota=quota, held=tenant_totals(usage), others=held_by_tenant(ledgers),
                       records=self.svc.view.tenant_records)

    @staticmethod
    def _reclaimed(event: ClaimRequested, entry: LedgerEntry) -> bool:
        """Whether ``entry`` is a victim for reclaim only (not of lower priority than the claim)."""
        return not (entry.preemptible and entry.priority < event.spec.priority)

    def _reason(self, event: ClaimRequested, entry: LedgerEntry, reclaim: Reclaim | None = None) -> str:
        if reclaim is not None and self._reclaimed(event, entry):
            return f"preempted by {event.claim} of tenant {event.tenant}: {reclaim.reason(entry)}"
        return (f"preempted by {event.claim} of tenant {event.tenant} (priority {event.spec.priority} > "
                f"{entry.priority})")

    async def _take(self, event: ClaimRequested, entries: list[LedgerEntry], reclaim: Reclaim | None = None,
                    ) -> set[str]:
        """Mark each victim release-requested for this claim, by compare-and-set; the victims a
        peer marked first (for another claim, or released otherwise) are given back as taken, and
        then none stays marked for this claim."""
        ours = f"preempted by {event.claim} "
        taken: set[str] = set()
        marked: list[LedgerEntry] = []
        for entry in entries:
            reason = self._reason(event, entry, reclaim)

            def mark(record: ClaimRecord | None, reason: str = reason) -> ClaimRecord | None:
                if record is None or record.release_requested or record.state in TERMINAL:
                    return None  # (ours already, from an attempt cut short, or a peer's)
                return msgspec.structs.replace(record, release_requested=True, reason=reason, updated=now())

            record, _ = await self.svc.claims.bucket.modify(entry.claim, mark)
            if record is None or not record.reason.startswith(ours):
                taken.add(entry.claim)
            else:
                marked.append(entry)
        if taken:
            await self._give_up(event, marked)
        return taken

    async def _give_up(self, event: ClaimRequested, entries: list[LedgerEntry]) -> None:
        """Unmark the victims this claim marked and will not release after all (nothing was sent)."""
        ours = f"preempted by {event.claim} "

        def unmark(record: ClaimRecord | None) -> ClaimRecord | None:
            if record is None or not record.release_requested or not record.reason.startswith(ours):
                return None
            return msgspec.structs.replace(record, release_requested=False, reason="", updated=now())

        for entry in entries:
            await self.svc.claims.bucket.modify(entry.claim, unmark)

    async def _release(self, event: ClaimRequested, node: str, entries: list[LedgerEntry],
                       reclaim: Reclaim | None = None) -> None:
        """Send each marked victim's release to its node's enforcer, told in its own trace."""
        route = ReleaseRoute("enforcer", node)
        for entry in entries:
            victim = entry.claim
            reason = self._reason(event, entry, reclaim)
            why = {RECLAIMED_FOR: event.tenant} if reclaim is not None and self._reclaimed(event, entry) else {}
            marked, _ = await self.svc.claims.get(victim)
            # In the victim's own trace (one claim, one trace): who took its place, and why.
            parent = {"traceparent": marked.traceparent} if marked is not None and marked.traceparent else None
            with self.svc.ctx.telemetry.span("placement preempt", parent_headers=parent,
                                             attributes=claim_attributes(marked or entry)):
                await self.svc.bus.publish(
                    route.subject(entry.tenant, victim),
                    ClaimReleaseRequested(claim=victim, tenant=entry.tenant, reason=reason),
                    msg_id=route.msg_id(victim),
                )
                decided(marked or entry, "preempted", reason, span=None,
                        **{NODE: node, PREEMPTED_BY: event.claim, **why})
        log.info("%s (priority %d) preempts %s on %s", event.claim, event.spec.priority,
                 [e.claim for e in entries], node)

    def _retry_later(self) -> None:
        """Wake the waiting claims' retry once the refusal may be over (one timer at a time): a
        budget's change is not in Tessera's ledger, so nothing else would wake them."""
        loop = asyncio.get_running_loop()
        if self._retry is None or self._retry.when() <= loop.time():
            self._retry = loop.call_later(self.svc.settings.preemption_retry_seconds, self.svc.retry_waiting)

    async def _evict(self, victims: list[str]) -> str:
        """On Kubernetes, the victims' pods go through the Eviction API first (`evict_all`)."""
        sync = self.svc.kube
        if sync is None:
            return ""
        refs = []
        for victim in victims:
            record, _ = await self.svc.claims.get(victim)
            if record is not None and record.kube is not None:
                refs.append(record.kube)
        return await evict_all(sync.writer, refs)


async def evict_all(writer: KubeWriter, refs: list[KubeClaimRef]) -> str:
    """Evict the pods of ``refs``, all or none: each is asked with a dry run first, then for real
    (a budget that changes in between refuses the real one, said the same way; the ones evicted
    before it are then released the way any deleted pod's claim is). The kubelet stops an evicted
    pod's containers with the pod's own grace period; the enforcer releases the claim once they
    are gone. Why not, or "" when all were evicted."""
    for dry_run in (True, False):
        for ref in refs:
            try:
                why = await writer.evict(ref, dry_run=dry_run)
            except TemporaryError as exc:
                return f"the eviction of pod {ref.namespace}/{ref.pod} failed ({exc}); tried again with the claim"
            if why:
                return why
    return ""
