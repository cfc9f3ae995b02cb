"""A tenant's GPU pod, applied to the tenant's own API server, runs on the host's shared fleet.

Both halves real and meeting: the tenant's control plane is the manager's (kube-apiserver,
controller manager and scheduler on the tenant's own etcd prefix and user, ``planes``), the host is
the session's real control plane and node with Tessera's five services on it (`TesseraOnNode`),
and between them the tenant's syncer with the tenant's admin kubeconfig and the host identity of
deploy/k8s/controlplane/tenant-pods.yaml in the tenant's host namespace. `kubectl --kubeconfig
<tenant's> apply` of a pod written for HAMi: the tenant's policy sends it to the virtual node, the
syncer mirrors it, the host's webhook, claim, placement, kubelet plugin and CDI run it on the
node's GPU (the host namespace enforcing Pod Security "restricted", as a tenant's does), its
container stops at exactly its memory, the tenant's API server shows it Running
with its pod IP, `kubectl logs` there shows the container's log (the virtual node's kubelet
endpoint streams it from the host), and deleting it there frees the GPU in the ledger. Two tenants, each with its own
API server and host namespace, share one physical GPU, each held to its own memory, neither's
host identity able to read the other's namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter

import pytest

from tessera.controlplane.tenantpods import hostpod
from tessera.controlplane.tenantpods.virtualnode import node_name
from tessera.shared.events import GpuQuota
from tessera.shared.hami_names import GPU_POLICY
from tessera.shared.kubeapi import KubeApi, Rejected
from tessera.shared.kubeclaims import TENANT_LABEL

from gpupods import hami_pod
from kit import eventually
from kubetessera import create_tenant, ledgers
from realpods import OUT_OF_MEMORY, TesseraOnNode
from tenantpodsync import ACCOUNT, host_identity, syncing

TENANT = "alpha"
MEMORY_MIB, CORES = 1024, 30
QUOTA = GpuQuota(gpus=2, memory_mib=8192, cores=200)
RESTRICTED = "pod-security.kubernetes.io/enforce=restricted"


async def _tenant_plane(planes, name: str, directory) -> tuple:
    """A tenant's control plane, Ready, with its default service account (its controller manager
    makes it; a pod is refused until it exists): (kubeconfig, kubectl as the tenant, as JSON)."""
    await planes.create(name)
    conf = await planes.kubeconfig(name, directory)

    async def tenant_json(*args: str) -> dict | None:
        done = await planes.kubectl(conf, *args, "-o", "json")
        return json.loads(done.stdout) if done.returncode == 0 else None

    await eventually(lambda: tenant_json("get", "serviceaccount", "default"), timeout=120,
                     what=f"{name}'s default service account")
    return conf, tenant_json


@pytest.mark.timeout(900)
@pytest.mark.parametrize("planes", ["etcd"], indirect=True)
async def test_a_tenants_gpu_pod_runs_on_the_shared_fleet_and_is_given_back(
        planes, kube_cluster, kube_node, kube_namespace, nats_url, tmp_path):
    conf, tenant_json = await _tenant_plane(planes, TENANT, tmp_path)
    # the host namespace enforces Pod Security "restricted", as a tenant's does (manifests.POD_SECURITY)
    await asyncio.to_thread(kube_cluster.kubectl, "label", "namespace", kube_namespace, RESTRICTED)
    on = TesseraOnNode(kube_cluster, kube_node, kube_namespace, nats_url, tmp_path)
    async with on.running(TENANT, QUOTA):
        identity = await asyncio.to_thread(host_identity, kube_cluster, kube_namespace)
        async with syncing(conf, identity, TENANT, kube_namespace, QUOTA, await planes.pki(TENANT)):
            pod = hami_pod("train", "default", on.image, MEMORY_MIB, CORES)
            pod["spec"]["securityContext"] = {"runAsUser": 65532}  # the image's user is root: the tenant says whom
            created = time.monotonic()
            applied = await planes.kubectl(conf, "apply", "-f", "-", stdin=json.dumps(pod))
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
                host = await on.kubectl("describe", "-n", kube_namespace, "pod", hosted, check=False)
                raise AssertionError(f"{await tenant_json('get', 'pod', 'train')}\nhost:\n{host.stdout[-3000:]}") from None
            running_after = time.monotonic() - created
            assert got["spec"]["nodeName"] == node_name(TENANT)
            host = await on.get(f"pod/{hosted}")
            assert host["spec"]["nodeName"] == kube_node.name  # the host's real node, by Tessera's placement
            assert got["status"]["podIP"] == host["status"]["podIP"]
            [status] = got["status"]["containerStatuses"]
            assert status["state"].get("running") and status["restartCount"] == 0, status
            assert status["containerID"] == host["status"]["containerStatuses"][0]["containerID"]

            # the container's probe: its claim's memory and not a byte more (the simulated driver),
            # read with kubectl logs in the tenant's cluster (its API server asks the virtual node)
            async def logged():
                logs = await planes.kubectl(conf, "logs", "train", "-c", "main")
                assert logs.returncode == 0, logs.stderr
                lines = [text for text in logs.stdout.splitlines() if text.startswith("{")]
                return json.loads(lines[-1]) if lines else None
            reply = await eventually(logged, timeout=30, what="the probe's line, through the tenant's kubectl logs")
            assert reply == await on.probed(hosted, "main")  # the host's log, the same
            assert (reply["allocated_mib"], reply["stopped_by"], reply["one_more_byte"]) == (
                MEMORY_MIB, OUT_OF_MEMORY, OUT_OF_MEMORY), reply
            assert [e for lg in (await ledgers(on.client)).values() for e in lg.entries]

            deleted = time.monotonic()
            gone = await planes.kubectl(conf, "delete", "pod", "train", "--timeout=120s")
            assert gone.returncode == 0, gone.stderr
            assert await eventually(lambda: on.given_back(TENANT), timeout=60, what="the ledger given back")
            released_after = time.monotonic() - deleted
            left = await on.kubectl("get", "-n", kube_namespace, "pod", hosted, check=False)
            assert left.returncode != 0, left.stdout
            # what the syncer asked of the host for this pod (its identity's audit records): watches
            # and reads, never a polling loop
            syncer = f"system:serviceaccount:{kube_namespace}:{ACCOUNT}"
            asked = Counter(f"{e['verb']} {e['objectRef'].get('resource', '')}" for e in kube_cluster.audit()
                            if e["user"]["username"] == syncer and e.get("stage") == "ResponseComplete")
            print(f"tenant pod applied -> Running in the tenant's API server in {running_after:.1f} s; "
                  f"probe {reply}; deleted -> ledger empty in {released_after:.1f} s; "
                  f"the syncer's host requests: {dict(asked)}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("planes", ["etcd"], indirect=True)
async def test_two_tenants_pods_share_one_gpu_each_held_to_its_own_memory(
        planes, kube_cluster, kube_node, kube_namespace, nats_url, tmp_path):
    memory = {"alpha": 1024, "beta": 2048}
    (tmp_path / "confs").mkdir()
    tenants = {name: await _tenant_plane(planes, name, tmp_path / "confs") for name in memory}
    beta_namespace = f"{kube_namespace}-beta"
    await asyncio.to_thread(kube_cluster.kubectl, "create", "namespace", beta_namespace)
    try:
        await asyncio.to_thread(kube_cluster.wait_for_service_account, beta_namespace, "default")
        for namespace, label in ((beta_namespace, f"{TENANT_LABEL}=beta"), (beta_namespace, RESTRICTED),
                                 (kube_namespace, RESTRICTED)):
            await asyncio.to_thread(kube_cluster.kubectl, "label", "namespace", namespace, label)
        host_namespaces = {"alpha": kube_namespace, "beta": beta_namespace}
        on = TesseraOnNode(kube_cluster, kube_node, kube_namespace, nats_url, tmp_path)
        async with on.running("alpha", QUOTA), contextlib.AsyncExitStack() as stack:
            await create_tenant(on.client, "beta", QUOTA)
            identities = {}
            for name, namespace in host_namespaces.items():
                identities[name] = await asyncio.to_thread(host_identity, kube_cluster, namespace)
                await stack.enter_async_context(syncing(tenants[name][0], identities[name], name, namespace, QUOTA))
            for name, mib in memory.items():
                pod = hami_pod("train", "default", on.image, mib, CORES)
                pod["metadata"]["annotations"] = {GPU_POLICY: "binpack"}  # onto the GPU already in use
                pod["spec"]["securityContext"] = {"runAsUser": 65532}
                applied = await planes.kubectl(tenants[name][0], "apply", "-f", "-", stdin=json.dumps(pod))
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
            assert devices["alpha"] == devices["beta"], devices  # one physical GPU, two tenants
            assert devices["alpha"][0] == kube_node.name

            # alpha's host identity cannot read beta's host namespace (nor the other way round)
            for name, other in (("alpha", "beta"), ("beta", "alpha")):
                api = KubeApi.for_kubeconfig(str(identities[name]))
                try:
                    with pytest.raises(Rejected):
                        await api.list(f"/api/v1/namespaces/{host_namespaces[other]}/pods")
                finally:
                    await api.close()

            for name in memory:
                gone = await planes.kubectl(tenants[name][0], "delete", "pod", "train", "--timeout=120s")
                assert gone.returncode == 0, gone.stderr
            assert await eventually(lambda: on.given_back("alpha"), timeout=60, what="alpha's share given back")
            assert await eventually(lambda: on.given_back("beta"), timeout=60, what="beta's share given back")
    finally:
        await asyncio.to_thread(kube_cluster.kubectl, "delete", "namespace", beta_namespace, "--wait=false",
                                check=False)
