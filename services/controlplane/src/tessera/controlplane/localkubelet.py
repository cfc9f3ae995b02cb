"""Kubernetes mode where no kubelet runs the tenants' control-plane pods: the manager plays its part.

The tenant's objects are applied to the host cluster as always (`tessera.controlplane.kube`, the
manager's own identity and RBAC); then the pod is read back the way a kubelet gets it — the
Deployment's pod template and the Secrets it names, as the API server stores them (defaulted,
quantities canonical) — and run as local processes (`tessera.controlplane.localplanes`): what runs
is what the host cluster holds, not what the manager meant to send.

Readiness is the tenant's API server answering ``/readyz`` with the tenant's CA and a read through to
its datastore, never the Deployment's status (no kubelet reports on those pods). The endpoint the
tenant's kubeconfig names stays the Service's (``manifests.endpoint``): the processes serve on
loopback ports of the tenant's, as a port-forward to the Service would.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Coroutine

from tessera.controlplane import manifests
from tessera.controlplane.kube import KubeHost, TenantControlPlanes
from tessera.controlplane.localplanes import LocalControlPlanes


class LocalKubelet:
    def __init__(self, kube: KubeHost, planes: LocalControlPlanes) -> None:
        self.kube = kube
        self.planes = planes

    def tenant_control_planes(self) -> TenantControlPlanes:
        return self.kube.tenant_control_planes()

    @property
    def host_api(self):
        return self.kube.host_api

    def reach(self, record) -> str:
        """Where the manager reaches the tenant's API server: its local process (no Service routes here)."""
        return self.planes.endpoint(record)

    async def apply(self, tenant: str, objects: list[dict[str, Any]]) -> None:
        await self.kube.apply(tenant, objects)
        await self.planes.apply(tenant, await self.stored_pod(tenant))

    async def stored_pod(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's Deployment and every Secret its pod template names, as the host stores them."""
        ns = manifests.namespace(tenant)
        deployment = await self.kube.read("apps/v1", "Deployment", f"{tenant}-control-plane", ns)
        pod = deployment["spec"]["template"]["spec"]
        names = {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        names |= {e["valueFrom"]["secretKeyRef"]["name"] for c in pod["containers"] for e in c.get("env", [])
                  if "secretKeyRef" in (e.get("valueFrom") or {})}
        return [deployment, *[await self.kube.read("v1", "Secret", name, ns) for name in sorted(names)]]

    async def ready(self, tenant: str) -> tuple[bool, str]:
        return await self.planes.ready(tenant)

    async def remove(self, tenant: str) -> None:
        await self.planes.remove(tenant)
        await self.kube.remove(tenant)

    def watches(self, on_change: Callable[[str], Awaitable[None]]) -> dict[str, Coroutine[Any, Any, None]]:
        """The Deployments on the host and the processes here: a change to either is a reconcile. Two
        of the manager's root tasks rather than one task group: each is then stopped for sure on its
        own (a TaskGroup cancels its children once, and Python 3.11's ``wait_for`` can eat that
        cancel, `tessera.shared.cancelling`: a watch went on after its manager had stopped)."""
        return {"deployment-watch": self.kube.watch(on_change), "process-watch": self.planes.watch(on_change)}

    async def close(self) -> None:
        try:
            await self.planes.close()
        finally:
            await self.kube.close()
