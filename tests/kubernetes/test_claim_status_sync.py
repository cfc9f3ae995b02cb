"""Placement's Kubernetes side on its own (`tessera.placement.kubesync` through the real adapter and
the seam, on the real kube-apiserver as placement's deploy/k8s identity): what it does when the
cluster already says something, says something else, or no longer has the claim. The claims are the
real resourceclaim controller's, made for gated pods from the translator's templates (`gpupods`).
The give-back path is recorded instead of going to NATS (the process-level tests cover that it
releases the ledger). A gate that cannot be lifted (a 503 on the pod's PATCH alone) is a fault the
real server cannot be made to give: test_emulated_faults.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tessera.shared.events import ClaimSpec, DeviceShare
from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, SCHEDULING_GATE, claim_id

from tessera.placement.claimstatus import allocation
from tessera.placement.kube import KubeWriter
from tessera.placement.kubesync import Allocated, ClaimStatusSync, Unschedulable
from tessera.placement.podreport import COMPONENT
from tessera.shared.cancelling import cancel_and_wait

from gpupods import GpuPods
from kit import eventually
from kit.kubecluster import service_identity
from kubetessera import kube_ref

SHARES = [DeviceShare(uuid="GPU-0", index=0, memory_mib=20000, cores=30)]


@contextlib.asynccontextmanager
async def running(kubeconfig, give_back):
    """A ClaimStatusSync as placement's identity with short retries, its workers running."""
    worker = ClaimStatusSync(KubeWriter(KubeApi.for_kubeconfig(kubeconfig), timeout=5), give_back, workers=2,
                             retry_seconds=1.0, max_backoff=0.1)
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        await cancel_and_wait([task])
        await worker.writer.close()
        if not task.cancelled():
            task.result()  # it ended before its cancel: raise what ended it
        assert task.cancelled()


@pytest.fixture
async def cluster(kube_plane, plane_namespace):
    """(pods, placement's kubeconfig, namespace)."""
    pods = await asyncio.to_thread(GpuPods, kube_plane)
    try:
        yield pods, await asyncio.to_thread(service_identity, kube_plane, "placement.yaml"), plane_namespace
    finally:
        await pods.close()


@pytest.fixture
async def sync(cluster):
    """A running ClaimStatusSync; yields (sync, given back: [(claim, reason)])."""
    given_back: list[tuple[str, str]] = []

    async def give_back(job: Allocated, reason: str) -> None:
        given_back.append((job.claim, reason))

    async with running(cluster[1], give_back) as worker:
        yield worker, given_back


async def made_claim(pods: GpuPods, ns: str, name: str = "train") -> tuple[dict, dict]:
    return await pods.create(ns, name, ClaimSpec(memory_mib=20000, cores=30))


def job(pod: dict, claim: dict, node: str = "gpu-1") -> Allocated:
    return Allocated(claim=claim_id(claim["metadata"]["uid"]), tenant="alpha", node=node, shares=SHARES,
                     kube=kube_ref(claim, pod))


def claim_path(claim: dict) -> str:
    meta = claim["metadata"]
    return object_path(RESOURCE_API_VERSION, "resourceclaims", meta["name"], meta["namespace"])


async def gates(pods: GpuPods, ns: str, name: str = "train") -> list[str]:
    pod = await pods.admin.get(object_path("v1", "pods", name, ns))
    return [g["name"] for g in pod["spec"].get("schedulingGates") or []]


def status_writes(plane, claim: dict) -> list[dict]:
    """Placement's writes of the claim's status, as the API server's audit log has them."""
    return [e for e in plane.audit() if e["user"]["username"] == "system:serviceaccount:tessera-system:tessera-placement"
            and e["verb"] in ("update", "patch") and e.get("objectRef", {}).get("subresource") == "status"
            and e["objectRef"].get("name") == claim["metadata"]["name"]
            and e["objectRef"].get("namespace") == claim["metadata"]["namespace"]]


async def placement_events(pods: GpuPods, ns: str) -> list[dict]:
    items, _ = await pods.admin.list(object_path("v1", "events", namespace=ns))
    return [e for e in items if (e.get("source") or {}).get("component") == COMPONENT]


async def test_a_claim_already_showing_this_allocation_is_done_without_a_write(kube_plane, cluster, sync):
    pods, _, ns = cluster
    worker, given_back = sync
    pod, claim = await made_claim(pods, ns)
    claim["status"] = {"allocation": allocation(job(pod, claim).claim, "gpu-1", SHARES)}
    await pods.admin.replace_status(claim_path(claim), claim)  # as if written before (a restart, a redelivery)
    worker.submit(job(pod, claim))
    assert await eventually(lambda: _not(gates(pods, ns)), timeout=30)
    assert status_writes(kube_plane, claim) == [] and given_back == []


def pod_requests(plane, pod: dict) -> list[tuple[str, str]]:
    """Placement's requests on the pod, (verb, subresource), as the API server's audit log has them."""
    return [(e["verb"], e["objectRef"].get("subresource", "")) for e in plane.audit()
            if e["user"]["username"] == "system:serviceaccount:tessera-system:tessera-placement"
            and e.get("objectRef", {}).get("resource") == "pods" and e["objectRef"].get("name") == pod["metadata"]["name"]
            and e["objectRef"].get("namespace") == pod["metadata"]["namespace"]]


async def test_an_allocation_costs_the_pod_one_read_and_two_writes(kube_plane, cluster, sync):
    # The gate lifted (the pod read, then patched) and the condition set from the pod that patch
    # answered: no second read, and no condition patch lost to kube-scheduler's own status writes.
    pods, _, ns = cluster
    worker, given_back = sync
    pod, claim = await made_claim(pods, ns)
    worker.submit(job(pod, claim))

    def condition_set() -> list | None:
        asked = pod_requests(kube_plane, pod)
        return asked if ("patch", "status") in asked else None
    asked = await eventually(condition_set, timeout=30, what="placement's condition written")
    assert asked == [("get", ""), ("patch", ""), ("patch", "status")]
    current = await pods.admin.get(object_path("v1", "pods", "train", ns))
    conditions = {c["type"]: c for c in current["status"]["conditions"]}
    assert conditions["gpu.tessera.dev/Placed"]["status"] == "True" and "PodScheduled" in conditions
    assert given_back == []


async def test_a_claim_allocated_by_someone_else_gets_nothing_and_ours_is_given_back(cluster, sync):
    pods, _, ns = cluster
    worker, given_back = sync
    pod, claim = await made_claim(pods, ns)
    claim["status"] = {"allocation": allocation(job(pod, claim).claim, "gpu-0", SHARES)}  # another node
    await pods.admin.replace_status(claim_path(claim), claim)
    worker.submit(job(pod, claim, node="gpu-1"))
    [(cid, reason)] = await eventually(lambda: given_back, timeout=30)
    assert "another allocation (gpu-0/gpu-0)" in reason
    current = await pods.admin.get(claim_path(claim))
    assert current["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["gpu-0"]
    assert await gates(pods, ns) == [SCHEDULING_GATE]


async def test_a_deleted_claim_is_given_back(cluster, sync):
    pods, _, ns = cluster
    worker, given_back = sync
    pod, claim = await made_claim(pods, ns)
    await pods.admin.delete(claim_path(claim))
    worker.submit(job(pod, claim))
    [(_, reason)] = await eventually(lambda: given_back, timeout=30)
    assert "no longer exists" in reason


async def test_a_newer_job_of_a_claim_replaces_the_one_still_queued(cluster, sync):
    pods, _, ns = cluster
    worker, given_back = sync
    pod, claim = await made_claim(pods, ns)
    ref = kube_ref(claim, pod)
    worker.submit(Unschedulable(claim=job(pod, claim).claim, kube=ref, reason="tenant quota exceeded: gpus 2 > 1 GPUs"))
    worker.submit(job(pod, claim))  # decided again before the first job ran: only this one is carried out
    events = await eventually(lambda: placement_events(pods, ns), timeout=30)
    assert await eventually(lambda: worker.counts["reported"] == 1, timeout=30)
    assert [e["reason"] for e in await placement_events(pods, ns)] == ["Allocated"], events
    assert given_back == []


async def test_an_allocation_whose_give_back_failed_is_tried_again(cluster):
    pods, placement, ns = cluster
    pod, claim = await made_claim(pods, ns)
    await pods.admin.delete(claim_path(claim))
    attempts: list[str] = []

    async def give_back(job: Allocated, reason: str) -> None:
        attempts.append(reason)
        if len(attempts) == 1:
            raise ConnectionError("the bus is down")  # the release could not be published

    async with running(placement, give_back) as worker:
        worker.submit(job(pod, claim))
        assert await eventually(lambda: len(attempts) == 2 and worker.counts["given_back"] == 1, timeout=30), attempts


async def _not(value) -> bool:
    return not await value
