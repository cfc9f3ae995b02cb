"""ResourceClaims become Tessera claims, and their end becomes a release.

In Kubernetes mode a GPU pod's claim is a ResourceClaim that Kubernetes' resourceclaim controller
makes from the webhook's template. This loop follows the ResourceClaims of the Tessera device class
in every namespace: a new one is published as ``requested`` (claim id from its uid, tenant from its
namespace — one naming no tenant, or one Tessera does not have, gets an Event saying how to fix it
and is asked again at every pass —, spec from its opaque config with what kube-scheduler's filters
will read of its pod, the ResourceClaim and pod it stands for); one deleted, or being deleted with no pod using it, is
released. Kubernetes' resourceclaim controller removes the allocation itself when the last pod using
the claim is done (its reservation and allocation go in one status write, before the claim is
deleted): that is the ordinary end of a GPU pod, released quietly. One whose allocation someone else
removed while its pod waits to be bound (kube-scheduler does, when it cannot bind the pod where the
claim is allocated) is published as ``deallocated``, with the pod's constraints as they are now:
placement places it again, so the pod is never left without one. Watches miss things (a translator
down, a stream broken, a resourceVersion expired), so before every watch, at start and then every
reconcile period, the claims bucket is compared with a fresh list and both sides repaired (a
deallocation missed meanwhile is recognised by the pod: its gate, which placement lifts only after
writing the allocation, is gone, and it is not bound).

Decisions are ``claimflow``'s, Kubernetes I/O is ``kube.Cluster``'s, and the bus is the service's
(``ClaimSink``): this module only sequences them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

import msgspec

from tessera.shared.events import ClaimRecord, ClaimSpec
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, KubeClaimRef, is_tessera_claim
from tessera.shared.podconstraints import PodConstraints

from tessera.translator import claimflow
from tessera.translator.kube import Cluster

log = logging.getLogger("tessera.translator.claims")

# Release reasons, as they appear on the release event and the claim's record.
DELETED = "resourceclaim-deleted"
UNUSED = "resourceclaim-unused"  # deallocated by the resourceclaim controller: its pods are done
MISSING = "resourceclaim-missing"


class ClaimSink(Protocol):
    """What the service does with the claims the watcher finds (its submit and release paths)."""

    async def records(self) -> list[ClaimRecord]: ...

    async def flush(self) -> None:
        """Send again what was recorded but could not be published."""

    async def request_kube(self, claim: str, tenant: str, spec: ClaimSpec, ref: KubeClaimRef) -> bool:
        """Record and publish ``requested``; False if the claim was recorded already (nothing sent)."""

    async def tenant_exists(self, tenant: str) -> bool:
        """Whether Tessera has the tenant (in its ``tenants`` bucket)."""

    async def release_kube(self, claim: str, reason: str) -> bool:
        """Publish the release of a live Kubernetes claim; False if there was nothing to release."""

    async def resend_release(self, record: ClaimRecord) -> None:
        """Publish again the release of a claim whose record is marked ``release_requested``."""

    async def deallocated_kube(self, claim: str, pod: PodConstraints | None, seen: str = "") -> str | None:
        """Publish ``deallocated`` for a claim placement had allocated (its record ``allocated``, not
        being released), ``seen`` in the ResourceClaim at that resourceVersion; the node it was on,
        or None if there was nothing to say."""


class ClaimWatcher:
    def __init__(self, cluster: Cluster, sink: ClaimSink, period: float,
                 on_synced: Callable[[], None] | None = None) -> None:
        self.cluster = cluster
        self.sink = sink
        self.period = period
        self.on_synced = on_synced
        # Claim ids known to have a record: a MODIFIED event for one (placement writing its status)
        # costs no namespace read and no bucket write.
        self.recorded: set[str] = set()
        # ResourceClaim uids last seen with status.allocation: losing it then is a deallocation.
        self.allocated: set[str] = set()
        # ... and with a pod in status.reservedFor: losing both then is the pods' end, not news.
        self.reserved: set[str] = set()
        # (uid, message) already reported as an Event by this process: one report, not one a period.
        self.reported: set[tuple[str, str]] = set()
        self.started = False

    async def run(self) -> None:
        """Forever: reconcile, then watch until the next reconcile is due (or the watch breaks)."""
        failures = 0
        while True:
            try:
                version = await self.reconcile()
                failures = 0
                if self.on_synced is not None:
                    self.on_synced()
                async with asyncio.timeout(self.period):
                    async with contextlib.aclosing(self.cluster.watch_claims(version, self.period)) as changes:
                        async for kind, obj in changes:
                            await self.on_change(kind, obj)
            except TimeoutError:
                continue  # the period is over: reconcile again
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # API server or NATS away: retry, never stop the service
                failures += 1
                delay = min(30.0, 0.5 * 2 ** min(failures, 6))
                log.warning("ResourceClaim sync failed (%r); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)

    async def reconcile(self) -> str:
        """Repair the claims bucket against a fresh list; the resourceVersion to watch from."""
        await self.sink.flush()
        records = await self.sink.records()  # before the list: see claimflow.reconcile
        items, version = await self.cluster.list_claims()
        claims = [c for c in items if is_tessera_claim(c)]
        repairs = claimflow.reconcile(claims, records)
        live = {claimflow.tessera_id(c) for c in claims}
        self.recorded = {r.claim for r in records} & live
        seen_allocated, seen_reserved = self.allocated, self.reserved
        self.allocated = {c["metadata"]["uid"] for c in claims if claimflow.is_allocated(c)}
        self.reserved = {c["metadata"]["uid"] for c in claims if claimflow.is_reserved(c)}
        for claim in claims:
            uid = claim["metadata"]["uid"]
            if claimflow.is_ended(claim):
                await self.release(claim, DELETED)
            elif uid in seen_allocated - self.allocated:  # between watch and list
                await self.deallocated(claim, was_reserved=uid in seen_reserved)
        for unallocated in repairs.unallocated:
            if unallocated["metadata"]["uid"] not in seen_allocated:  # (else just handled)
                await self.deallocated(unallocated, was_reserved=False)  # taken back unseen, perhaps
        for record in repairs.release:
            if await self.sink.release_kube(record.claim, MISSING):
                log.info("claim %s has no ResourceClaim any more: released", record.claim)
        if not self.started:
            # Only at start: a release marked by a translator that stopped before it was sent. (Later
            # the release is on its way or kept for ``flush``; the repeat is dropped by message id or
            # ignored by placement, a released claim being released.)
            for record in repairs.resend:
                log.info("claim %s was marked for release before a restart: sending its release again",
                         record.claim)
                await self.sink.resend_release(record)
            self.started = True
        for requested in repairs.request:
            await self.admit(requested)
        return version

    async def on_change(self, kind: str, claim: Mapping) -> None:
        if not is_tessera_claim(claim):
            return
        uid = claim["metadata"]["uid"]
        if kind == "DELETED" or claimflow.is_ended(claim):
            await self.release(claim, DELETED)
            return
        if claimflow.is_deleting(claim):
            return  # still used by a pod: released when the pod stops (reservedFor empties) or it is gone
        allocated = claimflow.is_allocated(claim)
        was_reserved = uid in self.reserved
        if claimflow.is_reserved(claim):
            self.reserved.add(uid)
        else:
            self.reserved.discard(uid)
        if uid in self.allocated and not allocated:
            self.allocated.discard(uid)
            await self.deallocated(claim, was_reserved=was_reserved)
            return
        if allocated:
            self.allocated.add(uid)
        await self.admit(claim)

    async def deallocated(self, claim: Mapping, *, was_reserved: bool) -> None:
        """The ResourceClaim shows no allocation though placement allocated it. Taken back by
        kube-scheduler (or a person) only if its pod waits ungated and unbound: placement lifts the
        gate only once the allocation is written, and the scheduler touches no gated pod; while the
        gate is on, placement itself is writing or withdrawing it. (Tessera clears an allocation
        when it releases a claim too, and its record then says so: only a live one is news.)"""
        if was_reserved and not claimflow.is_reserved(claim):
            # the resourceclaim controller's deallocation of a claim whose pods are done
            await self.release(claim, UNUSED)
            return
        try:
            cid = claimflow.tessera_id(claim)
        except ValueError:
            return  # never admitted
        self.allocated.discard(claim["metadata"]["uid"])
        ref = claimflow.claim_ref(claim)
        pod = await self.cluster.pod(ref.namespace, ref.pod) if ref.pod else None
        if not claimflow.waits_unallocated(pod, ref):
            return
        node = await self.sink.deallocated_kube(cid, claimflow.pod_constraints(pod, ref),
                                                str(claim["metadata"].get("resourceVersion") or ""))
        if node is None:
            return
        log.info("ResourceClaim %s/%s: its allocation on %s was removed; claim %s is placed again",
                 ref.namespace, ref.name, node, cid)
        await self.report(claim, "Deallocated",
                          f"the allocation of this claim on node {node} was removed outside Tessera (kube-scheduler "
                          "does so when it cannot bind the pod there); Tessera places the claim again")

    async def admit(self, claim: Mapping) -> None:
        """Publish ``requested`` for a ResourceClaim not yet recorded, or say on it why not."""
        try:
            cid = claimflow.tessera_id(claim)
        except ValueError as exc:
            await self.report(claim, "NotATesseraClaim", str(exc))
            return
        if cid in self.recorded:
            return
        ref = claimflow.claim_ref(claim)
        namespace = await self.cluster.namespace(ref.namespace)
        tenant = claimflow.namespace_tenant(namespace)
        problem = claimflow.tenant_problem(ref.namespace, tenant)
        if problem is not None:
            await self.report(claim, "NoTenant", problem)
            return
        assert tenant is not None  # (tenant_problem finds none only in a tenant that is named)
        if not await self.sink.tenant_exists(tenant):  # asked again at every pass: created, it is requested
            await self.report(claim, "UnknownTenant", claimflow.unknown_tenant(ref.namespace, tenant))
            return
        try:
            spec = claimflow.recover_spec(claim)
        except claimflow.Unrecoverable as exc:
            await self.report(claim, "InvalidClaim", f"Tessera cannot allocate this claim: {exc}")
            return
        if ref.pod:  # what kube-scheduler's filters will read of the pod: placement honours it
            pod = claimflow.pod_constraints(await self.cluster.pod(ref.namespace, ref.pod), ref)
            spec = msgspec.structs.replace(spec, pod=pod)
        if await self.sink.request_kube(cid, tenant, spec, ref):
            log.info("ResourceClaim %s/%s is claim %s of tenant %s", ref.namespace, ref.name, cid, tenant)
        self.recorded.add(cid)

    async def release(self, claim: Mapping, reason: str) -> bool:
        """Release the claim of this ResourceClaim; True if this call released a live claim."""
        try:
            cid = claimflow.tessera_id(claim)
        except ValueError:
            return False  # never admitted
        self.allocated.discard(claim["metadata"]["uid"])
        self.reserved.discard(claim["metadata"]["uid"])
        if not await self.sink.release_kube(cid, reason):
            return False
        ref = claimflow.claim_ref(claim)
        log.info("ResourceClaim %s/%s (%s): claim %s released", ref.namespace, ref.name, reason, cid)
        return True

    async def report(self, claim: Mapping, reason: str, message: str) -> None:
        """A Warning Event on the claim and on its pod, once per process; never fatal."""
        uid = (claim.get("metadata") or {}).get("uid", "")
        if (uid, message) in self.reported:
            return
        log.warning("ResourceClaim %s/%s: %s", (claim.get("metadata") or {}).get("namespace"),
                    (claim.get("metadata") or {}).get("name"), message)
        ref = claimflow.claim_ref(claim)
        # List items and watch objects need not say their kind: name it for involvedObject.
        targets = [{**claim, "apiVersion": RESOURCE_API_VERSION, "kind": "ResourceClaim"}]
        if ref.pod:
            targets.append({"apiVersion": "v1", "kind": "Pod",
                            "metadata": {"name": ref.pod, "namespace": ref.namespace, "uid": ref.pod_uid}})
        failed = False
        for target in targets:
            try:
                await self.cluster.event(target, reason, message)
            except Exception as exc:  # refused (a namespace being deleted, RBAC) or unreachable: the
                failed = True          # report is lost, never the sync pass (tried again next pass)
                log.warning("Event %s on %s %s/%s not written: %s", reason, target["kind"], ref.namespace,
                            target["metadata"]["name"], exc)
        if not failed:
            self.reported.add((uid, message))
