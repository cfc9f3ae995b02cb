"""A tenant's pod never becomes more on the host than the tenant may have.

Each field that would reach the host itself (its network, PID or IPC namespace, a host path or
port, a privileged container or an added capability, a service-account token other than the
tenant's own, a node selector or node affinity that picks host nodes): no host pod is made, and
the event on the tenant's pod names the field (a GPU pod is meant for the virtual node: the
tenant's policy gave it the node's toleration).
On a real tenant API server (kube-apiserver, controller manager, scheduler of its own) and the
session's real host plane, the syncer acting with the host identity of deploy/k8s.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tessera.controlplane.tenantpods.sync import REFUSED
from tessera.controlplane.tenantpods.virtualnode import TAINT_KEY
from tessera.shared.events import GpuQuota

from kit import eventually
from tenantpodsync import host_identity, syncing

TENANT = "refused"
GPU = {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "512"}}


def _pod(name: str, spec: dict, container: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [{"name": "main", "image": "registry.example/none:1", "resources": GPU,
                                     **container}], **spec}}


REFUSED_FIELDS = {
    "spec.hostNetwork": ({"hostNetwork": True}, {}),
    "spec.hostPID": ({"hostPID": True}, {}),
    "spec.hostIPC": ({"hostIPC": True}, {}),
    "spec.volumes[0].hostPath": ({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}, {}),
    "spec.containers[0].securityContext.privileged": ({}, {"securityContext": {"privileged": True}}),
    "spec.containers[0].securityContext.capabilities.add": (
        {}, {"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}),
    "spec.containers[0].ports[0].hostPort": ({}, {"ports": [{"containerPort": 80, "hostPort": 80}]}),
    "spec.volumes[0].projected.sources[0].serviceAccountToken": (
        {"volumes": [{"name": "token", "projected": {"sources": [
            {"serviceAccountToken": {"path": "token", "audience": "https://kubernetes.default.svc"}}]}}]}, {}),
    "spec.nodeSelector[kubernetes.io/hostname]": ({"nodeSelector": {"kubernetes.io/hostname": "gpu-node-1"}}, {}),
    "spec.affinity.nodeAffinity": ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-node-1"]}]}]}}}}, {}),
}


@pytest.mark.parametrize("field", list(REFUSED_FIELDS))
async def test_a_field_that_reaches_the_host_is_refused_and_named(field, tenant_cluster, kube_plane,
                                                                  plane_namespace):
    spec, container = REFUSED_FIELDS[field]
    pod = _pod("asks-too-much", spec, container)
    tenant = tenant_cluster.admin_kubeconfig
    await asyncio.to_thread(tenant_cluster.wait_for_service_account, "default", "default")
    identity = await asyncio.to_thread(host_identity, kube_plane, plane_namespace)
    async with syncing(tenant, identity, TENANT, plane_namespace, GpuQuota(gpus=1, memory_mib=1024, cores=100)):
        made = json.loads((await asyncio.to_thread(tenant_cluster.kubectl, "create", "-f", "-", "-o", "json",
                                                   stdin=json.dumps(pod))).stdout)
        try:
            event = await _refused_and_not_hosted(tenant_cluster, kube_plane, plane_namespace, made, field)
            assert event["type"] == "Warning"
        finally:
            await asyncio.to_thread(tenant_cluster.kubectl, "delete", "pod", "asks-too-much", "--grace-period=0",
                                    "--force", "--ignore-not-found", check=False)


async def _refused_and_not_hosted(tenant_cluster, kube_plane, plane_namespace: str, made: dict, field: str) -> dict:
    """The HostPodRefused event on the tenant's pod ``made``, naming ``field``; no host pod made."""
    async def refused():
        events = json.loads((await asyncio.to_thread(
            tenant_cluster.kubectl, "get", "events", "-n", "default", "-o", "json",
            "--field-selector", f"involvedObject.name={made['metadata']['name']}")).stdout)["items"]
        return [e for e in events if e["reason"] == REFUSED and e["involvedObject"]["uid"] == made["metadata"]["uid"]]

    [event] = await eventually(refused, timeout=30, what=f"the {REFUSED} event")
    assert field in event["message"], event["message"]
    hosted = json.loads((await asyncio.to_thread(kube_plane.kubectl, "get", "pods", "-n", plane_namespace,
                                                 "-o", "json")).stdout)["items"]
    assert not hosted, [p["metadata"]["name"] for p in hosted]
    return event


# A DRA claim written in the tenant's cluster: what the host must not take, by the claim's field.
_TESSERAS = {"deviceClassName": "gpu.tessera.dev", "count": 1, "capacity": {"requests": {"memory": "512Mi"}}}
REFUSED_CLAIMS = {
    "ResourceClaim asks: spec.devices.requests[0].exactly.deviceClassName": (
        {"exactly": {"deviceClassName": "gpu.other.example"}}, 1),
    "ResourceClaim asks: spec.devices.requests[0].exactly.adminAccess": (
        {"exactly": {**_TESSERAS, "adminAccess": True}}, 1),
    "ResourceClaim asks: spec.devices.requests[0].firstAvailable": (
        {"firstAvailable": [{"name": "any", **_TESSERAS}]}, 1),
    "ResourceClaim asks: spec.devices.requests[0].exactly.selectors": (
        {"exactly": {**_TESSERAS, "selectors": [{"cel": {"expression": "device.driver == 'gpu.tessera.dev'"}}]}}, 1),
    "spec.containers[1].resources.claims[0]": ({"exactly": _TESSERAS}, 2),
}


@pytest.mark.parametrize("field", list(REFUSED_CLAIMS))
async def test_a_claim_the_host_must_not_take_is_refused_and_named(field, tenant_cluster, kube_plane,
                                                                  plane_namespace):
    """Another device class, admin access, alternatives, CEL selectors, one claim for two
    containers: the pod is neither bound nor mirrored, and the event names the claim's field. (A
    pod names claims of its own namespace only: the tenant's API server refuses any other.)"""
    request, containers = REFUSED_CLAIMS[field]
    tenant = tenant_cluster.admin_kubeconfig
    await asyncio.to_thread(tenant_cluster.wait_for_service_account, "default", "default")
    # (admin access needs the namespace's consent, or the tenant's own API server refuses the claim)
    await asyncio.to_thread(tenant_cluster.kubectl, "label", "namespace", "default", "--overwrite",
                            "resource.kubernetes.io/admin-access=true")
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "asks", "namespace": "default"},
             "spec": {"devices": {"requests": [{"name": "gpu", **request}]}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "claims-too-much", "namespace": "default"},
           "spec": {"tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": "asks"}],
                    "containers": [{"name": f"c{i}", "image": "registry.example/none:1",
                                    "resources": {"claims": [{"name": "gpu"}]}} for i in range(containers)]}}
    identity = await asyncio.to_thread(host_identity, kube_plane, plane_namespace)
    async with syncing(tenant, identity, TENANT, plane_namespace, GpuQuota(gpus=1, memory_mib=1024, cores=100)):
        await asyncio.to_thread(tenant_cluster.kubectl, "create", "-f", "-", stdin=json.dumps(claim))
        made = json.loads((await asyncio.to_thread(tenant_cluster.kubectl, "create", "-f", "-", "-o", "json",
                                                   stdin=json.dumps(pod))).stdout)
        try:
            await _refused_and_not_hosted(tenant_cluster, kube_plane, plane_namespace, made, field)
            now = json.loads((await asyncio.to_thread(tenant_cluster.kubectl, "get", "pod", "claims-too-much",
                                                      "-o", "json")).stdout)
            assert not now["spec"].get("nodeName"), now["spec"]  # not bound to the virtual node either
        finally:
            for kind, name in (("pod", "claims-too-much"), ("resourceclaim", "asks")):
                await asyncio.to_thread(tenant_cluster.kubectl, "delete", kind, name, "--grace-period=0",
                                        "--force", "--ignore-not-found", check=False)
