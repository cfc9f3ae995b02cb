"""A tenant's GPU pod, applied to the tenant's own API server, runs on the host's shared fleet.

Both halves real and meeting, as they run: the control-plane manager in Kubernetes mode on the
host of this run (``kube_manager``: acting as deploy/k8s/controlplane/manager.yaml's identity,
the tenants' control planes its own processes from what the host stores), which for each Ready
tenant makes the host identity of deploy/k8s/controlplane/tenant-pods.yaml in the tenant's host
namespace and runs the tenant's syncer itself (nobody here starts `PodSync`); the host is the
session's real control plane and node with Tessera's services on it (`TesseraOnNode`).
`kubectl --kubeconfig <tenant's> apply` of a pod written for HAMi: the tenant's policy sends it to
the virtual node, the manager's syncer mirrors it, the host's webhook, claim, placement, kubelet
plugin and CDI run it on the node's GPU (the host namespace the manager made enforcing Pod
Security "restricted"), its container stops at exactly its memory, the tenant's API server shows
it Running with its pod IP, `kubectl logs` there shows the container's log (the virtual node's
kubelet endpoint streams it from the host), and deleting it there frees the GPU in the ledger.
Two tenants, each with its own API server and host namespace, share one physical GPU, each held to
its own memory, neither's host identity able to read the other's namespace.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from tessera.controlplane import manifests
from tessera.controlplane.tenantpods import hostpod
from tessera.controlplane.tenantpods.running import ACCOUNT
from tessera.controlplane.tenantpods.virtualnode import node_name
from tessera.shared.events import GpuQuota
from tessera.shared.hami_names import GPU_POLICY
from tessera.shared.kubeapi import KubeApi, Rejected

from gpupods import hami_pod
from kit import eventually
from kubetessera import create_tenant, ledgers
from realpods import OUT_OF_MEMORY, TesseraOnNode
from tenantpodsync import tenant_name as _name, tenant_plane as _tenant_plane

MEMORY_MIB, CORES = 1024, 30
QUOTA = GpuQuota(gpus=2, memory_mib=8192, cores=200)


@pytest.mark.timeout(900)
async def test_a_tenants_gpu_pod_runs_on_the_shared_fleet_and_is_given_back(
        syncing_manager, kube_cluster, kube_node, nats_url, tmp_path):
    manager = syncing_manager
    tenant = _name("a")
    namespace = manifests.namespace(tenant)  # the manager made it, Pod Security "restricted" enforced
    conf, tenant_json = await _tenant_plane(manager, tenant, tmp_path)
    on = TesseraOnNode(kube_cluster, kube_node, namespace, nats_url, tmp_path)
    async with on.running(tenant, QUOTA):
        pod = hami_pod("train", "default", on.image, MEMORY_MIB, CORES)
        pod["spec"]["securityContext"] = {"runAsUser": 65532}  # the image's user is root: the tenant says whom
        created = time.monotonic()
        applied = await manager.kubectl(conf, "apply", "-f", "-", stdin=json.dumps(pod))
        assert applied.returncode == 0, applied.stderr

        async def running():
            got = await tenant_json("get", "pod", "train")
            ready = [c for c in got["status"].get("conditions") or [] if c["type"] == "Ready"]
            return got if got["status"].get("phase") == "Running" and ready and ready[0]["status"] == "True" \
                else None
        hosted = hostpod.host_name("default", "train")
        try:
            got = await eventually(running, timeout=180, what="the tenant's pod Running, as its API server says")
        except AssertionError:
            host = await on.kubectl("describe", "-n", namespace, "pod", hosted, check=False)
            raise AssertionError(f"{await tenant_json('get', 'pod', 'train')}\nhost:\n{host.stdout[-3000:]}") from None
        running_after = time.monotonic() - created
        assert got["spec"]["nodeName"] == node_name(tenant)
        host = await on.get(f"pod/{hosted}")
        assert host["spec"]["nodeName"] == kube_node.name  # the host's real node, by Tessera's placement
        assert got["status"]["podIP"] == host["status"]["podIP"]
        [status] = got["status"]["containerStatuses"]
        assert status["state"].get("running") and status["restartCount"] == 0, status
        assert status["containerID"] == host["status"]["containerStatuses"][0]["containerID"]

        # the container's probe: its claim's memory and not a byte more (the simulated driver),
        # read with kubectl logs in the tenant's cluster (its API server asks the virtual node)
        async def logged():
            logs = await manager.kubectl(conf, "logs", "train", "-c", "main")
            assert logs.returncode == 0, logs.stderr
            lines = [text for text in logs.stdout.splitlines() if text.startswith("{")]
            return json.loads(lines[-1]) if lines else None
        reply = await eventually(logged, timeout=30, what="the probe's line, through the tenant's kubectl logs")
        assert reply == await on.probed(hosted, "main")  # the host's log, the same
        assert (reply["allocated_mib"], reply["stopped_by"], reply["one_more_byte"]) == (
            MEMORY_MIB, OUT_OF_MEMORY, OUT_OF_MEMORY), reply
        assert [e for lg in (await ledgers(on.client)).values() for e in lg.entries]

        deleted = time.monotonic()
        gone = await manager.kubectl(conf, "delete", "pod", "train", "--timeout=120s")
        assert gone.returncode == 0, gone.stderr
        assert await eventually(lambda: on.given_back(tenant), timeout=60, what="the ledger given back")
        released_after = time.monotonic() - deleted
        left = await on.kubectl("get", "-n", namespace, "pod", hosted, check=False)
        assert left.returncode != 0, left.stdout
        # what the manager's syncer asked of the host for this pod (its identity's audit records):
        # watches and reads, never a polling loop
        syncer = f"system:serviceaccount:{namespace}:{ACCOUNT}"
        asked = Counter(f"{e['verb']} {e['objectRef'].get('resource', '')}" for e in kube_cluster.audit()
                        if e["user"]["username"] == syncer and e.get("stage") == "ResponseComplete")
        assert asked["create pods"] == 1, asked  # made once, by the tenant's own host identity
        print(f"tenant pod applied -> Running in the tenant's API server in {running_after:.1f} s; "
              f"probe {reply}; deleted -> ledger empty in {released_after:.1f} s; "
              f"the syncer's host requests: {dict(asked)}")
    await manager.call("delete", tenant)


@pytest.mark.timeout(900)
async def test_two_tenants_pods_share_one_gpu_each_held_to_its_own_memory(
        syncing_manager, kube_cluster, kube_node, nats_url, tmp_path):
    manager = syncing_manager
    alpha, beta = _name("a"), _name("b")
    memory = {alpha: 1024, beta: 2048}
    tenants = {name: await _tenant_plane(manager, name, tmp_path) for name in memory}
    host_namespaces = {name: manifests.namespace(name) for name in memory}
    on = TesseraOnNode(kube_cluster, kube_node, host_namespaces[alpha], nats_url, tmp_path)
    async with on.running(alpha, QUOTA):
        await create_tenant(on.client, beta, QUOTA)  # (its namespace carries its name: the manager labelled it)
        for name, mib in memory.items():
            pod = hami_pod("train", "default", on.image, mib, CORES)
            pod["metadata"]["annotations"] = {GPU_POLICY: "binpack"}  # onto the GPU already in use
            pod["spec"]["securityContext"] = {"runAsUser": 65532}
            applied = await manager.kubectl(tenants[name][0], "apply", "-f", "-", stdin=json.dumps(pod))
            assert applied.returncode == 0, applied.stderr
        hosted = hostpod.host_name("default", "train")
        devices = {}
        for name, mib in memory.items():
            async def running(tenant_json=tenants[name][1]):
                got = await tenant_json("get", "pod", "train")
                return got if got["status"].get("phase") == "Running" else None
            await eventually(running, timeout=180, what=f"{name}'s pod Running in its API server")
            host = json.loads((await on.kubectl("get", "-n", host_namespaces[name], "pod", hosted,
                                                "-o", "json")).stdout)
            [status] = host["status"]["resourceClaimStatuses"]
            claim = json.loads((await on.kubectl("get", "-n", host_namespaces[name], "resourceclaim",
                                                 status["resourceClaimName"], "-o", "json")).stdout)
            [result] = claim["status"]["allocation"]["devices"]["results"]
            devices[name] = (result["pool"], result["device"])
            probe = TesseraOnNode(kube_cluster, kube_node, host_namespaces[name], nats_url, tmp_path)
            reply = await probe.probed(hosted, "main")
            assert (reply["allocated_mib"], reply["stopped_by"]) == (mib, OUT_OF_MEMORY), (name, reply)
        assert devices[alpha] == devices[beta], devices  # one physical GPU, two tenants
        assert devices[alpha][0] == kube_node.name

        # alpha's host identity (the token the manager's syncer holds) cannot read beta's host
        # namespace, nor the other way round
        for name, other in ((alpha, beta), (beta, alpha)):
            identity = await _identity(kube_cluster, host_namespaces[name])
            api = KubeApi.for_kubeconfig(str(identity))
            try:
                await api.list(f"/api/v1/namespaces/{host_namespaces[name]}/pods")  # its own: yes
                with pytest.raises(Rejected):
                    await api.list(f"/api/v1/namespaces/{host_namespaces[other]}/pods")
            finally:
                await api.close()

        for name in memory:
            gone = await manager.kubectl(tenants[name][0], "delete", "pod", "train", "--timeout=120s")
            assert gone.returncode == 0, gone.stderr
        for name in memory:
            assert await eventually(lambda name=name: on.given_back(name), timeout=60, what=f"{name}'s share given back")
    for name in memory:
        await manager.call("delete", name)


async def _identity(plane, namespace: str) -> Path:
    """A kubeconfig with a token of the tenant's host identity: the ServiceAccount the manager made
    for its syncer (TokenRequest, as the manager asks for one)."""
    token = await asyncio.to_thread(plane.service_account_token, namespace, ACCOUNT)
    return await asyncio.to_thread(plane.token_kubeconfig, f"{ACCOUNT}-{namespace}", token)


def _claim_spec(memory_mib: int) -> dict:
    return {"devices": {"requests": [{"name": "card", "exactly": {
        "deviceClassName": "gpu.tessera.dev", "count": 1,
        "capacity": {"requests": {"memory": f"{memory_mib}Mi", "cores": str(CORES)}}}}]}}


def _claiming_pod(name: str, image: str, claim: dict) -> dict:
    """The probe's pod with its GPU as a DRA claim, nothing of HAMi's names (``claim``: the pod's
    resourceClaims entry)."""
    pod = hami_pod(name, "default", image, 0, CORES)
    pod["spec"]["securityContext"] = {"runAsUser": 65532}
    pod["spec"]["resourceClaims"] = [{"name": "gpu", **claim}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return pod


@pytest.mark.timeout(900)
async def test_a_tenants_dra_claim_runs_on_the_fleet_under_its_limits_and_is_cleared(
        syncing_manager, kube_cluster, kube_node, nats_url, tmp_path):
    """A pod with a ResourceClaimTemplate of Tessera's class, and one with a ResourceClaim of it,
    in the tenant's own cluster: the syncer binds each to the virtual node (the tenant's scheduler
    has no devices of the host's to allocate), the host pod asks for what the claim asks in HAMi's
    names, the host's own flow makes and allocates its claim (the host takes no hand-made claim of
    the class), the container stops at exactly the claim's memory, and the tenant's claim shows
    the host's allocation, reserved for its pod. Deleted: the ledger is empty, the template's claim
    gone with its pod, the standalone claim no longer allocated."""
    manager = syncing_manager
    tenant = _name("d")
    namespace = manifests.namespace(tenant)
    conf, tenant_json = await _tenant_plane(manager, tenant, tmp_path)
    memory = {"templated": 1024, "claimed": 512}
    on = TesseraOnNode(kube_cluster, kube_node, namespace, nats_url, tmp_path)
    async with on.running(tenant, QUOTA):
        objects = [
            {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
             "metadata": {"name": "one-gpu", "namespace": "default"}, "spec": {"spec": _claim_spec(memory["templated"])}},
            {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "my-gpu", "namespace": "default"}, "spec": _claim_spec(memory["claimed"])},
            _claiming_pod("templated", on.image, {"resourceClaimTemplateName": "one-gpu"}),
            _claiming_pod("claimed", on.image, {"resourceClaimName": "my-gpu"}),
        ]
        for obj in objects:
            applied = await manager.kubectl(conf, "apply", "-f", "-", stdin=json.dumps(obj))
            assert applied.returncode == 0, applied.stderr
        claim_names = {}
        for name, mib in memory.items():
            async def running(name=name):
                got = await tenant_json("get", "pod", name)
                return got if got["status"].get("phase") == "Running" else None
            hosted = hostpod.host_name("default", name)
            try:
                got = await eventually(running, timeout=180, what=f"{name} Running in the tenant's API server")
            except AssertionError:
                host = await on.kubectl("describe", "-n", namespace, "pod", hosted, check=False)
                raise AssertionError(f"{await tenant_json('get', 'pod', name)}\nhost:\n{host.stdout[-3000:]}") from None
            assert got["spec"]["nodeName"] == node_name(tenant)
            host = await on.get(f"pod/{hosted}")
            assert host["spec"]["nodeName"] == kube_node.name
            reply = await on.probed(hosted, "main")
            assert (reply["allocated_mib"], reply["stopped_by"]) == (mib, OUT_OF_MEMORY), (name, reply)
            [status] = host["status"]["resourceClaimStatuses"]
            host_claim = await on.get(f"resourceclaim/{status['resourceClaimName']}")
            [result] = host_claim["status"]["allocation"]["devices"]["results"]
            # the tenant's claim: the host's device, under its own request, reserved for its pod
            claim_names[name] = "my-gpu" if name == "claimed" else got["status"]["resourceClaimStatuses"][0][
                "resourceClaimName"]

            async def allocated(claim=claim_names[name]):
                got = await tenant_json("get", "resourceclaim", claim)
                return got if (got.get("status") or {}).get("allocation") else None
            tenant_claim = await eventually(allocated, timeout=30, what=f"{name}'s claim allocated in the tenant's API")
            [copied] = tenant_claim["status"]["allocation"]["devices"]["results"]
            assert (copied["request"], copied["driver"], copied["pool"], copied["device"]) == (
                "card", result["driver"], result["pool"], result["device"]), copied
            assert [r["uid"] for r in tenant_claim["status"]["reservedFor"]] == [got["metadata"]["uid"]]

        for name in memory:
            gone = await manager.kubectl(conf, "delete", "pod", name, "--timeout=120s")
            assert gone.returncode == 0, gone.stderr
        assert await eventually(lambda: on.given_back(tenant), timeout=60, what="the ledger given back")
        await eventually(lambda: _absent(tenant_json, "resourceclaim", claim_names["templated"]), timeout=60,
                         what="the template's claim gone with its pod")
        standalone = await tenant_json("get", "resourceclaim", "my-gpu")
        assert not (standalone.get("status") or {}).get("allocation"), standalone["status"]
    await manager.call("delete", tenant)


async def _absent(tenant_json, *what: str) -> bool:
    return await tenant_json("get", *what) is None
