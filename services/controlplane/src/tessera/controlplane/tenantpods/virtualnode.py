"""The node that stands for a tenant's share of the fleet, in the tenant's own cluster.

The virtual-kubelet model: a Node whose capacity and allocatable are the tenant's quota in HAMi's
names (`nvidia.com/gpu`, `nvidia.com/gpumem`, `nvidia.com/gpucores`) plus the CPU and memory the
tenant may use, kept Ready by renewing its Lease in kube-node-lease as a kubelet does (the tenant's
node-lifecycle controller would otherwise taint it unreachable and evict its pods). Its taint keeps
the tenant's scheduler from putting ordinary pods there; GPU pods are bound to it by the syncer
(`sync`), and pods that tolerate the taint are bound by the tenant's scheduler as usual.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass

from tessera.shared.events import GpuQuota
from tessera.shared.kubeapi import AlreadyExists, KubeApi, NotFound, timestamp

TAINT_KEY = "gpu.tessera.dev/virtual-node"
LEASE_SECONDS = 40
RENEW_SECONDS = 10.0
NODE_LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"


@dataclass(frozen=True)
class Share:
    """What the tenant may use of the fleet, as the node's capacity says it."""

    quota: GpuQuota
    cpu: str = "16"
    memory: str = "64Gi"
    pods: int = 110
    # what a dimension the quota leaves unlimited (None) shows: the host's placement and quota
    # decide there, the tenant's scheduler should not refuse first
    unlimited_gpus: int = 64
    unlimited_memory_mib: int = 1 << 30

    def capacity(self) -> dict[str, str]:
        quota = self.quota
        gpus = quota.gpus if quota.gpus is not None else self.unlimited_gpus
        return {
            "cpu": self.cpu, "memory": self.memory, "pods": str(self.pods),
            "nvidia.com/gpu": str(gpus),
            "nvidia.com/gpumem": str(quota.memory_mib if quota.memory_mib is not None else self.unlimited_memory_mib),
            "nvidia.com/gpucores": str(quota.cores if quota.cores is not None else 100 * gpus),
        }


def node_name(tenant: str) -> str:
    return f"tessera-{tenant}"


def labels(tenant: str) -> dict[str, str]:
    name = node_name(tenant)
    return {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "type": "virtual-kubelet", "gpu.tessera.dev/tenant": tenant}


def _micro_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node(tenant: str, share: Share) -> dict:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node_name(tenant), "labels": labels(tenant)},
        "spec": {"taints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}]},
    }


def status(share: Share, endpoint: tuple[str, int] | None = None) -> dict:
    """The node's status; ``endpoint``: where its kubelet API (the logs, `logs.LogServer`) answers."""
    now = timestamp()
    served = {"addresses": [{"type": "InternalIP", "address": endpoint[0]}],
              "daemonEndpoints": {"kubeletEndpoint": {"Port": endpoint[1]}}} if endpoint else {}
    return {"status": {**served,
        "capacity": share.capacity(), "allocatable": share.capacity(),
        "conditions": [{"type": "Ready", "status": "True", "reason": "TesseraFleetReachable",
                        "message": "the tenant's share of the shared GPU fleet",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}],
        "nodeInfo": {"kubeletVersion": "tessera", "operatingSystem": "linux", "architecture": "amd64",
                     "containerRuntimeVersion": "", "kernelVersion": "", "osImage": "", "kubeProxyVersion": "",
                     "machineID": "", "systemUUID": "", "bootID": ""},
    }}


class VirtualNode:
    """Keeps the tenant's virtual node present, Ready and leased."""

    def __init__(self, tenant_api: KubeApi, tenant: str, share: Share) -> None:
        self.api, self.tenant, self.share = tenant_api, tenant, share
        self.name = node_name(tenant)
        self.endpoint: tuple[str, int] | None = None  # its kubelet API's address, when one is served

    async def register(self) -> None:
        """Create (or adopt) the Node, report its status, take its Lease."""
        try:
            # with its status, as a kubelet registers: never a moment NotReady (and tainted so)
            await self.api.create("/api/v1/nodes", {**node(self.tenant, self.share), **status(self.share, self.endpoint)})
        except AlreadyExists:
            await self.api.patch(f"/api/v1/nodes/{self.name}", {"spec": node(self.tenant, self.share)["spec"]})
        await self.api.patch_status(f"/api/v1/nodes/{self.name}", status(self.share, self.endpoint))
        await self.renew()

    async def renew(self) -> None:
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": self.name, "namespace": "kube-node-lease"},
                 "spec": {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS,
                          "renewTime": _micro_now()}}
        try:
            await self.api.patch(f"{NODE_LEASES}/{self.name}", {"spec": lease["spec"]})
        except NotFound:
            await self.api.create(NODE_LEASES, lease)

    async def keep_ready(self, every: float = RENEW_SECONDS) -> None:
        """Renew the Lease, and report Ready once a minute, forever."""
        beats = 0
        while True:
            await asyncio.sleep(every)
            await self.renew()
            beats += 1
            if beats * every >= 60:
                beats = 0
                await self.api.patch_status(f"/api/v1/nodes/{self.name}", status(self.share, self.endpoint))

    async def remove(self) -> None:
        for path in (f"{NODE_LEASES}/{self.name}", f"/api/v1/nodes/{self.name}"):
            try:
                await self.api.delete(path)
            except NotFound:
                pass
