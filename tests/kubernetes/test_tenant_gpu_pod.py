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
import uuid
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

from controlplane.planes import Planes, cross_kubeconfig, kube_manager
from gpupods import hami_pod
from kit import eventually
from kit.kubecluster import apply, manifests as deployed
from kubetessera import create_tenant, ledgers
from realpods import OUT_OF_MEMORY, TesseraOnNode

MEMORY_MIB, CORES = 1024, 30
QUOTA = GpuQuota(gpus=2, memory_mib=8192, cores=200)


@pytest.fixture
async def manager(binaries, secured_nats, postgres, kube_cluster, tmp_path):
    """The control-plane manager in Kubernetes mode on this run's host (``kube_cluster``), with
    tenant-pods.yaml's ClusterRole as the operator installs it."""
    await asyncio.to_thread(apply, kube_cluster, deployed("controlplane/tenant-pods.yaml"))
    (tmp_path / "manager").mkdir()
    async for made in kube_manager("etcd", kube_cluster, secured_nats, binaries, postgres, tmp_path / "manager"):
        yield made


def _name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"  # (the session's host outlives each test and its namespaces)


async def _tenant_plane(planes: Planes, name: str, directory: Path) -> tuple:
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


@pytest.mark.timeout(900)
async def test_a_tenants_gpu_pod_runs_on_the_shared_fleet_and_is_given_back(
        manager, kube_cluster, kube_node, nats_url, tmp_path):
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
        manager, kube_cluster, kube_node, nats_url, tmp_path):
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
