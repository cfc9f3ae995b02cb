"""What stays on the emulator: answers the real kube-apiserver cannot be made to give on one path at
will — a 503, a 429 with Retry-After (an overloaded server, API Priority and Fairness throttling) —
while it answers every other request. tests/kubernetes/README.md ("What stays on the emulator")
lists each test here and why; everything else these tests' files covered runs on the real server
(test_kubeapi.py, test_claim_status_sync.py, ...)."""

from __future__ import annotations

import asyncio

import pytest

from kube_objects import claim, configmap, namespace, pod as kube_pod
from kubeparts import make_claims
from kubetessera import kube_ref
from kit import eventually
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.errors import TemporaryError
from tessera.shared.events import ClaimSpec, DeviceShare
from tessera.shared.kubeapi import ApiException, Unavailable, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, claim_id

from tessera.placement.kube import KubeWriter
from tessera.placement.kubesync import Allocated, ClaimStatusSync
from tessera.translator.dra import resource_claim_template

CONFIGMAPS = object_path("v1", "configmaps", namespace="default")
CLAIMS = object_path("resource.k8s.io/v1", "resourceclaims", namespace="default")
SHARES = [DeviceShare(uuid="GPU-0", index=0, memory_mib=20000, cores=30)]


async def test_a_503_and_a_429_are_temporary_and_429_says_when_to_retry(kube, apiserver):
    await kube.create(CLAIMS, claim("c"))
    apiserver.fail("GET", r"/resourceclaims/c$", status=503)
    with pytest.raises(Unavailable) as down:
        await kube.get(f"{CLAIMS}/c")
    assert isinstance(down.value, TemporaryError) and isinstance(down.value, ApiException)
    apiserver.fail("GET", r"/resourceclaims/c$", status=429)
    with pytest.raises(Unavailable) as throttled:
        await kube.get(f"{CLAIMS}/c")
    assert throttled.value.delay == 1.0


async def test_watch_reconnects_through_injected_server_errors(kube, apiserver):
    await apiserver.create(configmap("a"))
    fault = apiserver.fail("GET", r"/configmaps$", status=503, times=3)
    stream = kube.watch(CONFIGMAPS, max_backoff=0.2)
    try:
        kind, obj = await asyncio.wait_for(stream.__anext__(), 10)
        assert (kind, obj["metadata"]["name"]) == ("ADDED", "a")
    finally:
        await stream.aclose()
    assert fault.hits == 3


# --- placement's gate that cannot be lifted: a 503 on the pod's PATCH alone --------------------

async def test_a_gate_that_cannot_be_lifted_takes_the_allocation_out_again(apiserver, kube):
    """The allocation is written, then every PATCH of the pod answers 503 (only there: a real server
    that is down refuses the status write too): the allocation is taken out again and given back."""
    await apiserver.create(namespace("team-a"))
    await apiserver.create(resource_claim_template(ClaimSpec(memory_mib=20000, cores=30), "train-gpu", "team-a"))
    made = kube_pod("train", "team-a")
    made["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "train-gpu"}]
    made = await apiserver.create(made)
    [claim] = await make_claims(apiserver, made)
    pod = apiserver.object("v1", "pods", "train", "team-a")
    given_back: list[str] = []

    async def give_back(job: Allocated, reason: str) -> None:
        given_back.append(reason)

    worker = ClaimStatusSync(KubeWriter(kube, timeout=2), give_back, workers=2, retry_seconds=1.0, max_backoff=0.1)
    task = asyncio.create_task(worker.run())
    try:
        apiserver.fail("PATCH", r"/pods/train$", 503, times=None)
        worker.submit(Allocated(claim=claim_id(claim["metadata"]["uid"]), tenant="alpha", node="gpu-1",
                                shares=SHARES, kube=kube_ref(claim, pod)))
        [reason] = await eventually(lambda: given_back, timeout=15)
    finally:
        await cancel_and_wait([task])
    assert "scheduling gate" in reason and "503" in reason
    current = apiserver.object(RESOURCE_API_VERSION, "resourceclaims", claim["metadata"]["name"], "team-a")
    assert not (current.get("status") or {}).get("allocation")  # withdrawn: the claim shows nothing
    status_writes = [w for w in apiserver.writes if w.method == "PUT" and w.path.endswith("/status")]
    assert len(status_writes) == 2  # written, then taken out
