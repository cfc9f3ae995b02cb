"""The manager runs a Ready tenant's pod syncer itself: nobody starts `PodSync` by hand.

A manager in Kubernetes mode on the session's real v1.36 plane, acting as
deploy/k8s/controlplane/manager.yaml's ServiceAccount with that file's RBAC (`kube_mode`), and the
ClusterRole of deploy/k8s/controlplane/tenant-pods.yaml as the operator installs it. A tenant
created through the manager gets, in its host namespace, the ServiceAccount and RoleBinding the
manager makes (the real API server accepting the binding from the manager's `bind` grant), the
syncer runs with a token of that account (its status says Syncing), its cluster has the virtual
node, and a pod applied with `kubectl --kubeconfig <tenant's>` is mirrored into the host namespace.
Asleep, the syncer stops; awake, it runs again and keeps the host pod it made. Deleting the tenant removes the mirrored pod, the node and the identity.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from tessera.controlplane import manifests
from tessera.controlplane.spec import parse_spec
from tessera.controlplane.tenantpods import hostpod
from tessera.controlplane.tenantpods.running import ACCOUNT
from tessera.controlplane.tenantpods.virtualnode import TAINT_KEY, node_name
from tessera.shared.kubeapi import KubeApi

from controlplane.planes import Planes, cross_kubeconfig
from kit import eventually
from kit.kubecluster import apply, manifests as deployed


def _pod(name: str) -> dict:
    """An ordinary pod meant for the fleet (it tolerates the virtual node's taint), Pod Security
    "restricted" as the host namespace enforces it."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                     "securityContext": {"allowPrivilegeEscalation": False,
                                                         "capabilities": {"drop": ["ALL"]}}}]}}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kube_mode", ["etcd"], indirect=True)
async def test_the_manager_runs_a_ready_tenants_pod_syncer_and_removes_it_with_the_tenant(
        kube_mode: Planes, kube_plane, tmp_path):
    planes = kube_mode
    await asyncio.to_thread(apply, kube_plane, deployed("controlplane/tenant-pods.yaml"))
    tenant = f"p{uuid.uuid4().hex[:8]}"
    namespace = manifests.namespace(tenant)
    admin = KubeApi.for_kubeconfig(str(kube_plane.admin_kubeconfig))
    try:
        # guaranteed one GPU, and two more it may borrow while the fleet has them idle
        await planes.manager.api.apply(tenant, parse_spec({"datastore": {"driver": planes.driver},
                                                           "quota": {"gpus": 1, "borrowingLimit": {"gpus": 2}}}))
        record = await planes.wait_phase(tenant, "Ready")

        async def syncing():
            now = await planes.record(tenant)
            return now if now is not None and now.status.gpu_pods == "Syncing" else None
        try:
            await eventually(syncing, timeout=90, what="the tenant's status: GpuPods Syncing")
        except AssertionError:
            raise AssertionError(f"{(await planes.record(tenant)).status}") from None
        account = await admin.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{ACCOUNT}")
        binding = await admin.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings/{ACCOUNT}")
        assert account is not None and binding is not None
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                      "name": "tessera-tenant-pods"}

        pki = await planes.pki(tenant)
        conf = cross_kubeconfig(tmp_path / "tenant.kubeconfig", planes.host.endpoint(record), pki["ca.crt"], pki)
        node = json.loads((await planes.kubectl(conf, "get", "node", node_name(tenant), "-o", "json")).stdout)
        assert node["spec"]["taints"][0]["key"] == TAINT_KEY
        # its own scheduler may place what the host's placement lets it borrow; the host decides the rest
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "3", node["status"]

        applied = await planes.kubectl(conf, "apply", "-f", "-", stdin=json.dumps(_pod("work")))
        assert applied.returncode == 0, applied.stderr
        hosted = f"/api/v1/namespaces/{namespace}/pods/{hostpod.host_name('default', 'work')}"
        mirrored = await eventually(lambda: admin.get(hosted), timeout=60, what="the tenant's pod on the host")
        assert mirrored["metadata"]["labels"][hostpod.TENANT] == tenant
        # as the tenant's own host identity, not the manager's
        made = [e for e in kube_plane.audit() if e["verb"] == "create" and e.get("stage") == "ResponseComplete"
                and e["objectRef"].get("resource") == "pods" and e["objectRef"].get("namespace") == namespace]
        assert {e["user"]["username"] for e in made} == {f"system:serviceaccount:{namespace}:{ACCOUNT}"}, made

        # asleep (`tessera tenant sleep`: the Deployment scaled to zero, the processes stopped): the
        # syncer stops with its API server; awake again, it runs again and adopts what it had made
        asleep = (await planes.call("sleep", tenant)).result["tenant"]
        assert (asleep["reason"], asleep["gpu_pods"]) == ("Sleeping", ""), asleep
        assert (await planes.call("wake", tenant)).ok
        await eventually(syncing, timeout=120, what="the syncer running again after a wake")
        assert (await admin.get(hosted))["metadata"]["uid"] == mirrored["metadata"]["uid"]

        reply = await planes.call("delete", tenant)
        assert reply.ok, reply.error
        await eventually(lambda: _gone(planes, tenant), timeout=120, what="the tenant deleted")
        assert await admin.get(hosted) is None
        assert await admin.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{ACCOUNT}") is None
        cleared = [e for e in kube_plane.audit() if e["verb"] == "deletecollection"
                   and e["objectRef"].get("namespace") == namespace and e.get("stage") == "ResponseComplete"]
        assert {e["objectRef"]["resource"] for e in cleared} >= {"pods", "configmaps", "secrets"}, cleared
    finally:
        await admin.close()


async def _gone(planes: Planes, tenant: str) -> bool:
    return await planes.record(tenant) is None


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kube_mode", ["etcd"], indirect=True)
async def test_a_failing_syncer_shows_in_the_tenants_status_and_is_restarted(kube_mode: Planes, kube_plane):
    """The host without tenant-pods.yaml's ClusterRole (an operator who left it out): the binding the
    manager makes grants nothing, the syncer's first host read is refused, and the tenant's status
    says so (not lost in a log); once the ClusterRole is applied, the restarted syncer runs."""
    planes = kube_mode
    await asyncio.to_thread(kube_plane.kubectl, "delete", "clusterrole", "tessera-tenant-pods", "--ignore-not-found")
    tenant = f"f{uuid.uuid4().hex[:8]}"
    try:
        await planes.create(tenant)

        async def status(prefix: str):
            now = await planes.record(tenant)
            return now.status.gpu_pods if now is not None and now.status.gpu_pods.startswith(prefix) else None
        failed = await eventually(lambda: status("Failed: "), timeout=90, what="the tenant's status: GpuPods Failed")
        assert "forbidden" in failed.lower(), failed
        await asyncio.to_thread(apply, kube_plane, deployed("controlplane/tenant-pods.yaml"))
        await eventually(lambda: status("Syncing"), timeout=120, what="the restarted syncer Syncing")
    finally:
        await asyncio.to_thread(apply, kube_plane, deployed("controlplane/tenant-pods.yaml"))
        await planes.call("delete", tenant)
