"""The tenant pod syncer as the tests run it: on a tenant's real API server (its admin
credentials) and the host's real one (an identity with deploy/k8s/controlplane/tenant-pods.yaml's
rules in the tenant's host namespace only, as the manager's RoleBinding grants them), as a task of
the test's loop that a test can stop and start again (a restart of the sync component).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from pathlib import Path

from tessera.controlplane.pki import PkiAuthority
from tessera.controlplane.tenantpods.logs import LogServer
from tessera.controlplane.tenantpods.sync import PodSync
from tessera.controlplane.tenantpods.virtualnode import Share, VirtualNode, node_name
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.events import GpuQuota
from tessera.shared.kubeapi import KubeApi

import pytest

from controlplane.planes import Planes, cross_kubeconfig, kube_manager
from kit import eventually
from kit.kubecluster import KubeControlPlane, apply, manifests, namespace_identity, remove, start_control_plane

ACCOUNT = "tessera-tenant-pods"


@pytest.fixture(scope="module")
def tenant_cluster():
    """A tenant's control plane of its own (API server, controller manager, scheduler), real, for a
    test module: what the syncer needs of a tenant's cluster, without the manager's datastore (the
    end-to-end test runs the manager's own, tests/kubernetes/test_tenant_gpu_pod.py)."""
    plane = start_control_plane()
    try:
        yield plane
    finally:
        remove(plane)


def host_identity(host: KubeControlPlane, namespace: str) -> Path:
    """A kubeconfig that may do in ``namespace`` exactly what the syncer's ClusterRole says, there only."""
    [role] = manifests("controlplane/tenant-pods.yaml", ("ClusterRole",))
    return namespace_identity(host, namespace, ACCOUNT, role["rules"])


@contextlib.asynccontextmanager
async def syncing(tenant_kubeconfig: Path, host_kubeconfig: Path, tenant: str, host_namespace: str,
                  quota: GpuQuota, tenant_pki: dict[str, str] | None = None):
    """A running syncer (yields it); stopped on leaving, as a killed process would stop: nothing
    of it cleared. ``tenant_pki``: the tenant's PKI (the manager's), to serve the node's logs
    with a certificate from the tenant's CA."""
    tenant_api, host_api = KubeApi.for_kubeconfig(str(tenant_kubeconfig)), KubeApi.for_kubeconfig(str(host_kubeconfig))
    logs = None
    if tenant_pki is not None:
        cert, key = PkiAuthority().issue_serving(tenant_pki["ca.crt"], tenant_pki["ca.key"], node_name(tenant),
                                                 [node_name(tenant)], ["127.0.0.1"])
        logs = LogServer(host_api, host_namespace, cert, key)
    sync = PodSync(tenant_api, host_api, tenant, host_namespace, VirtualNode(tenant_api, tenant, Share(quota)), logs)
    task = asyncio.create_task(sync.run(), name=f"tenant-pods-{tenant}")
    try:
        ready = asyncio.create_task(sync.ready.wait())
        await asyncio.wait([task, ready], timeout=90, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            raise AssertionError(f"the syncer did not get ready: {task}")
        yield sync
    finally:
        await cancel_and_wait([task])
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        await tenant_api.close()  # (a later call on them opens them again: close after it too)
        await host_api.close()


def kubectl_json(result) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# --- the manager's own syncer (what runs) -------------------------------------------------------

@pytest.fixture
async def syncing_manager(binaries, secured_nats, postgres, kube_cluster, tmp_path):
    """The control-plane manager in Kubernetes mode on this run's host (``kube_cluster``), with
    tenant-pods.yaml's ClusterRole as the operator installs it."""
    await asyncio.to_thread(apply, kube_cluster, manifests("controlplane/tenant-pods.yaml"))
    (tmp_path / "manager").mkdir()
    async for made in kube_manager("etcd", kube_cluster, secured_nats, binaries, postgres, tmp_path / "manager"):
        yield made


def tenant_name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"  # (the session's host outlives each test and its namespaces)


async def tenant_plane(planes: Planes, name: str, directory: Path) -> tuple:
    """A tenant made through the manager, its syncer Syncing (the manager started it) and its
    default service account made (a pod is refused until it exists): (kubeconfig, kubectl as the
    tenant, as JSON)."""
    record = await planes.create(name)

    async def syncing():
        now = await planes.record(name)
        return now if now is not None and now.status.gpu_pods == "Syncing" else None
    try:
        await eventually(syncing, timeout=120, what=f"{name}'s status: GpuPods Syncing")
    except AssertionError:
        raise AssertionError(f"{(await planes.record(name)).status}") from None
    pki = await planes.pki(name)
    conf = cross_kubeconfig(directory / f"{name}.kubeconfig", planes.host.endpoint(record), pki["ca.crt"], pki)

    async def tenant_json(*args: str) -> dict | None:
        done = await planes.kubectl(conf, *args, "-o", "json")
        return json.loads(done.stdout) if done.returncode == 0 else None

    await eventually(lambda: tenant_json("get", "serviceaccount", "default"), timeout=120,
                     what=f"{name}'s default service account")
    return conf, tenant_json
