"""One GPU pod on Kubernetes from its admission to a container that cannot use more than its claim,
across both sides: the control side's allocation is what the node side prepares and enforces.

Every Tessera service runs as its own process in Kubernetes mode (tests/kubernetes/kubetessera.py)
against a real nats-server and the strict API-server emulator, which calls the translator's webhook
as deploy/k8s installs it (over TLS verified against the caBundle). The test plays the rest of a
cluster: the resourceclaim controller and kube-scheduler (tests/kubernetes/kubeparts.py), and the
kubelet of the node the pod is bound to, which finds that node's enforcer through the registration
socket (GetInfo), asks it to prepare the claim the API server holds, and hands the CDI id it gets to
a real container runtime (Podman, tests/containers/runtime.py). Placement's ``status.allocation``
and the plugin's checks of it (tessera.enforcer.kubelet.allocation) must agree for any of it to run.

The emulator does not model a pod's graceful deletion (the pod object stays until its kubelet has
stopped its containers and unprepared its claims); a finalizer of the test's "kubelet" stands in for
that wait, so the order is the real one: pod deleted, containers gone, claim unprepared, pod gone,
its claim collected, the claim released.
"""

from __future__ import annotations

import asyncio
import json

from tessera.shared.events import GpuQuota
from tessera.shared.kubeclaims import DRIVER, TENANT_LABEL, claim_id

from kube_objects import namespace
from kubeletkit import Kubelet
from kubeparts import allocated_node, claims_released, gpu_pod, kubelet_start, make_claims, schedule, stored
from kit import eventually
from kubetessera import create_tenant, ledgers, quota_in_use, whole_tessera
from runtime import Podman

RC = "resource.k8s.io/v1"
PROBE = "/usr/local/bin/cuda_probe"
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
KUBELET_HOLD = "test.tessera.dev/kubelet"  # stands in for graceful deletion (see the docstring)
MEMORY_MIB, CORES = 1024, 30


async def test_a_pod_admitted_allocated_prepared_and_enforced_then_given_back(
        apiserver, nats_url, tmp_path, tools, base_image, cuda_probe):
    async with whole_tessera(apiserver, nats_url, tmp_path) as (cluster, client):
        await create_tenant(client, "alpha", GpuQuota(gpus=2))
        await apiserver.create(namespace("team-a", {TENANT_LABEL: "alpha"}))

        # Admission: the webhook rewrites the pod, its template lands in the pod's namespace.
        pod = await apiserver.create(gpu_pod("train", "team-a", {
            "nvidia.com/gpu": 1, "nvidia.com/gpumem": MEMORY_MIB, "nvidia.com/gpucores": CORES}))
        [entry] = pod["spec"]["resourceClaims"]
        assert apiserver.object(RC, "resourceclaimtemplates", entry["resourceClaimTemplateName"], "team-a")
        await apiserver.patch("v1", "pods", "train", {"metadata": {"finalizers": [KUBELET_HOLD]}}, "team-a")

        # The claim, requested by the translator, allocated by placement, the gate lifted, bound.
        [claim] = await make_claims(apiserver, pod)
        cid = claim_id(claim["metadata"]["uid"])
        await client.wait_for(cid, {"allocated"}, timeout=30)

        def allocated():
            held = apiserver.object(RC, "resourceclaims", claim["metadata"]["name"], "team-a")
            return held if (held.get("status") or {}).get("allocation") else None

        def ungated():
            return not stored(apiserver, pod)["spec"].get("schedulingGates")

        assert await eventually(allocated), "placement wrote no allocation"
        assert await eventually(ungated), "the scheduling gate was not lifted"
        node = await schedule(apiserver, pod)
        held = allocated()
        assert node == allocated_node(held)
        [result] = held["status"]["allocation"]["devices"]["results"]
        assert result["consumedCapacity"]["memory"] == f"{MEMORY_MIB}Mi"

        # The kubelet of that node: its plugin found through the registry, the claim prepared.
        dirs = cluster.kubelet(node)
        kubelet = Kubelet(dirs.registry)
        try:
            info = await kubelet.register()
            assert info.name == DRIVER
            ref = {"namespace": "team-a", "name": held["metadata"]["name"], "uid": held["metadata"]["uid"]}
            reply = (await kubelet.prepare(ref))[ref["uid"]]
            assert reply.error == "", reply.error
            [device] = reply.devices
            # the device the kubelet matches with the allocation's result: the same pool, device and share
            assert (list(device.request_names), device.pool_name, device.device_name, device.share_id) == (
                [result["request"]], result["pool"], result["device"], result["shareID"])
            [cdi_id] = device.cdi_device_ids
            assert (await kubelet_start(apiserver, pod))["status"]["phase"] == "Running"

            # The container runtime applies the CDI spec: the claim's memory and not a byte more.
            podman = Podman(cdi_dir=dirs.cdi, tools=tools)
            run = podman.run_args(base_image, cdi_id, mounts={str(cuda_probe): PROBE})
            ran = await asyncio.to_thread(podman, *run, PROBE, "64", "0")
            assert ran.code == 0, ran.stderr[-2000:]
            got = json.loads(ran.stdout.strip().splitlines()[-1])
            assert (got["allocated_mib"], got["stopped_by"], got["one_more_byte"]) == (
                MEMORY_MIB, OUT_OF_MEMORY, OUT_OF_MEMORY), got

            # kubectl delete pod: the kubelet stops it and unprepares; then the pod and claim go.
            await apiserver.delete("v1", "pods", "train", "team-a")
            assert stored(apiserver, pod)["metadata"].get("deletionTimestamp")
            assert (await kubelet.unprepare(ref))[ref["uid"]].error == ""
        finally:
            await kubelet.close()
        await apiserver.patch("v1", "pods", "train", {"metadata": {"finalizers": None}}, "team-a")
        assert stored(apiserver, pod) is None
        # the claim stays (delete protection) until the resourceclaim controller sees the pod gone
        await claims_released(apiserver, [held])
        assert apiserver.object(RC, "resourceclaims", held["metadata"]["name"], "team-a") is None
        await client.wait_for(cid, {"released"}, timeout=30)

        async def given_back():
            return all(not lg.entries for lg in (await ledgers(client)).values()) \
                and not (await quota_in_use(client, "alpha")).claims

        assert await eventually(given_back), (await ledgers(client), await quota_in_use(client, "alpha"))
        assert not (cluster.state_dir(node) / "claims" / cid).exists()
        assert not list(dirs.cdi.iterdir())
        refused = await asyncio.to_thread(podman, *run, PROBE, "64", "0")
        assert refused.code != 0 and f"unresolvable CDI devices {cdi_id}" in refused.stderr, refused.stderr
