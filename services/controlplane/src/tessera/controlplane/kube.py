"""Kubernetes mode: server-side apply of tenant manifests, a watch on their readiness, and the
TenantControlPlane objects the manager serves.

The manager's only module that talks to Kubernetes, through `tessera.shared.kubeapi` (server-side
apply with fieldManager=tessera-controlplane, so repeated applies are no-ops and fields other
managers own are left alone). Readiness is the control-plane Deployment's status (ready replicas =
desired, rolled out); ``watch`` streams Deployment changes and tells the reconciler which tenant to
look at again. ``TenantControlPlanes`` lists and watches the custom resources and writes their
finalizer (a merge patch carrying the resourceVersion read, so a concurrent change is a 409, not
lost) and their status subresource; `tessera.controlplane.resources` decides what to write.
``UsersSecret`` keeps the NATS datastore's tenant users in a Secret the NATS pods mount (the
manager and nats-server share no filesystem on a cluster).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from tessera.shared.kubeapi import ApiException, KubeApi, object_path

from tessera.controlplane import manifests
from tessera.controlplane.crd import GROUP, PLURAL, VERSION
from tessera.controlplane.datastores.natskv import UsersFile

log = logging.getLogger("tessera.controlplane.kube")

FIELD_MANAGER = "tessera-controlplane"
_PLURALS = {
    "Namespace": "namespaces", "Secret": "secrets", "Service": "services",
    "Deployment": "deployments", "NetworkPolicy": "networkpolicies",
}


def kind_path(api_version: str, kind: str, name: str | None, namespace: str | None) -> str:
    """The REST path of a manifest's object (or, without ``name``, its collection) by its kind."""
    return object_path(api_version, _PLURALS[kind], name, namespace)


class KubeHost:
    def __init__(self, api: KubeApi | None = None, *, manage_namespaces: bool = True) -> None:
        self.kube = api or KubeApi()
        # Whether to create and delete the tenant's Namespace (off when the platform pre-creates them).
        self.manage_namespaces = manage_namespaces

    @classmethod
    def for_url(cls, url: str, *, manage_namespaces: bool = True) -> "KubeHost":
        return cls(KubeApi.for_url(url), manage_namespaces=manage_namespaces)

    def tenant_control_planes(self) -> "TenantControlPlanes":
        return TenantControlPlanes(self.kube)

    @property
    def host_api(self) -> KubeApi:
        """The host as the manager (tenantpods makes each tenant's own identity with it)."""
        return self.kube

    async def apply(self, tenant: str, objects: list[dict[str, Any]]) -> None:
        for obj in objects:
            if obj["kind"] == "Namespace" and not self.manage_namespaces:
                continue
            meta = obj["metadata"]
            ns = meta.get("namespace")
            await self.kube.apply(kind_path(obj["apiVersion"], obj["kind"], meta["name"], ns),
                                  kind_path(obj["apiVersion"], obj["kind"], None, ns), obj, FIELD_MANAGER)

    async def read(self, api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any]:
        """One object as the host stores it (kind and apiVersion set)."""
        obj = await self.kube.call("GET", kind_path(api_version, kind, name, namespace))
        obj.setdefault("kind", kind)
        obj.setdefault("apiVersion", api_version)
        return obj

    async def ready(self, tenant: str) -> tuple[bool, str]:
        ns = manifests.namespace(tenant)
        path = kind_path("apps/v1", "Deployment", f"{tenant}-control-plane", ns)
        deployment = await self.kube.get(path)
        if deployment is None:
            return False, "control-plane Deployment not found"
        return deployment_ready(deployment)

    async def remove(self, tenant: str) -> None:
        for api_version, kind, name, ns in manifests.object_refs(tenant):
            if kind == "Namespace" and not self.manage_namespaces:
                continue
            try:
                await self.kube.call("DELETE", kind_path(api_version, kind, name, ns))
            except ApiException as exc:
                if exc.status != 404:
                    raise

    async def watch(self, on_change: Callable[[str], Awaitable[None]]) -> None:
        """Forever: stream control-plane Deployments and hand each changed tenant to ``on_change``."""
        selector = f"app.kubernetes.io/managed-by={manifests.MANAGER}"
        while True:
            try:
                async for _, obj in self.kube.watch("/apis/apps/v1/deployments", label_selector=selector):
                    tenant = ((obj.get("metadata") or {}).get("labels") or {}).get("tessera.io/tenant")
                    if tenant:
                        await on_change(tenant)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # refused (RBAC, say): the periodic resync goes on meanwhile
                log.warning("deployment watch failed (%s); retrying", exc)
                await asyncio.sleep(30)

    async def close(self) -> None:
        await self.kube.close()


class TenantControlPlanes:
    """The TenantControlPlane custom resources (group tessera.io) as the manager reads and writes them."""

    def __init__(self, kube: KubeApi) -> None:
        self.kube = kube

    @staticmethod
    def path(namespace: str | None = None, name: str | None = None, sub: str = "") -> str:
        return object_path(f"{GROUP}/{VERSION}", PLURAL, name, namespace) + (f"/{sub}" if sub else "")

    async def list(self) -> tuple[list[dict[str, Any]], str]:
        return await self.kube.list(self.path())

    def watch(self, version: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(event type, object) from ``version`` on, forever (re-listing after a 410 or a restart)."""
        return self.kube.watch(self.path(), version or None)

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.kube.get(self.path(namespace, name))

    async def set_finalizers(self, obj: dict[str, Any], finalizers: builtins.list[str]) -> dict[str, Any]:
        meta = obj["metadata"]
        patch = {"metadata": {"finalizers": finalizers, "resourceVersion": meta["resourceVersion"]}}
        return await self.kube.patch(self.path(meta["namespace"], meta["name"]), patch)

    async def set_status(self, obj: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await self.kube.patch_status(self.path(meta["namespace"], meta["name"]), {"status": status})


class UsersSecret(UsersFile):
    """The NATS tenant accounts file as a Secret (key ``users.conf``) in the NATS namespace: the NATS pods
    mount it, and their config reloader signals nats-server when the kubelet has updated the file
    (within about a minute). ``store`` does not wait for that: the tenant's kine retries until its
    user is accepted."""

    KEY = "users.conf"
    confirm = False

    def __init__(self, ref: str, kube: KubeApi | None = None) -> None:
        super().__init__(Path("/nonexistent"), None)
        self.namespace, self.name = ref.split("/", 1)
        self.kube = kube or KubeApi()

    async def load(self) -> dict[str, dict]:
        secret = await self.kube.get(kind_path("v1", "Secret", self.name, self.namespace))
        data = ((secret or {}).get("data") or {}).get(self.KEY)
        return self.parse(base64.b64decode(data).decode()) if data else {}

    async def store(self, tenants: dict[str, dict]) -> None:
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/part-of": "tessera",
                                        "app.kubernetes.io/managed-by": FIELD_MANAGER}},
                "data": {self.KEY: base64.b64encode(self.render(tenants).encode()).decode()}}
        await self.kube.apply(kind_path("v1", "Secret", self.name, self.namespace),
                              kind_path("v1", "Secret", None, self.namespace), body, FIELD_MANAGER)

    async def close(self) -> None:
        await self.kube.close()


def deployment_ready(deployment: dict[str, Any]) -> tuple[bool, str]:
    want = (deployment.get("spec") or {}).get("replicas", 1)
    status = deployment.get("status") or {}
    generation = (deployment.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    if generation is not None and observed is not None and observed < generation:
        return False, f"rollout of generation {generation} not observed yet"
    ready = status.get("readyReplicas", 0)
    updated = status.get("updatedReplicas", ready)
    if ready >= want and updated >= want:
        return True, ""
    return False, f"{ready}/{want} control-plane replicas ready"
