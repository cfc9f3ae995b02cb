"""A GPU claim's end on the real control plane: its GPUs are released when no pod uses it any more,
never while one still may.

Defect 7 of the review: claims Tessera allocated never had the delete-protection finalizer that
kube-scheduler puts on the claims it allocates, so deleting one (by hand, or in the foreground) made
it vanish — or show a deletionTimestamp — while its pod's containers still ran, and the translator
released its GPUs in the ledger at once, for a neighbour to be given. Now placement adds the
finalizer as it writes the allocation; the real resourceclaim controller keeps the claim until the
pod stops using it, then clears the allocation and lets it go; only then does the translator
release.

Real here: kube-apiserver, kube-scheduler (it binds the pod and reserves the claim for it), the
resourceclaim controller, placement's status writer and the translator's claim watcher. Played: the
bus (the watcher's sink records what it would publish) and the node, a Node object without a kubelet
(the pod is bound, never started: which is what "its containers may still run" needs).
"""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from tessera.shared.events import ClaimRecord, ClaimSpec, DeviceShare
from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, KubeClaimRef, claim_id

from tessera.placement.kube import KubeWriter
from tessera.placement.kubesync import Allocated, ClaimStatusSync
from tessera.translator.claimwatch import ClaimWatcher
from tessera.translator.kube import Cluster

from gpupods import GpuPods
from kit import eventually
from kit.kubecluster import service_identity

NODE = "gpu-claims-0"
SHARE = DeviceShare(uuid="GPU-22222222-2222-4222-8222-222222222222", index=0, memory_mib=10240, cores=20)


class Sink:
    """The translator's bus side, recorded: what would be requested and released."""

    def __init__(self) -> None:
        self.requested: list[str] = []
        self.released: list[tuple[str, str]] = []

    async def records(self) -> list[ClaimRecord]:
        return []

    async def flush(self) -> None:
        pass

    async def tenant_exists(self, tenant: str) -> bool:
        return True

    async def request_kube(self, claim, tenant, spec, ref) -> bool:
        self.requested.append(claim)
        return True

    async def release_kube(self, claim: str, reason: str) -> bool:
        self.released.append((claim, reason))
        return True

    async def resend_release(self, record: ClaimRecord) -> None:
        pass


@pytest.fixture
async def world(kube_cluster, kube_namespace):
    pods = GpuPods(kube_cluster)
    admin = pods.admin
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if await admin.get(object_path("v1", "nodes", NODE)) is None:
        await admin.create(object_path("v1", "nodes"), {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    # Ready, with room for pods: what the kubelet would report (the scheduler filters on it)
    await admin.patch_status(object_path("v1", "nodes", NODE), {"status": {
        "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"}, "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now,
                        "lastTransitionTime": now}]}})
    sink = Sink()
    cluster = Cluster(KubeApi.for_kubeconfig(service_identity(kube_cluster, "translator.yaml")), "test")
    watcher = ClaimWatcher(cluster, sink, period=30)
    seen: list[tuple[str, dict]] = []
    on_change = watcher.on_change

    async def observed(kind, claim):
        await on_change(kind, claim)
        seen.append((kind, claim))
    watcher.on_change = observed
    watching = asyncio.create_task(watcher.run())
    sync = ClaimStatusSync(KubeWriter(KubeApi.for_kubeconfig(service_identity(kube_cluster, "placement.yaml"))),
                           _never, retry_seconds=20)
    syncing = asyncio.create_task(sync.run())
    try:
        yield pods, sync, sink, seen, kube_namespace
    finally:
        for task in (watching, syncing):
            task.cancel()
        await asyncio.gather(watching, syncing, return_exceptions=True)
        await cluster.kube.close()
        await sync.writer.close()
        await pods.close()


async def _never(job, reason):
    raise AssertionError(f"placement gave the allocation back: {reason}")


async def test_a_claim_deleted_while_its_pod_holds_it_is_released_only_when_the_pod_stops(world, kube_cluster):
    pods, sync, sink, seen, ns = world
    pod, claim = await pods.create(ns, "train", ClaimSpec(memory_mib=10240, cores=20), tolerate_all=True)
    meta = claim["metadata"]
    ref = KubeClaimRef(namespace=ns, name=meta["name"], uid=meta["uid"], pod=pod["metadata"]["name"],
                       pod_uid=pod["metadata"]["uid"])
    sync.submit(Allocated(claim=claim_id(meta["uid"]), tenant="alpha", node=NODE, shares=[SHARE], kube=ref,
                          models={0: "NVIDIA H100 80GB HBM3"}))
    path = object_path(RESOURCE_API_VERSION, "resourceclaims", meta["name"], ns)

    # placement writes it and lifts the gate; kube-scheduler binds the pod and reserves the claim
    async def reserved():
        current = await pods.admin.get(path)
        return current if (current.get("status") or {}).get("reservedFor") else None
    held = await eventually(reserved, timeout=60, what="the claim reserved for the bound pod")
    assert "resource.kubernetes.io/delete-protection" in held["metadata"]["finalizers"]
    # (the scheduler reserves the claim in PreBind, then binds: the binding may come a moment later)
    async def bound():
        return ((await pods.admin.get(object_path("v1", "pods", "train", ns)))["spec"]).get("nodeName")
    assert await eventually(bound, timeout=30, what="the pod bound") == NODE

    # deleted while the pod holds it: it stays (the finalizer), and nothing is released
    await pods.admin.delete(path)
    await eventually(lambda: any(c["metadata"].get("deletionTimestamp") for _, c in seen
                                 if c["metadata"]["uid"] == meta["uid"]),
                     timeout=30, what="the translator seeing the claim being deleted")
    # (the watcher sees the whole cluster: other tests' claims end meanwhile; only ours counts)
    assert [r for r in sink.released if r[0] == claim_id(meta["uid"])] == []
    assert (await pods.admin.get(path))["metadata"]["deletionTimestamp"]

    # the pod stops (here: it is deleted; no kubelet runs it): the controller clears the allocation,
    # the claim goes, and its GPUs are released
    kube_cluster.kubectl("delete", "pod", "-n", ns, "train", "--grace-period=0", "--force")
    await eventually(lambda: [r for r in sink.released if r[0] == claim_id(meta["uid"])], timeout=60,
                     what="the release")
    await eventually(lambda: _gone(pods.admin, path), timeout=60, what="the claim removed")


async def _gone(api: KubeApi, path: str) -> bool:
    return await api.get(path) is None
