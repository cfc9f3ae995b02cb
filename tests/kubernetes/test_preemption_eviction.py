"""Preemption on Kubernetes evicts the victim's pod through the Eviction API: a PodDisruptionBudget
that allows no disruption refuses it (and nothing is deleted), and an accepted eviction is a
graceful delete with the pod's own grace period. Several victims go all or none.

Real here: kube-apiserver (its eviction subresource and PDB check), the disruption controller of
kube-controller-manager (the budget's status), and placement's identity with the RBAC of
deploy/k8s/placement.yaml. Played: the kubelet, by writing the pod's status Running and Ready (the
API server lets a Pending pod be evicted whatever its budget says, as a kubelet-less pod would be).
"""

from __future__ import annotations

import datetime as dt

from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import KubeClaimRef

from tessera.placement.kube import KubeWriter
from tessera.placement.preempting import evict_all

from kit import eventually
from kit.kubecluster import service_identity

GRACE = 45  # seconds: the pod's terminationGracePeriodSeconds


async def _running_pod(admin: KubeApi, ns: str, name: str) -> dict:
    pod = await admin.create(object_path("v1", "pods", namespace=ns), {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"nodeName": "evict-node-0", "terminationGracePeriodSeconds": GRACE,
                 "containers": [{"name": "train", "image": "busybox:1.36"}]}})
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    await admin.patch_status(object_path("v1", "pods", name, ns), {"status": {
        "phase": "Running", "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}})
    return pod


async def test_a_victims_pod_is_evicted_only_where_its_budget_allows_and_with_its_grace_period(
        kube_cluster, kube_namespace):
    ns = kube_namespace
    admin = KubeApi.for_kubeconfig(kube_cluster.admin_kubeconfig)
    writer = KubeWriter(KubeApi.for_kubeconfig(service_identity(kube_cluster, "placement.yaml")))
    try:
        pod = await _running_pod(admin, ns, "victim")
        ref = KubeClaimRef(namespace=ns, name="victim-gpu", uid="unused", pod="victim",
                           pod_uid=pod["metadata"]["uid"])
        budget = object_path("policy/v1", "poddisruptionbudgets", "victim", ns)
        await admin.create(object_path("policy/v1", "poddisruptionbudgets", namespace=ns), {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "victim"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "victim"}}}})

        for dry_run in (True, False):
            why = await writer.evict(ref, dry_run=dry_run)
            assert why is not None and "PodDisruptionBudget" in why and "victim" in why, why
        assert "deletionTimestamp" not in (await admin.get(object_path("v1", "pods", "victim", ns)))["metadata"]

        await admin.delete(budget)
        await eventually(lambda: _no_budget(admin, budget))
        assert await writer.evict(ref, dry_run=True) is None
        assert "deletionTimestamp" not in (await admin.get(object_path("v1", "pods", "victim", ns)))["metadata"]
        assert await writer.evict(ref) is None
        meta = (await admin.get(object_path("v1", "pods", "victim", ns)))["metadata"]
        assert "deletionTimestamp" in meta and meta["deletionGracePeriodSeconds"] == GRACE, meta

        # Another pod of the victim's name is not the victim: nothing of it is evicted.
        other = KubeClaimRef(namespace=ns, name="x", uid="unused", pod="victim",
                             pod_uid="00000000-0000-4000-8000-000000000000")
        assert await writer.evict(other) is None
    finally:
        await writer.close()
        await admin.close()


async def test_victims_are_evicted_all_or_none(kube_cluster, kube_namespace):
    ns = kube_namespace
    admin = KubeApi.for_kubeconfig(kube_cluster.admin_kubeconfig)
    writer = KubeWriter(KubeApi.for_kubeconfig(service_identity(kube_cluster, "placement.yaml")))
    try:
        refs = []
        for name in ("free", "guarded"):
            pod = await _running_pod(admin, ns, name)
            refs.append(KubeClaimRef(namespace=ns, name=f"{name}-gpu", uid="unused", pod=name,
                                     pod_uid=pod["metadata"]["uid"]))
        await admin.create(object_path("policy/v1", "poddisruptionbudgets", namespace=ns), {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "guarded"},
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "guarded"}}}})
        why = await evict_all(writer, refs)
        assert "guarded" in why and "PodDisruptionBudget" in why, why
        for name in ("free", "guarded"):  # the free one too: one victim alone frees too little
            assert "deletionTimestamp" not in (await admin.get(object_path("v1", "pods", name, ns)))["metadata"]
    finally:
        await writer.close()
        await admin.close()


async def _no_budget(admin: KubeApi, path: str) -> bool:
    return await admin.get(path) is None
