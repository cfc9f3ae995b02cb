"""A restart of a tenant's pod syncer mid-flight loses and duplicates nothing.

The manager's own syncer (``syncing_manager``) on the real host and node with Tessera's services,
and the tenant's own API server: while GPU pods are applied and deleted in the tenant's cluster,
the syncer is killed again and again at random moments (`TenantPods.stop` cancels it wherever it
is, mid-request included, as a crash would; the manager's resync starts it again within seconds,
as after a crash). Afterwards the auditor's tenant side (tests/faults/tenantaudit.py) finds every
live tenant pod with exactly one host pod, no host pod without its tenant pod, no tenant pod stuck
deleting, and the ledger holding exactly the claims of the live host pods; the ledger auditor
(tests/faults/auditor.py) finds no revision that ever over-committed or placed a claim twice; and
the host's audit log shows no host pod created twice.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from tessera.controlplane import manifests
from tessera.controlplane.tenantpods.running import ACCOUNT
from tessera.controlplane.tenantpods.virtualnode import node_name
from tessera.shared.events import GpuQuota
from tessera.shared.kubeapi import KubeApi

from faults.auditor import Auditor
from faults.tenantaudit import tenant_findings
from gpupods import hami_pod
from kit import eventually
from realpods import TesseraOnNode
from tenantpodsync import tenant_name, tenant_plane

QUOTA = GpuQuota(gpus=16, memory_mib=16384, cores=1600)
PODS = 8


async def _kill_again_and_again(planes, tenant: str, kills: list[float], seed: int) -> None:
    """Stop the tenant's syncer at random moments; the manager's resync starts it again."""
    rng = random.Random(seed)
    pods = planes.manager.reconciler.pods
    while True:
        await asyncio.sleep(rng.uniform(0.3, 2.5))
        await pods.stop(tenant)
        kills.append(asyncio.get_running_loop().time())


@pytest.mark.timeout(900)
async def test_restarts_of_the_syncer_mid_flight_lose_and_duplicate_nothing(
        syncing_manager, kube_cluster, kube_node, nats_url, tmp_path):
    planes = syncing_manager
    tenant = tenant_name("r")
    namespace = manifests.namespace(tenant)
    conf, tenant_json = await tenant_plane(planes, tenant, tmp_path)
    seed = random.randrange(1 << 30)
    on = TesseraOnNode(kube_cluster, kube_node, namespace, nats_url, tmp_path)
    async with on.running(tenant, QUOTA):
        auditor = await Auditor.start(nats_url)
        tenant_api = KubeApi.for_kubeconfig(str(conf))
        host_api = KubeApi.for_kubeconfig(str(kube_cluster.admin_kubeconfig))
        kills: list[float] = []
        killer = asyncio.create_task(_kill_again_and_again(planes, tenant, kills, seed))
        rng = random.Random(seed)
        try:
            # churn: p0..p7 applied one by one, each even one deleted right after the next is applied
            for i in range(PODS):
                pod = hami_pod(f"p{i}", "default", on.image, 256, 10)
                pod["spec"]["securityContext"] = {"runAsUser": 65532}
                applied = await planes.kubectl(conf, "apply", "-f", "-", stdin=json.dumps(pod))
                assert applied.returncode == 0, applied.stderr
                await asyncio.sleep(rng.uniform(0, 1.5))
                if i % 2:
                    gone = await planes.kubectl(conf, "delete", "pod", f"p{i - 1}", "--wait=false")
                    assert gone.returncode == 0, gone.stderr
            await asyncio.sleep(rng.uniform(0, 3))  # (kills go on a moment after the last change)
        finally:
            killer.cancel()
            await asyncio.gather(killer, return_exceptions=True)
        try:
            live = {f"p{i}" for i in range(1, PODS, 2)}

            async def settled():
                listed = (await tenant_json("get", "pods")) or {"items": []}
                phases = {p["metadata"]["name"]: p["status"].get("phase") for p in listed["items"]}
                if phases != {name: "Running" for name in live}:
                    return None
                findings = await tenant_findings(tenant_api, host_api, tenant, namespace, node_name(tenant),
                                                 await auditor.ledger_claims())
                return None if findings else phases
            try:
                await eventually(settled, timeout=240, what="the tenant's pods and the host agreeing after the kills")
            except AssertionError:
                findings = await tenant_findings(tenant_api, host_api, tenant, namespace, node_name(tenant),
                                                 await auditor.ledger_claims())
                raise AssertionError(f"seed {seed}, {len(kills)} kills: {findings}; "
                                     f"{await tenant_json('get', 'pods')}") from None
            ledger, _ = await auditor.until_clean({}, timeout=60)
            assert ledger.clean, ledger.lines()
            assert len(await auditor.ledger_claims()) == len(live)
            # nothing made twice: each host pod created once, by the tenant's host identity
            syncer = f"system:serviceaccount:{namespace}:{ACCOUNT}"
            created = [e for e in kube_cluster.audit() if e["user"]["username"] == syncer and e["verb"] == "create"
                       and e["objectRef"].get("resource") == "pods" and not e["objectRef"].get("subresource")
                       and e.get("stage") == "ResponseComplete" and e["responseStatus"]["code"] == 201]
            assert len(live) <= len(created) <= PODS, len(created)
            print(f"seed {seed}: {len(kills)} kills of the syncer during the churn; {len(created)} host pods "
                  f"created for {PODS} tenant pods ({PODS - len(live)} deleted meanwhile)")

            for name in live:
                gone = await planes.kubectl(conf, "delete", "pod", name, "--wait=false")
                assert gone.returncode == 0, gone.stderr
            assert await eventually(lambda: on.given_back(tenant), timeout=90, what="the ledger given back")

            async def cleared():
                return await tenant_findings(tenant_api, host_api, tenant, namespace, node_name(tenant),
                                             await auditor.ledger_claims()) == []
            await eventually(cleared, timeout=60, what="every pod gone on both sides")
        finally:
            await auditor.close()
            await tenant_api.close()
            await host_api.close()
    await planes.call("delete", tenant)


async def test_the_tenant_audit_finds_a_lost_pod_a_stray_one_and_a_stray_claim(tenant_cluster, kube_plane,
                                                                            plane_namespace):
    """The auditor's tenant side fails when it must (no syncer runs here): a tenant pod bound to the
    virtual node with no host pod, a host pod of the tenant whose tenant pod never was, a ledger
    claim no host pod holds."""
    tenant = "audited"
    await asyncio.to_thread(tenant_cluster.wait_for_service_account, "default", "default")
    lost = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "lost", "namespace": "default"},
            "spec": {"nodeName": node_name(tenant), "containers": [{"name": "main", "image": "registry.example/x:1"}]}}
    stray = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "stray", "namespace": plane_namespace,
                          "labels": {"tenantpods.tessera.dev/tenant": tenant},
                          "annotations": {"tenantpods.tessera.dev/uid": "no-such-pod"}},
             "spec": {"containers": [{"name": "main", "image": "registry.example/x:1"}]}}
    await asyncio.to_thread(tenant_cluster.kubectl, "create", "-f", "-", stdin=json.dumps(lost))
    await asyncio.to_thread(kube_plane.kubectl, "create", "-f", "-", stdin=json.dumps(stray))
    tenant_api = KubeApi.for_kubeconfig(str(tenant_cluster.admin_kubeconfig))
    host_api = KubeApi.for_kubeconfig(str(kube_plane.admin_kubeconfig))
    claim = "k8s-00000000-0000-4000-8000-000000000000"
    try:
        found = await tenant_findings(tenant_api, host_api, tenant, plane_namespace, node_name(tenant), {claim})
        assert found == ["tenant pod default/lost: 0 host pods", "host pod stray: its tenant pod is gone",
                         f"ledger: {claim} is no live host pod's claim"], found
    finally:
        await tenant_api.close()
        await host_api.close()
        await asyncio.to_thread(tenant_cluster.kubectl, "delete", "pod", "lost", "--grace-period=0", "--force",
                                check=False)
