"""Tessera's DeviceClass in the tenant's own cluster, so that the class a tenant's claims name is there.

The host has ``gpu.tessera.dev`` (deploy/k8s/deviceclass.yaml); a tenant's user asking its own API
server (`kubectl get deviceclass`, `kubectl explain`, a claim's class looked up by a tool or the
tenant's scheduler) found nothing. The syncer installs the same class there, with the host's
selector (every device of Tessera's driver: the devices the host allocates, which the syncer
copies onto the tenant's claims, are those), and keeps it: put back if the tenant deletes or
changes it. The tenant's scheduler still allocates nothing of it (there are no slices in the
tenant's cluster; the syncer binds such pods, `claims`).
"""

from __future__ import annotations

from tessera.shared.kubeapi import KubeApi, NotFound
from tessera.shared.kubeclaims import DEVICE_CLASS, DRIVER

CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"
PATH = f"{CLASSES}/{DEVICE_CLASS}"
MANAGER = "tessera-tenant-pods"


def device_class() -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": DEVICE_CLASS, "labels": {"app.kubernetes.io/part-of": "tessera"}},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}}


async def install(api: KubeApi) -> str:
    """Server-side apply of the class (the same call on every start); its resourceVersion."""
    made = await api.apply(PATH, CLASSES, device_class(), MANAGER)
    return made["metadata"]["resourceVersion"]


async def keep(api: KubeApi, since: str) -> None:
    """Put the class back whenever it is deleted or its spec changed after ``since``, forever."""
    wanted = device_class()["spec"]
    async for change, got in api.watch(CLASSES, since, field_selector=f"metadata.name={DEVICE_CLASS}"):
        if change == "DELETED" or got.get("spec") != wanted:
            await install(api)


async def remove(api: KubeApi) -> None:
    try:
        await api.delete(PATH)
    except NotFound:
        pass
