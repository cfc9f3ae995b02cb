"""Placement's Kubernetes adapter: the one placement module that talks to an API server.

What placement decided in the ledger has to reach the cluster: the ResourceClaim's
``status.allocation`` (an update with the claim's resourceVersion, so a concurrent writer is a 409,
not a lost write), the pod's scheduling gate lifted (only ours), Events on the pod that
``kubectl describe pod`` shows, and a pod condition of Tessera's own saying whether the pod's GPUs
are placed. Every call goes through `tessera.shared.kubeapi`, has a time limit (an API server that
accepts a connection and never answers must not hold a worker forever), and its failure is
classified by what the caller should do next: `ClaimGone` and `PermanentError` (give the
allocation back), `ConflictError` (re-read, try again now), `TemporaryError` (the API server is
unreachable or overloaded: back off, try again).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone

from tessera.shared.errors import ConflictError, PermanentError, TemporaryError
from tessera.shared.kubeapi import ApiException, KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, SCHEDULING_GATE, KubeClaimRef

from tessera.placement.podreport import condition_patch, event

log = logging.getLogger("tessera.placement.kube")

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"


class ClaimGone(PermanentError):
    """The ResourceClaim no longer exists (or a new one of the same name does): nothing to write."""


def _classify(exc: BaseException, what: str) -> Exception | None:
    """The classified error for a failed call, or None for an error that is not the API's."""
    if isinstance(exc, ApiException):
        if exc.status == 409:
            return ConflictError(f"{what}: changed since read (409)")
        if exc.status in (400, 422):
            return PermanentError(f"{what}: the API server refused it ({exc.status}): {_body(exc)}")
        return TemporaryError(f"{what}: API server answered {exc.status} {exc.reason or ''}".rstrip())
    if isinstance(exc, (OSError, asyncio.TimeoutError, TimeoutError)) or type(exc).__module__.startswith("aiohttp"):
        return TemporaryError(f"{what}: API server unreachable ({type(exc).__name__}: {exc})")
    return None


def _body(exc: ApiException) -> str:
    text = exc.body.decode("utf-8", "replace") if isinstance(exc.body, bytes) else str(exc.body or "")
    return text[:400]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeWriter:
    def __init__(self, api: KubeApi | None = None, *, timeout: float = 10.0, instance: str = "") -> None:
        self.api = api or KubeApi()
        self.timeout = timeout
        self.instance = instance or "tessera-placement"

    async def _call(self, what: str, method: str, path: str, body=None, content_type: str = "application/json"):
        try:
            async with asyncio.timeout(self.timeout):
                return await self.api.call(method, path, body, content_type=content_type)
        except Exception as exc:
            if isinstance(exc, ApiException) and exc.status == 404:
                return None
            classified = _classify(exc, what)
            if classified is None:
                raise
            raise classified from exc

    # --- the ResourceClaim -----------------------------------------------------------------

    @staticmethod
    def claim_path(ref: KubeClaimRef, status: bool = False) -> str:
        path = object_path(RESOURCE_API_VERSION, "resourceclaims", ref.name, ref.namespace)
        return path + "/status" if status else path

    async def read_claim(self, ref: KubeClaimRef) -> dict:
        """The claim as it is now; `ClaimGone` if it was deleted or replaced by a namesake."""
        claim = await self._call(f"read ResourceClaim {ref.namespace}/{ref.name}", "GET", self.claim_path(ref))
        if claim is None or (claim.get("metadata") or {}).get("uid") != ref.uid:
            raise ClaimGone(f"ResourceClaim {ref.namespace}/{ref.name} (uid {ref.uid}) no longer exists")
        if (claim.get("metadata") or {}).get("deletionTimestamp"):
            raise ClaimGone(f"ResourceClaim {ref.namespace}/{ref.name} is being deleted")
        return claim

    async def write_allocation(self, ref: KubeClaimRef, claim: dict, allocation: dict | None) -> dict:
        """Update the claim's ``status.allocation`` (None: remove it) as of the resourceVersion in
        ``claim``; ConflictError if the claim moved since it was read."""
        status = dict(claim.get("status") or {})
        if allocation is None:
            status.pop("allocation", None)
        else:
            status["allocation"] = allocation
        body = {**claim, "status": status}
        written = await self._call(f"write status of ResourceClaim {ref.namespace}/{ref.name}", "PUT",
                                   self.claim_path(ref, status=True), body)
        if written is None:
            raise ClaimGone(f"ResourceClaim {ref.namespace}/{ref.name} was deleted before its status was written")
        return written

    # --- the pod ---------------------------------------------------------------------------

    def _pod_path(self, ref: KubeClaimRef, status: bool = False) -> str:
        return object_path("v1", "pods", ref.pod, ref.namespace) + ("/status" if status else "")

    async def read_pod(self, ref: KubeClaimRef) -> dict | None:
        """The claim's pod, or None if it is gone (or a new pod of the same name stands there)."""
        pod = await self._call(f"read pod {ref.namespace}/{ref.pod}", "GET", self._pod_path(ref))
        if pod is None or (ref.pod_uid and (pod.get("metadata") or {}).get("uid") != ref.pod_uid):
            return None
        return pod

    async def lift_gate(self, ref: KubeClaimRef) -> bool:
        """Remove our scheduling gate from the pod (other gates stay): True if it was removed now,
        False if the pod is gone or had no such gate. The patch tests the resourceVersion read, so
        a gate list changed meanwhile is a ConflictError, never a wrong index removed."""
        pod = await self.read_pod(ref)
        if pod is None:
            return False
        gates = (pod.get("spec") or {}).get("schedulingGates") or []
        if not any(g.get("name") == SCHEDULING_GATE for g in gates):
            return False
        rest = [g for g in gates if g.get("name") != SCHEDULING_GATE]
        patch = [{"op": "test", "path": "/metadata/resourceVersion", "value": pod["metadata"]["resourceVersion"]},
                 {"op": "replace", "path": "/spec/schedulingGates", "value": rest} if rest
                 else {"op": "remove", "path": "/spec/schedulingGates"}]
        done = await self._patch_pod(ref, patch, status=False, what="lift the scheduling gate of")
        return done is not None

    async def set_condition(self, ref: KubeClaimRef, placed: bool, reason: str, message: str) -> None:
        """Set Tessera's pod condition (see `tessera.placement.podreport`), keeping every other one."""
        pod = await self.read_pod(ref)
        if pod is None:
            return
        patch = condition_patch(pod, placed, reason, message, _now())
        if patch:
            await self._patch_pod(ref, patch, status=True, what="set the placement condition of")

    async def _patch_pod(self, ref: KubeClaimRef, patch: list, *, status: bool, what: str):
        try:
            return await self._call(f"{what} pod {ref.namespace}/{ref.pod}", "PATCH", self._pod_path(ref, status),
                                    patch, content_type=JSON_PATCH)
        except PermanentError as exc:  # a failed "test" op: the pod moved since it was read
            raise ConflictError(str(exc)) from exc

    # --- Events ----------------------------------------------------------------------------

    async def report(self, ref: KubeClaimRef, *, reason: str, message: str, warning: bool) -> None:
        """An Event on the claim's pod (on the claim itself when it has no pod). The same reason
        and message again raise the count of the one Event rather than adding another."""
        now = _now()
        doc = event(ref, reason=reason, message=message, warning=warning, now=now, instance=self.instance)
        events = object_path("v1", "events", namespace=ref.namespace)
        try:
            await self._call(f"report {reason} on {ref.namespace}/{ref.pod or ref.name}", "POST", events, doc)
        except ConflictError:  # the Event exists (its name is the dedup key): say it again
            await self._call(f"report {reason} again", "PATCH", object_path("v1", "events", doc["metadata"]["name"],
                                                                            ref.namespace),
                             {"lastTimestamp": now, "message": doc["message"]}, content_type=MERGE_PATCH)

    async def close(self) -> None:
        await self.api.close()
