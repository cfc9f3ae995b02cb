"""A tenant's GPU pod, applied to the tenant's own API server, runs on the host's shared fleet.

Both halves real and meeting: the tenant's control plane is the manager's (kube-apiserver,
controller manager and scheduler on the tenant's own etcd prefix and user, ``planes``), the host is
the session's real control plane and node with Tessera's five services on it (`TesseraOnNode`),
and between them the tenant's syncer with the tenant's admin kubeconfig and the host identity of
deploy/k8s/controlplane/tenant-pods.yaml in the tenant's host namespace. `kubectl --kubeconfig
<tenant's> apply` of a pod written for HAMi: the tenant's policy sends it to the virtual node, the
syncer mirrors it, the host's webhook, claim, placement, kubelet plugin and CDI run it on the
node's GPU, its container stops at exactly its memory, the tenant's API server shows it Running
with its pod IP, and deleting it there frees the GPU in the ledger.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tessera.controlplane.tenantpods import hostpod
from tessera.controlplane.tenantpods.virtualnode import node_name
from tessera.shared.events import GpuQuota

from gpupods import hami_pod
from kit import eventually
from kubetessera import ledgers
from realpods import OUT_OF_MEMORY, TesseraOnNode
from tenantpodsync import host_identity, syncing

TENANT = "alpha"
MEMORY_MIB, CORES = 1024, 30
QUOTA = GpuQuota(gpus=2, memory_mib=8192, cores=200)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("planes", ["etcd"], indirect=True)
async def test_a_tenants_gpu_pod_runs_on_the_shared_fleet_and_is_given_back(
        planes, kube_cluster, kube_node, kube_namespace, nats_url, tmp_path):
    await planes.create(TENANT)
    conf = await planes.kubeconfig(TENANT, tmp_path)

    async def tenant_json(*args: str) -> dict | None:
        done = await planes.kubectl(conf, *args, "-o", "json")
        return json.loads(done.stdout) if done.returncode == 0 else None

    await eventually(lambda: tenant_json("get", "serviceaccount", "default"), timeout=120,
                     what="the tenant's default service account (its controller manager makes it)")
    on = TesseraOnNode(kube_cluster, kube_node, kube_namespace, nats_url, tmp_path)
    async with on.running(TENANT, QUOTA):
        identity = await asyncio.to_thread(host_identity, kube_cluster, kube_namespace)
        async with syncing(conf, identity, TENANT, kube_namespace, QUOTA):
            pod = hami_pod("train", "default", on.image, MEMORY_MIB, CORES)
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

            # the container's probe: its claim's memory and not a byte more (the simulated driver)
            reply = await on.probed(hosted, "main")
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
            print(f"tenant pod applied -> Running in the tenant's API server in {running_after:.1f} s; "
                  f"probe {reply}; deleted -> ledger empty in {released_after:.1f} s")
