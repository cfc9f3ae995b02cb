"""Kubernetes mode: server-side apply of tenant manifests and a watch on their readiness.

The manager's only module that talks to Kubernetes, through `tessera.shared.kubeapi` (server-side
apply with fieldManager=tessera-controlplane, so repeated applies are no-ops and fields other
managers own are left alone). Readiness is the control-plane Deployment's status (ready replicas =
desired, rolled out); ``watch`` streams Deployment changes and tells the reconciler which tenant to
look at again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable

from tessera.shared.kubeapi import ApiException, KubeApi
from tessera.shared.kubeapi import object_path as _path

from tessera.controlplane import manifests

log = logging.getLogger("tessera.controlplane.kube")

FIELD_MANAGER = "tessera-controlplane"
_PLURALS = {
    "Namespace": "namespaces", "Secret": "secrets", "Service": "services",
    "Deployment": "deployments", "NetworkPolicy": "networkpolicies",
}


def object_path(api_version: str, kind: str, name: str | None, namespace: str | None) -> str:
    return _path(api_version, _PLURALS[kind], name, namespace)


class KubeHost:
    def __init__(self, api: KubeApi | None = None, *, manage_namespaces: bool = True) -> None:
        self.kube = api or KubeApi()
        # Whether to create and delete the tenant's Namespace (off when the platform pre-creates them).
        self.manage_namespaces = manage_namespaces

    @classmethod
    def for_url(cls, url: str, *, manage_namespaces: bool = True) -> "KubeHost":
        return cls(KubeApi.for_url(url), manage_namespaces=manage_namespaces)

    async def apply(self, tenant: str, objects: list[dict[str, Any]]) -> None:
        for obj in objects:
            if obj["kind"] == "Namespace" and not self.manage_namespaces:
                continue
            meta = obj["metadata"]
            ns = meta.get("namespace")
            await self.kube.apply(object_path(obj["apiVersion"], obj["kind"], meta["name"], ns),
                                  object_path(obj["apiVersion"], obj["kind"], None, ns), obj, FIELD_MANAGER)

    async def ready(self, tenant: str) -> tuple[bool, str]:
        ns = manifests.namespace(tenant)
        path = object_path("apps/v1", "Deployment", f"{tenant}-control-plane", ns)
        deployment = await self.kube.get(path)
        if deployment is None:
            return False, "control-plane Deployment not found"
        return deployment_ready(deployment)

    async def remove(self, tenant: str) -> None:
        for api_version, kind, name, ns in manifests.object_refs(tenant):
            if kind == "Namespace" and not self.manage_namespaces:
                continue
            try:
                await self.kube.call("DELETE", object_path(api_version, kind, name, ns))
            except ApiException as exc:
                if exc.status != 404:
                    raise

    async def watch(self, on_change: Callable[[str], Awaitable[None]]) -> None:
        """Forever: stream control-plane Deployments and hand each changed tenant to ``on_change``."""
        selector = f"app.kubernetes.io/managed-by={manifests.MANAGER}"
        api = await self.kube.api()
        while True:
            try:
                response = await api.call_api(
                    "/apis/apps/v1/deployments", "GET",
                    query_params=[("watch", "true"), ("labelSelector", selector), ("timeoutSeconds", "300")],
                    header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
                    _preload_content=False, _return_http_data_only=True,
                )
                async with response:
                    while line := await response.content.readline():
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        labels = ((event.get("object") or {}).get("metadata") or {}).get("labels") or {}
                        tenant = labels.get("tessera.io/tenant")
                        if tenant:
                            await on_change(tenant)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # API server restart, expired resourceVersion: start over
                log.warning("deployment watch ended (%s); restarting", exc)
                await asyncio.sleep(1)

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
