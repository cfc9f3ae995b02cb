"""The per-tenant syncer: the tenant's pods on its virtual node, run as pods of its host namespace.

Level-triggered, so that a restart loses nothing: a watch on each side (the tenant's pods, the
host namespace's mirrored pods and their events) names a tenant pod and keeps what it last saw (an
informer's cache, rebuilt by each watch's list: the host is watched, never polled), and
`reconcile` makes the host agree with the tenant as both watches see them — create the host pod (with copies
of the ConfigMaps and Secrets it reads, owned by it), delete a host pod whose tenant pod is gone or
was replaced, copy the host pod's status and events back, and finish a tenant pod's deletion once
its host pod is gone (as a kubelet does, with grace 0). A pod with DRA claims of Tessera's class
in the tenant's cluster is bound to the virtual node here (`claims`: the tenant's scheduler has
no devices to allocate), and its host claim's allocation copied back to the tenant's claim. Both
watches list first, so a syncer started on a world that moved while it was away sees every object once and converges.
Names are `hostpod.host_name` of the tenant pod, so a create that was already done answers
AlreadyExists and nothing is made twice.

Its tenant side acts with the tenant's admin credentials; its host side with an identity limited
to the tenant's host namespace (deploy/k8s/controlplane/tenant-pods.yaml).
"""

from __future__ import annotations

import asyncio
import logging

from tessera.shared.kubeapi import AlreadyExists, Conflict, Events, KubeApi, KubeError, NotFound, reference

from . import claims, deviceclass, hostpod, toleration
from .logs import LogServer
from .virtualnode import TAINT_KEY, VirtualNode, labels

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (tenant namespace, tenant pod name)
REFUSED = "HostPodRefused"
COMPONENT = "tessera-tenant-pods"
_RESOURCE = "/apis/resource.k8s.io/v1"


def _pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


def _pod_ref(pod: dict) -> dict:
    """What an Event on the tenant's pod names (a watch's objects need not say their kind)."""
    return {**reference(pod), "apiVersion": "v1", "kind": "Pod"}


def _meant_for_the_fleet(spec: dict) -> bool:
    """Whether the pod tolerates the virtual node's taint (the policy gave it, or the tenant wrote it)."""
    return any(t.get("key") == TAINT_KEY for t in spec.get("tolerations") or [])


class PodSync:
    def __init__(self, tenant_api: KubeApi, host_api: KubeApi, tenant: str, host_namespace: str,
                 node: VirtualNode, logs: LogServer | None = None) -> None:
        self.tenant_api, self.host_api, self.logs = tenant_api, host_api, logs
        self.tenant, self.host_namespace, self.node = tenant, host_namespace, node
        self.events = Events(tenant_api, COMPONENT, node.name, host=node.name)  # on the tenant's pods
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        # what the two pod watches last delivered (an informer's cache: reconcile reads these, not the
        # API servers); filled by each watch's list before anything is reconciled
        self._tenant_pods: dict[Key, dict] = {}
        self._host_pods: dict[str, dict] = {}
        self._tenant_listed, self._host_listed = asyncio.Event(), asyncio.Event()
        self.ready = asyncio.Event()  # set once the node and its policy are in force

    # --- the loops ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Register the node, its toleration policy and Tessera's DeviceClass, then watch both sides
        and reconcile what they name, until cancelled."""
        if self.logs is not None:
            self.node.endpoint = (self.logs.address, await self.logs.start())
        try:
            await self._run()
        finally:
            if self.logs is not None:
                await self.logs.close()

    async def _run(self) -> None:
        await self.node.register()
        await toleration.install(self.tenant_api)
        since = await deviceclass.install(self.tenant_api)
        self.ready.set()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.node.keep_ready(), name=f"node-{self.tenant}")
            tasks.create_task(deviceclass.keep(self.tenant_api, since), name=f"device-class-{self.tenant}")
            tasks.create_task(self._watch_tenant(), name=f"tenant-pods-{self.tenant}")
            tasks.create_task(self._watch_host(), name=f"host-pods-{self.tenant}")
            tasks.create_task(self._watch_host_events(), name=f"host-events-{self.tenant}")
            tasks.create_task(self._work(), name=f"reconcile-{self.tenant}")

    def _enqueue(self, key: Key) -> None:
        if key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    async def _watch_tenant(self) -> None:
        async for change, pod in self.tenant_api.watch("/api/v1/pods", listed=self._tenant_listed.set):
            meta = pod["metadata"]
            key = (meta["namespace"], meta["name"])
            if change == "DELETED":
                self._tenant_pods.pop(key, None)
            else:
                self._tenant_pods[key] = pod
            self._enqueue(key)

    async def _watch_host(self) -> None:
        path = f"/api/v1/namespaces/{self.host_namespace}/pods"
        async for change, pod in self.host_api.watch(path, label_selector=f"{hostpod.TENANT}={self.tenant}",
                                                      listed=self._host_listed.set):
            if change == "DELETED":
                self._host_pods.pop(pod["metadata"]["name"], None)
            else:
                self._host_pods[pod["metadata"]["name"]] = pod
            notes = pod["metadata"].get("annotations") or {}
            if hostpod.NAMESPACE in notes and hostpod.NAME in notes:
                self._enqueue((notes[hostpod.NAMESPACE], notes[hostpod.NAME]))

    async def _work(self) -> None:
        # nothing is decided on half a picture: a tenant pod not yet listed would look deleted
        await self._tenant_listed.wait()
        await self._host_listed.wait()
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            try:
                await self.reconcile(*key)
            except KubeError as exc:  # temporary or a lost race: read both sides again shortly
                log.warning("tenant %s pod %s/%s: %s; trying again", self.tenant, *key, exc)
                asyncio.get_running_loop().call_later(1.0, self._enqueue, key)

    # --- one tenant pod ------------------------------------------------------------------------------

    async def reconcile(self, namespace: str, name: str) -> None:
        """Make the host agree with the tenant pod ``namespace/name`` (present or not), as the two
        watches last saw them: a stale view costs a refused write (AlreadyExists, a uid or
        resourceVersion precondition), never a wrong one, and the watch event that follows the
        write brings the pod back."""
        tenant_pod = self._tenant_pods.get((namespace, name))
        host_pod = self._host_pods.get(hostpod.host_name(namespace, name))
        uid = tenant_pod["metadata"]["uid"] if tenant_pod else None
        if host_pod is not None and (host_pod["metadata"].get("annotations") or {}).get(hostpod.UID) != uid:
            await self._delete_host(host_pod)  # its tenant pod is gone, or is another pod of that name now
            return
        if tenant_pod is None:
            return
        spec = tenant_pod.get("spec") or {}
        ours = spec.get("nodeName") == self.node.name
        objects = await self._claim_objects(tenant_pod)
        if objects is None:
            return  # a claim or template it names is not there yet: the tenant's pod waits, as for a kubelet
        drawn = any(claims.is_tesseras(claims.claim_spec(o)) for o in objects.values())
        if not spec.get("nodeName") and not _meant_for_the_fleet(spec) and not drawn \
                and toleration.asks_for_gpus(tenant_pod):
            await self._tolerate(tenant_pod)  # admitted before the policy was in force
            return  # (its update brings it back)
        meant = _meant_for_the_fleet(spec) or drawn
        if not ours and not (not spec.get("nodeName") and meant):
            return  # another node's pod, or an ordinary pod not yet scheduled
        refused = hostpod.refusals(tenant_pod, labels(self.tenant)) + claims.refusals(tenant_pod, objects)
        if refused and not tenant_pod["metadata"].get("deletionTimestamp"):
            await self._refuse(tenant_pod, refused)  # (said before binding too: a host-node selector never binds)
            return
        if toleration.patch(spec) and not tenant_pod["metadata"].get("deletionTimestamp"):
            await self._tolerate(tenant_pod)  # never evicted for the node's Lease (`toleration`)
            return  # (its update brings it back)
        if not ours:
            if drawn:  # the tenant's scheduler cannot allocate Tessera's devices (they are the host's): bind it
                await self._bind(tenant_pod)
            return  # else the tenant's scheduler binds it
        if tenant_pod["metadata"].get("deletionTimestamp"):
            if host_pod is not None:
                await self._delete_host(host_pod)
            else:  # the host pod is gone: the tenant pod's deletion ends, as a kubelet ends it
                await self._release_claims(tenant_pod, objects)
                await self._finish_deletion(tenant_pod)
            return
        if host_pod is None:
            await self._create_host(tenant_pod, claims.container_limits(tenant_pod, objects))
            return
        await self._copy_status(tenant_pod, host_pod)
        if objects:
            await self._copy_allocations(tenant_pod, host_pod)

    # --- its DRA claims (`claims`) -------------------------------------------------------------------

    async def _claim_objects(self, pod: dict) -> dict[str, dict] | None:
        """Pod claim name -> the tenant's ResourceClaim or ResourceClaimTemplate it names (None: one
        is missing; the pod is looked at again shortly)."""
        objects: dict[str, dict] = {}
        for entry in claims.pod_claims(pod):
            named = claims.source(entry)
            if named is None:
                continue
            kind, name = named
            plural = {"ResourceClaim": "resourceclaims", "ResourceClaimTemplate": "resourceclaimtemplates"}[kind]
            obj = await self.tenant_api.get(f"{_RESOURCE}/namespaces/{pod['metadata']['namespace']}/{plural}/{name}")
            if obj is None and pod["metadata"].get("deletionTimestamp"):
                continue  # going anyway: nothing of it is made any more
            if obj is None:
                key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
                asyncio.get_running_loop().call_later(1.0, self._enqueue, key)
                return None
            objects[entry["name"]] = {**obj, "kind": kind}
        return objects

    async def _bind(self, pod: dict) -> None:
        meta = pod["metadata"]
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta["uid"]},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": self.node.name}}
        try:
            await self.tenant_api.create(f"{_pod_path(meta['namespace'], meta['name'])}/binding", binding)
        except Conflict:
            pass  # bound meanwhile (its update brings it back)

    async def _copy_allocations(self, tenant_pod: dict, host_pod: dict) -> None:
        """The host's allocation of each claim, on the tenant's claim (once: an allocation is final)."""
        namespace = tenant_pod["metadata"]["namespace"]
        for entry in claims.pod_claims(tenant_pod):
            name = claims.tenant_claim_name(tenant_pod, entry)
            users = [c["name"] for kind in ("initContainers", "containers") for c in tenant_pod["spec"].get(kind) or []
                     if any(r["name"] == entry["name"] for r in (c.get("resources") or {}).get("claims") or [])]
            hosted = claims.host_claim_name(host_pod, users[0]) if users else None
            if name is None or hosted is None:
                continue
            path = f"{_RESOURCE}/namespaces/{namespace}/resourceclaims/{name}"
            tenant_claim = await self.tenant_api.get(path)
            if tenant_claim is None or (tenant_claim.get("status") or {}).get("allocation"):
                continue
            host_claim = await self.host_api.get(f"{_RESOURCE}/namespaces/{self.host_namespace}/resourceclaims/{hosted}")
            status = claims.tenant_status(host_claim or {}, tenant_claim, tenant_pod, self.node.name)
            if status is not None:
                await self.tenant_api.patch_status(path, {"metadata": {"resourceVersion": tenant_claim["metadata"][
                    "resourceVersion"]}, "status": status})

    async def _release_claims(self, pod: dict, objects: dict[str, dict]) -> None:
        """The pod is gone from the host: its claims are no longer allocated (as the tenant's
        scheduler would deallocate a claim it allocated once no pod holds it)."""
        namespace = pod["metadata"]["namespace"]
        for entry in claims.pod_claims(pod):
            name = claims.tenant_claim_name(pod, entry)
            claim = await self.tenant_api.get(f"{_RESOURCE}/namespaces/{namespace}/resourceclaims/{name}") \
                if name else None
            reserved = [r for r in (claim or {}).get("status", {}).get("reservedFor") or []]
            if claim is None or not (claim.get("status") or {}).get("allocation") \
                    or any(r.get("uid") != pod["metadata"]["uid"] for r in reserved):
                continue
            await self.tenant_api.patch_status(f"{_RESOURCE}/namespaces/{namespace}/resourceclaims/{name}",
                                               {"metadata": {"resourceVersion": claim["metadata"]["resourceVersion"]},
                                                "status": {"allocation": None, "reservedFor": None}})

    async def _tolerate(self, pod: dict) -> None:
        """Give the pod the node's tolerations, as the policy would have (a pod may gain tolerations,
        and an existing one's tolerationSeconds may go)."""
        meta = pod["metadata"]
        patch = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
                 *toleration.patch(pod["spec"])]
        await self.tenant_api.patch(_pod_path(meta["namespace"], meta["name"]), patch, "json")

    async def _create_host(self, pod: dict, claimed: dict[str, dict[str, str]]) -> None:
        meta = pod["metadata"]
        refs = hostpod.references(pod)
        names = {ref: hostpod.host_name(meta["namespace"], ref[1]) for ref in refs}
        try:
            made = await self.host_api.create(f"/api/v1/namespaces/{self.host_namespace}/pods",
                                              hostpod.mirror(pod, self.tenant, self.host_namespace, names, claimed))
        except AlreadyExists:
            return  # made by an earlier pass (its watch event brings the status)
        except KubeError as exc:
            if exc.status in (400, 403, 422):  # the host's own admission said no: the tenant hears why
                await self.events.record(_pod_ref(pod), REFUSED, f"the host refused the pod: {exc}", warning=True)
                return
            raise
        for kind, name in refs:
            await self._copy_object(meta["namespace"], kind, name, names[(kind, name)], made)
        log.info("tenant %s pod %s/%s runs as %s/%s", self.tenant, meta["namespace"], meta["name"],
                 self.host_namespace, made["metadata"]["name"])

    async def _copy_object(self, namespace: str, kind: str, name: str, host_name: str, owner: dict) -> None:
        """The host copy of a ConfigMap or Secret the pod reads, owned by the host pods that read it."""
        plural = {"ConfigMap": "configmaps", "Secret": "secrets"}[kind]
        source = await self.tenant_api.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
        if source is None:
            return  # the kubelet waits for it, as for any missing volume; a later pass copies it
        owner_ref = {"apiVersion": "v1", "kind": "Pod", "name": owner["metadata"]["name"],
                     "uid": owner["metadata"]["uid"]}
        collection = f"/api/v1/namespaces/{self.host_namespace}/{plural}"
        existing = await self.host_api.get(f"{collection}/{host_name}")
        owners = [o for o in (existing or {}).get("metadata", {}).get("ownerReferences") or []
                  if o["uid"] != owner_ref["uid"]] + [owner_ref]
        copy = {"apiVersion": "v1", "kind": kind,
                "metadata": {"name": host_name, "namespace": self.host_namespace,
                             "labels": {hostpod.TENANT: self.tenant}, "ownerReferences": owners,
                             "annotations": {hostpod.NAMESPACE: namespace, hostpod.NAME: name}},
                **{k: source[k] for k in ("data", "binaryData", "type") if k in source}}
        if existing is None:
            try:
                await self.host_api.create(collection, copy)
                return
            except AlreadyExists:
                existing = await self.host_api.get(f"{collection}/{host_name}")
        if existing is not None:
            copy["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
            await self.host_api.replace(f"{collection}/{host_name}", copy)  # Conflict: retried by _work

    async def _delete_host(self, host_pod: dict) -> None:
        meta = host_pod["metadata"]
        if meta.get("deletionTimestamp"):
            return  # already going; its DELETED event brings this pod back
        try:
            await self.host_api.delete(_pod_path(self.host_namespace, meta["name"]),
                                       preconditions={"uid": meta["uid"]})
        except (NotFound, Conflict):
            pass

    async def _finish_deletion(self, pod: dict) -> None:
        meta = pod["metadata"]
        try:
            await self.tenant_api.delete(_pod_path(meta["namespace"], meta["name"]),
                                         preconditions={"uid": meta["uid"]}, grace_seconds=0)
        except (NotFound, Conflict):
            pass

    async def _copy_status(self, tenant_pod: dict, host_pod: dict) -> None:
        wanted = hostpod.status_for_tenant(host_pod)
        have = tenant_pod.get("status") or {}
        if all(have.get(k) == v for k, v in wanted.items()):
            return
        await self.tenant_api.patch_status(_pod_path(tenant_pod["metadata"]["namespace"],
                                                     tenant_pod["metadata"]["name"]), {"status": wanted})

    async def _refuse(self, pod: dict, fields: list[str]) -> None:
        await self.events.record(_pod_ref(pod), REFUSED, f"not run on the shared fleet: {', '.join(fields)} would "
                                 "reach the host (remove the field; a tenant's pod gets no host network, paths, "
                                 "privileges or nodes)", warning=True)

    # --- the host's events, told in the tenant's cluster ---------------------------------------------

    async def _watch_host_events(self) -> None:
        path = f"/api/v1/namespaces/{self.host_namespace}/events"
        async for change, event in self.host_api.watch(path, field_selector="involvedObject.kind=Pod"):
            if change != "DELETED":
                await self._relay(event)

    async def _relay(self, event: dict) -> None:
        await self._host_listed.wait()
        await self._tenant_listed.wait()
        host_pod = self._host_pods.get(event["involvedObject"]["name"])
        notes = (host_pod or {}).get("metadata", {}).get("annotations") or {}
        if (host_pod or {}).get("metadata", {}).get("labels", {}).get(hostpod.TENANT) != self.tenant:
            return  # not a pod of this tenant's (the host watch holds only this tenant's)
        tenant_pod = self._tenant_pods.get((notes[hostpod.NAMESPACE], notes[hostpod.NAME]))
        if tenant_pod is None or tenant_pod["metadata"]["uid"] != notes.get(hostpod.UID):
            return
        try:
            await self.events.record(_pod_ref(tenant_pod), event.get("reason", ""), event.get("message", ""),
                                     warning=event.get("type") == "Warning", count=int(event.get("count") or 1))
        except KubeError as exc:
            log.warning("tenant %s: event %s not relayed: %s", self.tenant, event["metadata"]["name"], exc)

    # --- the tenant's end ----------------------------------------------------------------------------

    async def clear(self) -> None:
        """Remove the virtual node and everything mirrored for the tenant (its teardown)."""
        selector = f"{hostpod.TENANT}={self.tenant}"
        for plural in ("pods", "configmaps", "secrets"):
            await self.host_api.call("DELETE", f"/api/v1/namespaces/{self.host_namespace}/{plural}",
                                     query=[("labelSelector", selector)])
        await toleration.remove(self.tenant_api)
        await deviceclass.remove(self.tenant_api)
        await self.node.remove()
