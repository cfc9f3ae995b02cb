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

Not done here (yet): claims of several requests, host CPU and memory, holding the freed room for
the preemptor (another waiting claim may take it first, and the preemptor preempts again), and
counting victims already being stopped as room to come (each retry chooses again from the ledger,
where they stand until their processes are gone).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from tessera.shared.errors import TemporaryError
from tessera.shared.events import ClaimReleaseRequested, ClaimRequested, ClaimSpec, GpuDevice
from tessera.shared.kubeclaims import KubeClaimRef
from tessera.shared.lifecycle import ReleaseRoute
from tessera.shared.telemetry import NODE, claim_attributes, decided

from tessera.placement.mix import demand_of
from tessera.placement.preemption import Need, NoVictims, Victims, choose_victims

if TYPE_CHECKING:
    from tessera.placement.kube import KubeWriter
    from tessera.placement.service import PlacementService

log = logging.getLogger(__name__)

PREEMPTED_BY = "tessera.preempted_by"  # span attribute: the claim that took the victim's place


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

    def choose(self, claim: str, spec: ClaimSpec) -> tuple[str, Victims] | NoVictims:
        """The node and victims that cost least for this claim, or why there are none."""
        if spec.requests:
            return NoVictims("a claim of several requests does not preempt (not supported yet)")
        if spec.cpu_millis or spec.host_memory_mib:
            return NoVictims("a claim asking for host CPU or memory does not preempt (not supported yet)")
        best: tuple[tuple, str, Victims] | None = None
        reasons: list[str] = []
        for node, inventory in sorted(self.svc.inventories.items()):
            if spec.node is not None and node != spec.node:
                continue
            devices = eligible(spec, list(inventory.devices))
            if len(devices) < spec.gpus:
                continue
            ledger, _ = self.svc.view.ledger_of(node)
            entries = {c: e for c, e in ledger.entries.items() if c != claim}
            got = choose_victims(need_of(spec, devices), devices, entries, spec.priority,
                                 eligible={d.index for d in devices})
            if isinstance(got, NoVictims):
                reasons.append(f"{node}: {got.reason}")
            elif got.claims:  # (none: it fits there by GPU, and what the engine refused is not a GPU)
                key = (got.order, node)
                if best is None or key < best[0]:
                    best = (key, node, got)
        if best is None:
            return NoVictims("; ".join(reasons) or "no node has GPUs this claim may use")
        return best[1], best[2]

    async def attempt(self, event: ClaimRequested) -> str | None:
        """Release the cheapest victims for this claim; what to tell about it, or None when none."""
        if not self.svc.settings.preemption:
            return None
        if event.spec.priority <= 0:
            return "nothing to preempt: priority 0 is the lowest, and only lower priorities are preempted"
        if not event.spec.may_preempt:
            return ("nothing preempted: this claim may not preempt (its PriorityClass says preemptionPolicy: "
                    "Never); it waits for room")
        chosen = self.choose(event.claim, event.spec)
        if isinstance(chosen, NoVictims):
            return f"nothing to preempt: {chosen.reason}"
        node, victims = chosen
        refused = await self._evict(victims.claims)
        if refused:
            self._retry_later()
            return f"nothing preempted: {refused}; tried again in {self.svc.settings.preemption_retry_seconds:g}s"
        ledger, _ = self.svc.view.ledger_of(node)
        route = ReleaseRoute("enforcer", node)
        for victim in victims.claims:
            entry = ledger.entries[victim]
            reason = (f"preempted by {event.claim} of tenant {event.tenant} (priority {event.spec.priority} > "
                      f"{entry.priority})")
            marked = await self.svc.claims.mark_release_requested(victim, reason)
            # In the victim's own trace (one claim, one trace): who took its place, and why.
            parent = {"traceparent": marked.traceparent} if marked is not None and marked.traceparent else None
            with self.svc.ctx.telemetry.span("placement preempt", parent_headers=parent,
                                             attributes=claim_attributes(marked or entry)):
                await self.svc.bus.publish(
                    route.subject(entry.tenant, victim),
                    ClaimReleaseRequested(claim=victim, tenant=entry.tenant, reason=reason),
                    msg_id=route.msg_id(victim),
                )
                decided(marked or entry, "preempted", reason, span=None, **{NODE: node, PREEMPTED_BY: event.claim})
        log.info("%s (priority %d) preempts %s on %s", event.claim, event.spec.priority, victims.claims, node)
        return f"preempting {', '.join(victims.claims)} on {node}: placed once they are released"

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
