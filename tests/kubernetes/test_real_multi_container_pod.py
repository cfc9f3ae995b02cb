"""A pod with two GPU containers on the real control plane and the real node: one claim, both
containers on one node, each held to exactly its own memory, and everything given back on delete.

Before, each GPU container got a ResourceClaim of its own, placed independently, and the pod's gate
was lifted after the first: two containers could be allocated on two nodes and the pod never ran
(issue 22, defect 5). Now the webhook gives the pod one template with one request per GPU
container, placement allocates the whole claim on one node (one result per request), the gate is
lifted once it is written, and the enforcer prepares one CDI device per request: the real kubelet
gives each container only the CDI device of the request its ``resources.claims`` entry names
(NodePrepareResources' ``requestNames``), so containerd applies each container's own limits.
Tessera runs as `realpods.TesseraOnNode` describes (test_real_gpu_pod.py explains the set-up).
"""

from __future__ import annotations

import json

from tessera.placement.claimstatus import allocation
from tessera.placement.kube import KubeWriter
from tessera.shared.events import ClaimSpec, DeviceShare, GpuQuota
from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import DRIVER, RESOURCE_API_VERSION, SCHEDULING_GATE, KubeClaimRef, claim_id
from tessera.translator.dra import resource_claim_template
from tessera.enforcer.cdi import spec_path

from gpupods import GpuPods
from kubetessera import ledgers
from kit import eventually
from kit.kubecluster import service_identity
from realpods import OUT_OF_MEMORY, TesseraOnNode, checkpoint, log_has, probe_command

TENANT = "alpha"
LIMITS = {"train": 1024, "eval": 512}  # MiB of GPU memory each container asks for


def _pod(name: str, namespace: str, image: str) -> dict:
    """Two GPU containers of different ``nvidia.com/gpumem``, as a user writes them for HAMi."""
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "dnsPolicy": "Default",
            "containers": [{
                "name": container, "image": image, "imagePullPolicy": "Never", "stdin": True,
                "command": probe_command(),
                "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(mib)}},
            } for container, mib in LIMITS.items()],
        },
    }


async def test_a_pod_with_two_gpu_containers_runs_each_held_to_its_own_limit(
        kube_cluster, kube_node, kube_namespace, nats_url, tmp_path):
    on = TesseraOnNode(kube_cluster, kube_node, kube_namespace, nats_url, tmp_path)
    async with on.running(TENANT, GpuQuota(gpus=2)):
        await on.kubectl("create", "-f", "-", stdin=json.dumps(_pod("pair", kube_namespace, on.image)))
        got = await on.ready("pair")
        assert got["spec"]["nodeName"] == kube_node.name
        assert not got["spec"].get("schedulingGates")
        # one claim for the pod; each container claims its own request of it
        [entry] = got["spec"]["resourceClaims"]
        assert [c["resources"]["claims"] for c in got["spec"]["containers"]] == [
            [{"name": entry["name"], "request": container}] for container in LIMITS]

        [status] = got["status"]["resourceClaimStatuses"]
        claim = await on.get("resourceclaim", status["resourceClaimName"])
        cid = claim_id(claim["metadata"]["uid"])
        results = claim["status"]["allocation"]["devices"]["results"]
        assert sorted(r["request"] for r in results) == sorted(LIMITS), results
        assert {(r["driver"], r["pool"]) for r in results} == {(DRIVER, kube_node.name)}
        assert len({r["shareID"] for r in results}) == 2
        assert claim["metadata"]["uid"] in checkpoint(on.dirs)
        ref = f"{kube_namespace}/{claim['metadata']['name']}"
        assert log_has(on.enforcer_log, f"prepared ResourceClaim {ref} ({cid}) for the kubelet")

        # each container's probe stops at exactly its own limit, not the other's
        for container, mib in LIMITS.items():
            reply = await on.probed("pair", container)
            assert (reply["devices"], reply["allocated_mib"], reply["stopped_by"], reply["one_more_byte"]) == (
                1, mib, OUT_OF_MEMORY, OUT_OF_MEMORY), (container, reply)
        # the ledger holds the whole claim in one entry, a share per request
        [held] = [e for lg in (await ledgers(on.client)).values() for e in lg.entries.values()]
        assert held.claim == cid
        assert sorted((s.request, s.memory_mib) for s in held.shares) == sorted(LIMITS.items())

        await on.kubectl("delete", "-n", kube_namespace, "pod/pair", "--timeout=90s")
        released = await on.client.wait_for(cid, {"released"}, timeout=60)
        assert released.reason == "resourceclaim-unused", released
        assert log_has(on.enforcer_log, f"unprepared ResourceClaim {ref} ({cid})")
        assert not spec_path(kube_node.cdi_dir, cid).exists(), "the CDI spec outlived the pod"
        assert await eventually(lambda: on.given_back(TENANT), timeout=30), await ledgers(on.client)
        assert not (on.cluster.state_dir(kube_node.name) / "claims" / cid).exists()


async def test_the_gate_waits_until_every_tessera_claim_of_the_pod_is_allocated(kube_cluster, kube_namespace):
    """A pod admitted before one claim per pod (a claim per GPU container): placement allocating
    the first claim must not let the scheduler bind the pod; the last one written lifts the gate.
    Placement's own writer, with its deploy/k8s identity, on the real API server."""
    pods = GpuPods(kube_cluster)
    writer = KubeWriter(KubeApi.for_kubeconfig(service_identity(kube_cluster, "placement.yaml")))
    try:
        spec = ClaimSpec(memory_mib=1024)
        templates = {"gpu-a": f"tessera-old-a-{kube_namespace}"[:63], "gpu-b": f"tessera-old-b-{kube_namespace}"[:63]}
        for template in templates.values():
            await pods.translator.create(object_path(RESOURCE_API_VERSION, "resourceclaimtemplates",
                                                     namespace=kube_namespace),
                                         resource_claim_template(spec, template, kube_namespace))
        pod = await pods.admin.create(object_path("v1", "pods", namespace=kube_namespace), {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "old"},
            "spec": {"schedulingGates": [{"name": SCHEDULING_GATE}],
                     "resourceClaims": [{"name": n, "resourceClaimTemplateName": t} for n, t in templates.items()],
                     "containers": [{"name": n, "image": "registry.example/train:1",
                                     "resources": {"claims": [{"name": n}]}} for n in templates]}})

        async def both_made():
            items, _ = await pods.admin.list(object_path(RESOURCE_API_VERSION, "resourceclaims", namespace=kube_namespace))
            mine = [c for c in items if any(o.get("uid") == pod["metadata"]["uid"]
                                            for o in c["metadata"].get("ownerReferences") or [])]
            return mine if len(mine) == 2 else None

        claims = await eventually(both_made, timeout=30, what="the pod's two claims")

        async def allocate(claim: dict) -> bool:
            meta = claim["metadata"]
            ref = KubeClaimRef(namespace=kube_namespace, name=meta["name"], uid=meta["uid"], pod="old",
                               pod_uid=pod["metadata"]["uid"])
            current = await writer.protect(ref, await writer.read_claim(ref))
            share = DeviceShare(uuid="GPU-0", index=0, memory_mib=1024, cores=0)
            await writer.write_allocation(ref, current, allocation(claim_id(meta["uid"]), "gpu-0", [share]))
            return await writer.lift_gate(ref)

        async def gates() -> list[dict]:
            got = await pods.admin.get(object_path("v1", "pods", "old", kube_namespace))
            return got["spec"].get("schedulingGates") or []

        assert not await allocate(claims[0]), "the gate was lifted with one of the pod's claims unallocated"
        assert await gates() == [{"name": SCHEDULING_GATE}]
        assert await allocate(claims[1])
        assert await gates() == []
    finally:
        await writer.close()
        await pods.close()
