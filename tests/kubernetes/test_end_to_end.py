"""One GPU pod's life on Kubernetes, through every real service: admitted by the translator's webhook
over TLS, its claim requested by the translator, allocated by placement (status written, gate
lifted), bound by the scheduler to the allocated node, and after the pod is deleted its claim gone
and the ledger and the tenant's quota back to empty.

The services run as processes (control-plane manager, capacity publisher on tests/profiles/tiny.yaml,
translator with its webhook, placement, an enforcer per node) against a real nats-server and the
API-server emulator, which validates every object written and calls the webhook as deploy/k8s
configures it (its MutatingWebhookConfiguration, matchConditions included, over TLS verified against
the caBundle). The test plays what no emulator runs: the resourceclaim controller, kube-scheduler and
the kubelet.
"""

from __future__ import annotations

import pytest

from tessera.shared.events import GpuQuota
from tessera.shared.kubeclaims import SCHEDULING_GATE, TENANT_LABEL, claim_id
from tessera.placement.claimstatus import allocation, same_allocation

from kube_objects import namespace
from kubeparts import (Refused, allocated_node, claims_of, claims_released, gpu_pod, kubelet_start, make_claims,
                       schedule)
from kit import eventually
from kubetessera import create_tenant, ledgers, quota_in_use, whole_tessera

RC = "resource.k8s.io/v1"


@pytest.fixture
async def tessera(apiserver, nats_url, tmp_path):
    """The whole of Tessera in Kubernetes mode, its webhook installed; yields a client on the bus."""
    async with whole_tessera(apiserver, nats_url, tmp_path) as (_, client):
        yield client


async def test_a_gpu_pod_from_creation_to_deletion(tessera, apiserver):
    client = tessera
    await create_tenant(client, "alpha", GpuQuota(gpus=2))
    await apiserver.create(namespace("team-a", {TENANT_LABEL: "alpha"}))

    # kubectl apply: the API server sends the pod to the webhook and stores what comes back.
    pod = await apiserver.create(gpu_pod("train", "team-a", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 20000,
                                                             "nvidia.com/gpucores": 30}))
    assert "nvidia.com/gpu" not in pod["spec"]["containers"][0]["resources"].get("limits", {})
    assert [g["name"] for g in pod["spec"]["schedulingGates"]] == [SCHEDULING_GATE]
    [entry] = pod["spec"]["resourceClaims"]
    assert apiserver.object(RC, "resourceclaimtemplates", entry["resourceClaimTemplateName"], "team-a")
    with pytest.raises(Refused, match="gated"):
        await schedule(apiserver, pod)

    # The resourceclaim controller makes the claim; the translator requests it; placement allocates.
    [claim] = await make_claims(apiserver, pod)
    cid = claim_id(claim["metadata"]["uid"])
    record = await client.wait_for(cid, {"allocated", "prepared", "running"}, timeout=30)
    assert record.kube is not None and record.kube.pod == "train" and record.tenant == "alpha"

    def written():
        current = apiserver.object(RC, "resourceclaims", claim["metadata"]["name"], "team-a")
        return ((current or {}).get("status") or {}).get("allocation")

    assert await eventually(written), "no allocation written"
    entry_in_ledger = (await ledgers(client))[record.node].entries[cid]
    assert same_allocation(written(), allocation(cid, record.node, entry_in_ledger.shares))

    def ungated():
        return not apiserver.object("v1", "pods", "train", "team-a")["spec"].get("schedulingGates")

    assert await eventually(ungated), "the gate was not lifted"
    bound_to = await schedule(apiserver, pod)
    assert bound_to == record.node == allocated_node(claims_of(apiserver, apiserver.object("v1", "pods", "train",
                                                                                            "team-a"))[0])
    running = await kubelet_start(apiserver, pod)
    assert running["status"]["phase"] == "Running" and running["spec"]["nodeName"] == record.node
    assert set((await quota_in_use(client, "alpha")).claims) == {cid}

    # kubectl delete pod: the garbage collector deletes its claim, which stays (placement's
    # delete-protection finalizer) until the resourceclaim controller sees the pod gone; then
    # everything is given back.
    await apiserver.delete("v1", "pods", "train", "team-a")
    assert apiserver.object(RC, "resourceclaims", claim["metadata"]["name"], "team-a")["metadata"]["deletionTimestamp"]
    await claims_released(apiserver, [claim])
    assert apiserver.object(RC, "resourceclaims", claim["metadata"]["name"], "team-a") is None
    released = await client.wait_for(cid, {"released"}, timeout=30)
    assert released.state == "released"

    async def empty():
        return all(not lg.entries for lg in (await ledgers(client)).values()) \
            and not (await quota_in_use(client, "alpha")).claims

    assert await eventually(empty), (await ledgers(client), await quota_in_use(client, "alpha"))

