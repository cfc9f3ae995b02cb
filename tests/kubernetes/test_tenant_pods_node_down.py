"""A syncer away longer than the tenant's node-monitor grace period loses no pod.

While the syncer is down nothing renews the virtual node's Lease: the tenant's node lifecycle
controller marks the node Unknown and taints it ``node.kubernetes.io/unreachable:NoExecute``, and
its taint-eviction controller deletes every pod on it whose toleration of that taint runs out
(the 300 s that the API server's DefaultTolerationSeconds admission gives every pod). The syncer,
back, would then delete the running host pod of each evicted tenant pod: GPU work lost for a
manager restart. The pods on the virtual node tolerate it for good instead (the host's kubelet
runs them; `toleration`).

The tenant's control plane here has its timings shortened, as its flags allow: a 20 s
node-monitor grace period and 5 s default tolerations. It has a second node, Ready, as a tenant's
own worker keeps one: with every node down the controller would stop evicting altogether ("master
disruption mode"), which hides the fault rather than answering it. A witness pod bound to the
virtual node while the syncer is away (so nothing gave it the tolerations) shows that eviction did
run, and ran after the GPU pods' turn: its eviction is scheduled later than theirs.

Nothing runs the host pods (the host has no node with GPUs): their status is what the tenant sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json

import pytest

from tessera.controlplane.tenantpods import hostpod
from tessera.controlplane.tenantpods.virtualnode import TAINT_KEY, node_name
from tessera.shared.events import GpuQuota
from tessera.shared.kubeapi import KubeApi, NotFound

from faults.tenantaudit import tenant_findings
from kit import eventually
from kit.kubecluster import remove, start_control_plane
from tenantpodsync import host_identity, syncing

TENANT = "unleased"
NODE = node_name(TENANT)
QUOTA = GpuQuota(gpus=2, memory_mib=4096, cores=200)
WORKER = "own-worker"  # the tenant's own node, kept Ready by the test
TOLERATED = 5  # seconds: the tenant API server's default not-ready/unreachable tolerations
UNREACHABLE = "node.kubernetes.io/unreachable"  # the node lifecycle controller's taints
NODE_HEALTH = ("node.kubernetes.io/not-ready", UNREACHABLE)


@pytest.fixture(scope="module")
def quick_tenant_cluster():
    """A tenant's control plane whose node lifecycle acts in test time."""
    plane = start_control_plane(
        extra_apiserver_flags=(f"--default-not-ready-toleration-seconds={TOLERATED}",
                               f"--default-unreachable-toleration-seconds={TOLERATED}"),
        # (the syncer renews the node's Lease every 10 s: the grace period must outlast that)
        component_flags={"kube-controller-manager": ("--node-monitor-grace-period=20s", "--node-monitor-period=1s")})
    try:
        yield plane
    finally:
        remove(plane)


def _stamp(micro: bool = False) -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


@contextlib.asynccontextmanager
async def _worker_kept_ready(api: KubeApi):
    """A node of the tenant's own, Ready, its Lease renewed as a kubelet renews it."""
    await api.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": WORKER}})
    await api.patch_status(f"/api/v1/nodes/{WORKER}", {"status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": _stamp(),
         "lastTransitionTime": _stamp()}]}})
    leases = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"

    async def renew():
        while True:
            spec = {"holderIdentity": WORKER, "leaseDurationSeconds": 40, "renewTime": _stamp(micro=True)}
            try:
                await api.patch(f"{leases}/{WORKER}", {"spec": spec})
            except NotFound:
                await api.create(leases, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                          "metadata": {"name": WORKER, "namespace": "kube-node-lease"}, "spec": spec})
            await asyncio.sleep(2)
    task = asyncio.create_task(renew())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.delete(f"/api/v1/nodes/{WORKER}")


def _gpu_pod(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
                "name": "main", "image": "registry.example/none:1",
                "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "512"}}}]}}


def _claiming_pod(name: str) -> dict:
    """Its GPU as a DRA claim of Tessera's class: the syncer binds it (the policy never saw it)."""
    pod = _gpu_pod(name)
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "card"}]
    return pod


CLAIM = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "card", "namespace": "default"},
         "spec": {"devices": {"requests": [{"name": "card", "exactly": {
             "deviceClassName": "gpu.tessera.dev", "count": 1, "capacity": {"requests": {"memory": "512Mi"}}}}]}}}


def _timed(pod: dict) -> list[dict]:
    """The pod's tolerations of the node's health taints that run out."""
    return [t for t in pod["spec"].get("tolerations") or [] if t.get("key") in NODE_HEALTH and "tolerationSeconds" in t]


def _taints(node: dict) -> set[tuple[str, str]]:
    return {(t["key"], t["effect"]) for t in node["spec"].get("taints") or []}


@pytest.mark.timeout(600)
async def test_a_syncer_away_past_the_grace_period_loses_no_pod(quick_tenant_cluster, kube_plane, plane_namespace):
    tenant = quick_tenant_cluster
    await asyncio.to_thread(tenant.wait_for_service_account, "default", "default")
    identity = await asyncio.to_thread(host_identity, kube_plane, plane_namespace)
    api = KubeApi.for_kubeconfig(str(tenant.admin_kubeconfig))
    host_api = KubeApi.for_kubeconfig(str(kube_plane.admin_kubeconfig))
    pods = ("train", "claimed")

    async def tenant_pod(name: str) -> dict | None:
        return await api.get(f"/api/v1/namespaces/default/pods/{name}")

    async def host_pod(name: str) -> dict | None:
        return await host_api.get(f"/api/v1/namespaces/{plane_namespace}/pods/{hostpod.host_name('default', name)}")

    try:
        async with _worker_kept_ready(api):
            await api.create("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims", CLAIM)
            async with syncing(tenant.admin_kubeconfig, identity, TENANT, plane_namespace, QUOTA):
                for made in (_gpu_pod("train"), _claiming_pod("claimed")):
                    await api.create("/api/v1/namespaces/default/pods", made)

                async def mirrored():
                    found = {name: (await tenant_pod(name), await host_pod(name)) for name in pods}
                    return found if all(h is not None and t["spec"].get("nodeName") == NODE
                                        for t, h in found.values()) else None
                before = await eventually(mirrored, timeout=60, what="both pods bound and mirrored")
            # the syncer is away: nothing renews the node's Lease
            node_path = f"/api/v1/nodes/{NODE}"

            async def unreachable():
                node = await api.get(node_path)
                return node if (UNREACHABLE, "NoExecute") in _taints(node) else None
            await eventually(unreachable, timeout=120, what="the tenant's node lifecycle tainting the node unreachable")
            witness = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "witness", "namespace": "default"},
                       "spec": {"nodeName": NODE, "tolerations": [{"key": TAINT_KEY, "operator": "Exists"}],
                                "containers": [{"name": "main", "image": "registry.example/none:1"}]}}
            made = await api.create("/api/v1/namespaces/default/pods", witness)
            assert _timed(made), made["spec"]  # (what DefaultTolerationSeconds gives a pod nothing else touched)

            async def witness_evicted():
                got = await tenant_pod("witness")
                return got is None or got["metadata"].get("deletionTimestamp")
            await eventually(witness_evicted, timeout=120, what="the witness pod evicted by the taint")
            away = {name: await tenant_pod(name) for name in pods}

            # the syncer back: the node Ready and untainted, the witness's deletion finished
            async with syncing(tenant.admin_kubeconfig, identity, TENANT, plane_namespace, QUOTA):
                async def settled():
                    node = await api.get(node_path)
                    health = _taints(node) & {(k, e) for k in NODE_HEALTH for e in ("NoExecute", "NoSchedule")}
                    findings = await tenant_findings(api, host_api, TENANT, plane_namespace, NODE, set())
                    return not health and not findings and await tenant_pod("witness") is None
                await eventually(settled, timeout=120, what="the node healthy, the witness gone, both sides agreeing")
                now = {name: (await tenant_pod(name), await host_pod(name)) for name in pods}
                lost = {name: {"tenant pod": "gone" if t is None else t["metadata"].get("deletionTimestamp"),
                               "host pod": "gone" if h is None else
                               ("made again" if h["metadata"]["uid"] != before[name][1]["metadata"]["uid"] else "kept")}
                        for name, (t, h) in now.items()}
                assert all(v == {"tenant pod": None, "host pod": "kept"} for v in lost.values()), \
                    f"pods evicted while the syncer was away: {lost}; just before it came back: " \
                    f"{ {n: p and p['metadata'].get('deletionTimestamp') for n, p in away.items()} }"
                for name, (pod, _) in now.items():
                    assert not _timed(pod), (name, pod["spec"]["tolerations"])

                async def caught_up():  # the host's status on each tenant pod again
                    now = {name: (await tenant_pod(name), await host_pod(name)) for name in pods}
                    return all(all(t["status"].get(k) == v for k, v in hostpod.status_for_tenant(h).items())
                               for t, h in now.values())
                await eventually(caught_up, timeout=60, what="the host's status told again")
                print(f"status while the syncer was away: {json.dumps({n: p['status'] for n, p in away.items()})}")
    finally:
        for name in (*pods, "witness"):
            await asyncio.to_thread(tenant.kubectl, "delete", "pod", name, "--grace-period=0", "--force",
                                    "--ignore-not-found", check=False)
        await asyncio.to_thread(tenant.kubectl, "delete", "resourceclaim", "card", "--ignore-not-found", check=False)
        await api.close()
        await host_api.close()
