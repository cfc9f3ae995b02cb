"""Placement's Kubernetes side on its own (`tessera.placement.kubesync` through the real adapter and
the seam, against the API-server emulator): what it does when the cluster already says something,
says something else, or will not let the gate go. The give-back path is recorded instead of going
to NATS (the process-level tests cover that it releases the ledger)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tessera.shared.events import ClaimSpec, DeviceShare
from tessera.shared.kubeclaims import SCHEDULING_GATE, claim_id

from tessera.placement.claimstatus import allocation
from tessera.placement.kube import KubeWriter
from tessera.placement.kubesync import Allocated, ClaimStatusSync, Unschedulable
from tessera.shared.cancelling import cancel_and_wait
from tessera.translator.dra import resource_claim_template

from kube_objects import namespace, pod as kube_pod
from kubeparts import make_claims
from kit import eventually
from kubetessera import kube_ref

RC = "resource.k8s.io/v1"
SHARES = [DeviceShare(uuid="GPU-0", index=0, memory_mib=20000, cores=30)]


@contextlib.asynccontextmanager
async def running(kube, give_back):
    """A ClaimStatusSync on the emulator with short retries, its workers running."""
    worker = ClaimStatusSync(KubeWriter(kube, timeout=2), give_back, workers=2, retry_seconds=1.0, max_backoff=0.1)
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        await cancel_and_wait([task])
        if not task.cancelled():
            task.result()  # it ended before its cancel: raise what ended it
        assert task.cancelled()


@pytest.fixture
async def sync(apiserver, kube):
    """A running ClaimStatusSync; yields (sync, given back: [(claim, reason)])."""
    given_back: list[tuple[str, str]] = []

    async def give_back(job: Allocated, reason: str) -> None:
        given_back.append((job.claim, reason))

    async with running(kube, give_back) as worker:
        yield worker, given_back


async def made_claim(apiserver, name: str = "train") -> tuple[dict, dict]:
    await apiserver.create(namespace("team-a"))
    await apiserver.create(resource_claim_template(ClaimSpec(memory_mib=20000, cores=30), f"{name}-gpu", "team-a"))
    pod = kube_pod(name, "team-a")
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": f"{name}-gpu"}]
    pod = await apiserver.create(pod)
    [claim] = await make_claims(apiserver, pod)
    return apiserver.object("v1", "pods", name, "team-a"), claim


def job(pod: dict, claim: dict, node: str = "gpu-1") -> Allocated:
    return Allocated(claim=claim_id(claim["metadata"]["uid"]), tenant="alpha", node=node, shares=SHARES,
                     kube=kube_ref(claim, pod))


def status_writes(apiserver) -> list:
    return [w for w in apiserver.writes if w.method == "PUT" and w.path.endswith("/status")]


async def test_a_claim_already_showing_this_allocation_is_done_without_a_write(apiserver, sync):
    worker, given_back = sync
    pod, claim = await made_claim(apiserver)
    claim["status"] = {"allocation": allocation(job(pod, claim).claim, "gpu-1", SHARES)}
    await apiserver.replace(claim, "status")
    before = len(status_writes(apiserver))
    worker.submit(job(pod, claim))
    assert await eventually(lambda: not apiserver.object("v1", "pods", "train", "team-a")["spec"].get("schedulingGates"))
    assert len(status_writes(apiserver)) == before and given_back == []


async def test_a_claim_allocated_by_someone_else_gets_nothing_and_ours_is_given_back(apiserver, sync):
    worker, given_back = sync
    pod, claim = await made_claim(apiserver)
    claim["status"] = {"allocation": allocation(job(pod, claim).claim, "gpu-0", SHARES)}  # another node
    await apiserver.replace(claim, "status")
    worker.submit(job(pod, claim, node="gpu-1"))
    [(cid, reason)] = await eventually(lambda: given_back)
    assert "another allocation (gpu-0/gpu-0)" in reason
    current = apiserver.object(RC, "resourceclaims", claim["metadata"]["name"], "team-a")
    assert current["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["gpu-0"]
    assert [g["name"] for g in apiserver.object("v1", "pods", "train", "team-a")["spec"]["schedulingGates"]] \
        == [SCHEDULING_GATE]


async def test_a_deleted_claim_is_given_back(apiserver, sync):
    worker, given_back = sync
    pod, claim = await made_claim(apiserver)
    await apiserver.delete(RC, "resourceclaims", claim["metadata"]["name"], "team-a")
    worker.submit(job(pod, claim))
    [(_, reason)] = await eventually(lambda: given_back)
    assert "no longer exists" in reason


async def test_a_gate_that_cannot_be_lifted_takes_the_allocation_out_again(apiserver, sync):
    worker, given_back = sync
    pod, claim = await made_claim(apiserver)
    apiserver.fail("PATCH", r"/pods/train$", 503, times=None)
    worker.submit(job(pod, claim))
    [(_, reason)] = await eventually(lambda: given_back, timeout=15)
    assert "scheduling gate" in reason and "503" in reason
    current = apiserver.object(RC, "resourceclaims", claim["metadata"]["name"], "team-a")
    assert not (current.get("status") or {}).get("allocation")  # withdrawn: the claim shows nothing
    assert len(status_writes(apiserver)) == 2  # written, then taken out


async def test_a_newer_job_of_a_claim_replaces_the_one_still_queued(apiserver, sync):
    worker, given_back = sync
    pod, claim = await made_claim(apiserver)
    ref = kube_ref(claim, pod)
    worker.submit(Unschedulable(claim=job(pod, claim).claim, kube=ref, reason="tenant quota exceeded: gpus 2 > 1 GPUs"))
    worker.submit(job(pod, claim))  # decided again before the first job ran: only this one is carried out
    events = await eventually(lambda: apiserver.objects("v1", "events", "team-a"))
    assert await eventually(lambda: worker.counts["reported"] == 1)
    assert [e["reason"] for e in apiserver.objects("v1", "events", "team-a")] == ["Allocated"], events
    assert given_back == []


async def test_an_allocation_whose_give_back_failed_is_tried_again(apiserver, kube):
    pod, claim = await made_claim(apiserver)
    await apiserver.delete(RC, "resourceclaims", claim["metadata"]["name"], "team-a")
    attempts: list[str] = []

    async def give_back(job: Allocated, reason: str) -> None:
        attempts.append(reason)
        if len(attempts) == 1:
            raise ConnectionError("the bus is down")  # the release could not be published

    async with running(kube, give_back) as worker:
        worker.submit(job(pod, claim))
        assert await eventually(lambda: len(attempts) == 2 and worker.counts["given_back"] == 1), attempts
