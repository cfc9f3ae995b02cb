"""Placement's Kubernetes adapter: the one placement module that talks to an API server.

It reads the cluster too (`ClusterWatch`): the Node objects and the pods that are not over, listed
then watched, so that placement places only where kube-scheduler can then bind the pod
(`tessera.placement.clusternodes` holds them). Read here, not carried in the capacity publisher's
inventory: cordons and taints are the cluster's (an admin's, the node lifecycle controller's — its
``unreachable`` taint comes exactly when the node's own publisher is gone), and the room on a node
is what every pod there requests, GPU or not; the one service that decides reads them where they
are decided, as kube-scheduler does, and the publisher stays about GPUs.

What placement decided in the ledger has to reach the cluster: the ResourceClaim's
``status.allocation`` (an update with the claim's resourceVersion, so a concurrent writer is a 409,
not a lost write), the pod's scheduling gate lifted (only ours), Events on the pod that
``kubectl describe pod`` shows, and a pod condition of Tessera's own saying whether the pod's GPUs
are placed. Every call goes through `tessera.shared.kubeapi`, whose errors say what to do next —
a `PermanentError` (here also `ClaimGone`: give the allocation back), a `ConflictError` (re-read,
try again now), a `TemporaryError` (unreachable or overloaded: back off, try again) — and has a time
limit, past which it counts as unreachable: an API server that accepts a connection and never
answers must not hold a worker forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

from tessera.shared.errors import ConflictError, PermanentError
from tessera.shared.kubeapi import Events, Invalid, KubeApi, NotFound, Unavailable, object_path, timestamp
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, SCHEDULING_GATE, KubeClaimRef, is_tessera_claim

from tessera.placement.clusternodes import ClusterNodes
from tessera.placement.podreport import COMPONENT, condition_patch, pod_claims, subject

log = logging.getLogger("tessera.placement.kube")


PATCHED_KEPT = 4096  # pods whose last patch is kept for their condition (`KubeWriter._patched`)

# The finalizer of claims allocated by kube-scheduler (resourceapi.Finalizer): the resourceclaim
# controller removes it once the claim is deallocated and unused.
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"


class ClaimGone(PermanentError):
    """The ResourceClaim no longer exists (or a new one of the same name does): nothing to write."""


class KubeWriter:
    def __init__(self, api: KubeApi | None = None, *, timeout: float = 10.0, instance: str = "") -> None:
        self.api = api or KubeApi()
        self.timeout = timeout
        self.events = Events(self.api, COMPONENT, instance)
        # pod uid -> the pod as our last patch of it answered, for the condition written right
        # after (`set_condition`), which then needs no read of its own
        self._patched: dict[str, dict] = {}

    async def _bounded(self, what: str, call):
        """``call`` (a coroutine of the seam) within the time limit; the seam classifies its errors,
        a call past the limit counts as the API server unreachable."""
        try:
            async with asyncio.timeout(self.timeout):
                return await call
        except TimeoutError:
            raise Unavailable(0, f"{what}: no answer from the API server within {self.timeout:g}s",
                              "Timeout") from None

    # --- the ResourceClaim -----------------------------------------------------------------

    @staticmethod
    def claim_path(ref: KubeClaimRef) -> str:
        return object_path(RESOURCE_API_VERSION, "resourceclaims", ref.name, ref.namespace)

    async def read_claim(self, ref: KubeClaimRef) -> dict:
        """The claim as it is now; `ClaimGone` if it was deleted or replaced by a namesake."""
        claim = await self._bounded(f"read ResourceClaim {ref.namespace}/{ref.name}",
                                    self.api.get(self.claim_path(ref)))
        if claim is None or (claim.get("metadata") or {}).get("uid") != ref.uid:
            raise ClaimGone(f"ResourceClaim {ref.namespace}/{ref.name} (uid {ref.uid}) no longer exists")
        if (claim.get("metadata") or {}).get("deletionTimestamp"):
            raise ClaimGone(f"ResourceClaim {ref.namespace}/{ref.name} is being deleted")
        return claim

    async def protect(self, ref: KubeClaimRef, claim: dict) -> dict:
        """The claim with the delete-protection finalizer kube-scheduler puts on the claims it
        allocates (added now, with the resourceVersion read, if missing): a deleted claim then stays
        until its pods stop using it, when the resourceclaim controller clears the allocation and
        removes the finalizer, and only then are its GPUs released."""
        finalizers = list((claim.get("metadata") or {}).get("finalizers") or [])
        if DELETE_PROTECTION in finalizers:
            return claim
        body = {**claim, "metadata": {**claim["metadata"], "finalizers": [*finalizers, DELETE_PROTECTION]}}
        try:
            return await self._bounded(f"protect ResourceClaim {ref.namespace}/{ref.name}",
                                       self.api.replace(self.claim_path(ref), body))
        except NotFound:
            raise ClaimGone(f"ResourceClaim {ref.namespace}/{ref.name} was deleted before it was allocated") from None

    async def write_allocation(self, ref: KubeClaimRef, claim: dict, allocation: dict | None) -> dict:
        """Update the claim's ``status.allocation`` (None: remove it, and the reservations, which
        the API server refuses on a claim with no allocation) as of the resourceVersion in
        ``claim``; ConflictError if the claim moved since it was read."""
        status = dict(claim.get("status") or {})
        if allocation is None:
            status.pop("allocation", None)
            status.pop("reservedFor", None)
        else:
            status["allocation"] = allocation
        body = {**claim, "status": status}
        try:
            return await self._bounded(f"write status of ResourceClaim {ref.namespace}/{ref.name}",
                                       self.api.replace_status(self.claim_path(ref), body))
        except NotFound:
            raise ClaimGone(f"ResourceClaim {ref.namespace}/{ref.name} was deleted before its status was "
                            "written") from None

    # --- the pod ---------------------------------------------------------------------------

    def _pod_path(self, ref: KubeClaimRef) -> str:
        return object_path("v1", "pods", ref.pod, ref.namespace)

    async def read_pod(self, ref: KubeClaimRef) -> dict | None:
        """The claim's pod, or None if it is gone (or a new pod of the same name stands there)."""
        pod = await self._bounded(f"read pod {ref.namespace}/{ref.pod}", self.api.get(self._pod_path(ref)))
        if pod is None or (ref.pod_uid and (pod.get("metadata") or {}).get("uid") != ref.pod_uid):
            return None
        return pod

    async def evict(self, ref: KubeClaimRef, *, dry_run: bool = False) -> str | None:
        """Ask for the claim's pod to go through the Eviction API, as ``kubectl drain`` does: the
        API server refuses where a PodDisruptionBudget allows no disruption now, and an accepted
        eviction is a graceful delete, the pod's own grace period honoured (the kubelet sends its
        containers SIGTERM, SIGKILL after it). None: accepted (``dry_run``: would be), or the pod
        is gone (or another pod of its name stands there); else why it was refused. Other errors
        are raised, classified (a `TemporaryError` for an API server that is not answering)."""
        if not ref.pod or await self.read_pod(ref) is None:
            return None  # (read first: the API server retries a precondition that fails for seconds)
        body: dict = {"apiVersion": "policy/v1", "kind": "Eviction",
                      "metadata": {"name": ref.pod, "namespace": ref.namespace}}
        if ref.pod_uid:  # this pod, never a new one of the same name (one made since the read)
            body["deleteOptions"] = {"preconditions": {"uid": ref.pod_uid}}
        if dry_run:
            body.setdefault("deleteOptions", {})["dryRun"] = ["All"]
        try:
            await self._bounded(f"evict pod {ref.namespace}/{ref.pod}",
                                self.api.create(self._pod_path(ref) + "/eviction", body))
        except (NotFound, ConflictError):  # gone, or (uid precondition) replaced: ours is gone
            return None
        except Unavailable as exc:
            if exc.status == 429 and "DisruptionBudget" in (exc.body or ""):
                return f"evicting pod {ref.namespace}/{ref.pod} is refused by its PodDisruptionBudget: {exc.message}"
            raise
        return None

    async def lift_gate(self, ref: KubeClaimRef) -> bool:
        """Remove our scheduling gate from the pod (other gates stay) once all of its Tessera claims
        are allocated: True if it was removed now, False if the pod is gone, had no such gate, or
        waits for another of its claims (whose allocation lifts it). The patch tests the
        resourceVersion read, so a gate list changed meanwhile is a ConflictError, never a wrong
        index removed."""
        pod = await self.read_pod(ref)
        if pod is None:
            return False
        gates = (pod.get("spec") or {}).get("schedulingGates") or []
        if not any(g.get("name") == SCHEDULING_GATE for g in gates):
            return False
        waiting = await self._unallocated(ref, pod)
        if waiting:
            log.info("pod %s/%s keeps its gate: %s not allocated yet", ref.namespace, ref.pod, ", ".join(waiting))
            return False
        rest = [g for g in gates if g.get("name") != SCHEDULING_GATE]
        patch = [{"op": "test", "path": "/metadata/resourceVersion", "value": pod["metadata"]["resourceVersion"]},
                 {"op": "replace", "path": "/spec/schedulingGates", "value": rest} if rest
                 else {"op": "remove", "path": "/spec/schedulingGates"}]
        what = "lift the scheduling gate of"
        try:
            lifted = await self._bounded(f"{what} pod {ref.namespace}/{ref.pod}",
                                         self.api.patch(self._pod_path(ref), patch, "json"))
        except NotFound:
            return False
        except Invalid as exc:  # the "test" operation failed: the pod moved since it was read
            raise ConflictError(f"{what} pod {ref.namespace}/{ref.pod}: {exc}") from exc
        if ref.pod_uid:
            if len(self._patched) >= PATCHED_KEPT:  # (a condition never written after its lift)
                self._patched.clear()
            self._patched[ref.pod_uid] = lifted
        return True

    async def _unallocated(self, ref: KubeClaimRef, pod: dict) -> list[str]:
        """The pod's Tessera claims (other than ``ref``'s, whose allocation was just written) that
        are not allocated, or not even made yet; claims of other drivers are the scheduler's."""
        waiting = []
        for kind, name in pod_claims(pod):
            if kind == "claim" and name == ref.name:
                continue
            resource = "resourceclaims" if kind == "claim" else "resourceclaimtemplates"
            path = object_path(RESOURCE_API_VERSION, resource, name, ref.namespace)
            obj = await self._bounded(f"read {resource} {ref.namespace}/{name}", self.api.get(path))
            if obj is None:
                continue  # gone: the pod cannot start anyway, and the kubelet says so
            claim = (obj.get("spec") or {}) if kind == "template" else obj
            if is_tessera_claim(claim) and (kind == "template" or not (obj.get("status") or {}).get("allocation")):
                waiting.append(f"ResourceClaim {name}" if kind == "claim" else f"the claim of template {name}")
        return waiting

    async def set_condition(self, ref: KubeClaimRef, placed: bool, reason: str, message: str) -> None:
        """Set Tessera's pod condition (see `tessera.placement.podreport`), keeping every other one;
        the pod as the gate's lift answered it, if that came just before, else as read now."""
        pod = self._patched.pop(ref.pod_uid, None) if ref.pod_uid else None
        if pod is None:
            pod = await self.read_pod(ref)
            if pod is None:
                return
        patch = condition_patch(pod, placed, reason, message, timestamp())
        if patch is None:
            return
        with contextlib.suppress(NotFound):  # the pod is gone: nothing to tell
            await self._bounded(f"set the placement condition of pod {ref.namespace}/{ref.pod}",
                                self.api.patch_status(self._pod_path(ref), patch, "strategic"))

    # --- Events ----------------------------------------------------------------------------

    async def report(self, ref: KubeClaimRef, *, reason: str, message: str, warning: bool) -> None:
        """An Event on the claim's pod (on the claim itself when it has no pod). The same reason
        and message again count on that one Event rather than adding another."""
        await self._bounded(f"report {reason} on {ref.namespace}/{ref.pod or ref.name}",
                            self.events.record(subject(ref), reason, message, warning=warning))

    async def close(self) -> None:
        await self.api.close()


# --- the cluster's nodes and pods ------------------------------------------------------------------

NODES = object_path("v1", "nodes")
PODS = object_path("v1", "pods")
# The pods kube-scheduler's cache holds: every one that is not over.
LIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"


class ClusterWatch:
    """Lists and watches Nodes and live pods into a `ClusterNodes` table, forever: ``loaded`` is
    called once both lists are in (placement decides nothing before), ``changed`` after every
    change that may let a waiting claim fit (a node uncordoned, a taint or label changed, room made
    by a pod gone). `KubeApi.watch` resumes a broken watch and re-lists after a 410, reporting what
    changed meanwhile, so the table stays what a fresh list would give."""

    def __init__(self, api: KubeApi, table: ClusterNodes, changed: Callable[[], None],
                 loaded: Callable[[], None]) -> None:
        self.api = api
        self.table = table
        self.changed = changed
        self.loaded = loaded
        self.listed: set[str] = set()
        self.pruned: set[str] = set()  # the kinds whose first list since the last (re)start is in

    def _listed(self, what: str, seen: set[str]) -> Callable[[], None]:
        """Called once a list's objects are in: the first list of a (re)started watch also drops
        what the table held from before that is not in it any more (its DELETED never came)."""
        def done() -> None:
            if what not in self.pruned:
                (self.table.retain_nodes if what == "nodes" else self.table.retain_pods)(set(seen))
                self.pruned.add(what)
            self.listed.add(what)
            if self.listed == {"nodes", "pods"}:
                self.loaded()
            self.changed()
        return done

    async def run(self) -> None:
        failures = 0
        while True:
            self.pruned = set()
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._follow(NODES, None, self.table.set_node, self.table.remove_node,
                                                   "nodes"))
                    group.create_task(self._follow(PODS, LIVE_PODS, self.table.set_pod, self.table.remove_pod,
                                                   "pods"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # refused (RBAC) or broken: say so, try again, never stop
                failures += 1
                delay = min(30.0, 0.5 * 2 ** min(failures, 6))
                log.warning("watching Nodes and pods failed (%r); again in %.1fs", exc, delay)
                await asyncio.sleep(delay)

    async def _follow(self, path: str, fields: str | None, upsert, remove, what: str) -> None:
        seen: set[str] = set()  # the keys of the first list (nodes by name, pods by uid)
        watch = self.api.watch(path, field_selector=fields, listed=self._listed(what, seen))
        key = "name" if what == "nodes" else "uid"
        try:
            async for kind, obj in watch:
                if what not in self.pruned:
                    seen.add(str((obj.get("metadata") or {}).get(key) or ""))
                if (remove if kind == "DELETED" else upsert)(obj):
                    self.changed()
        finally:
            await watch.aclose()
