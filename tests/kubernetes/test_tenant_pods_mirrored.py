"""A tenant's pod on its virtual node is mirrored into its host namespace, and the syncer survives
a restart without losing or doubling anything.

The tenant's cluster shows a node for its share (Ready, leased, capacity from its quota in HAMi's
names, tainted); a GPU pod applied there is bound to it and made in the host namespace under a
name no other tenant namespace can take, with copies of the ConfigMap and Secret it reads (owned by
the host pod, so they go with it), no token and no service account of the host's; the host pod's
status and events come back to the tenant's pod; deleting the tenant's pod deletes the host's, and
then finishes. A syncer stopped and started again converges from the two API servers alone: a pod
deleted while it was away goes on the host, a pod created meanwhile is mirrored, the others are
left as they were (the same host pod, uid and all). A GPU pod admitted before the toleration policy
was in force is given the toleration by the syncer. The tenant's teardown (`PodSync.clear`) leaves
no node, lease, policy or mirrored object.

Nothing runs the host pods here (no node has the GPUs they ask for: the host's scheduler says so,
and that is the status the tenant sees); tests/kubernetes/test_tenant_gpu_pod.py runs one on the
real node.
"""

from __future__ import annotations

import asyncio
import json

from tessera.controlplane.tenantpods import hostpod, toleration
from tessera.controlplane.tenantpods.virtualnode import TAINT_KEY, node_name
from tessera.shared.events import GpuQuota
from tessera.shared.kubeclaims import DEVICE_CLASS

from kit import eventually
from kit.kubecluster import manifests
from tenantpodsync import host_identity, syncing

TENANT = "mirrored"
QUOTA = GpuQuota(gpus=2, memory_mib=4096, cores=200)
NODE = node_name(TENANT)
READS = """
apiVersion: v1
kind: ConfigMap
metadata: {name: settings, namespace: default}
data: {batch: "64"}
---
apiVersion: v1
kind: Secret
metadata: {name: token, namespace: default}
stringData: {key: s3cr3t}
"""


def gpu_pod(name: str, reads: bool = False) -> dict:
    container = {"name": "main", "image": "registry.example/none:1",
                 "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "512"}}}
    spec: dict = {"containers": [container], "terminationGracePeriodSeconds": 1}
    if reads:
        container["env"] = [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "token", "key": "key"}}}]
        container["volumeMounts"] = [{"name": "settings", "mountPath": "/etc/settings"}]
        spec["volumes"] = [{"name": "settings", "configMap": {"name": "settings"}}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def plain_pod(name: str) -> dict:
    """No GPU, but tolerating the node's taint: the tenant's own scheduler puts it there."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [{"name": "main", "image": "registry.example/none:1"}],
                     "tolerations": [{"key": TAINT_KEY, "operator": "Exists"}]}}


class Sides:
    def __init__(self, tenant_cluster, host, namespace) -> None:
        self.tenant, self.host, self.namespace = tenant_cluster, host, namespace

    async def tenant_json(self, *args: str, check: bool = True) -> dict | None:
        done = await asyncio.to_thread(self.tenant.kubectl, *args, "-o", "json", check=check)
        return json.loads(done.stdout) if done.returncode == 0 else None

    async def create(self, doc: dict) -> dict:
        return json.loads((await asyncio.to_thread(self.tenant.kubectl, "create", "-f", "-", "-o", "json",
                                                   stdin=json.dumps(doc))).stdout)

    async def host_pods(self) -> dict[str, dict]:
        listed = await asyncio.to_thread(self.host.kubectl, "get", "pods", "-n", self.namespace, "-o", "json")
        return {p["metadata"]["name"]: p for p in json.loads(listed.stdout)["items"]}

    async def host_get(self, kind: str, name: str) -> dict | None:
        done = await asyncio.to_thread(self.host.kubectl, "get", "-n", self.namespace, kind, name, "-o", "json",
                                       check=False)
        return json.loads(done.stdout) if done.returncode == 0 else None

    async def hosted(self, name: str) -> dict:
        return await eventually(lambda: self.host_get("pod", hostpod.host_name("default", name)), timeout=30,
                                what=f"the host pod of {name}")


async def test_a_gpu_pod_is_mirrored_with_what_it_reads_and_told_back(tenant_cluster, kube_plane, plane_namespace):
    await asyncio.to_thread(tenant_cluster.wait_for_service_account, "default", "default")
    await asyncio.to_thread(tenant_cluster.kubectl, "apply", "-f", "-", stdin=READS)
    identity = await asyncio.to_thread(host_identity, kube_plane, plane_namespace)
    sides = Sides(tenant_cluster, kube_plane, plane_namespace)
    async with syncing(tenant_cluster.admin_kubeconfig, identity, TENANT, plane_namespace, QUOTA):
        # the node: Ready, leased, the quota in HAMi's names, tainted
        async def node_ready():
            got = await sides.tenant_json("get", "node", NODE)
            return got if [t["key"] for t in got["spec"].get("taints") or []] == [TAINT_KEY] else None
        node = await eventually(node_ready, timeout=30, what="the virtual node, with its taint alone")
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "2", node["status"]
        assert node["status"]["allocatable"]["nvidia.com/gpucores"] == "200", node["status"]
        assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
        lease = await sides.tenant_json("get", "lease", "-n", "kube-node-lease", NODE)
        assert lease["spec"]["holderIdentity"] == NODE

        made = await sides.create(gpu_pod("train", reads=True))
        host = await sides.hosted("train")
        notes = host["metadata"]["annotations"]
        assert (notes[hostpod.NAMESPACE], notes[hostpod.NAME], notes[hostpod.UID]) == (
            "default", "train", made["metadata"]["uid"])
        assert host["metadata"]["labels"][hostpod.TENANT] == TENANT
        spec = host["spec"]
        assert spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == "default"
        assert not spec.get("nodeName") and not spec.get("nodeSelector")
        assert [v["name"] for v in spec["volumes"]] == ["settings"]  # the tenant's token volume is not there
        [container] = spec["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpumem"] == "512"
        copy_name = hostpod.host_name("default", "settings")
        assert spec["volumes"][0]["configMap"]["name"] == copy_name
        copied = await eventually(lambda: sides.host_get("configmap", copy_name), timeout=30, what="the copy")
        assert copied["data"] == {"batch": "64"}
        assert [o["uid"] for o in copied["metadata"]["ownerReferences"]] == [host["metadata"]["uid"]]
        secret = await eventually(lambda: sides.host_get("secret", hostpod.host_name("default", "token")),
                                  timeout=30, what="the secret's copy")
        assert container["env"][0]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]

        # the policy gave it the node's toleration; the tenant's scheduler bound it there; and the
        # host's scheduler's verdict is in its status
        async def told():
            got = await sides.tenant_json("get", "pod", "train")
            return got if any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                              for c in got["status"].get("conditions") or []) else None
        got = await eventually(told, timeout=60, what="the host's status on the tenant's pod")
        assert {"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"} in got["spec"]["tolerations"]
        assert got["spec"]["nodeName"] == NODE and got["status"]["phase"] == "Pending"

        async def relayed():
            events = (await sides.tenant_json("get", "events", "-n", "default",
                                              "--field-selector", "involvedObject.name=train"))["items"]
            return [e for e in events if e["reason"] == "FailedScheduling"
                    and e["source"].get("component") == "tessera-tenant-pods"]
        [event] = await eventually(relayed, timeout=60, what="the host's FailedScheduling event, told to the tenant")
        host_events = json.loads((await asyncio.to_thread(
            kube_plane.kubectl, "get", "events", "-n", plane_namespace, "-o", "json",
            "--field-selector", f"involvedObject.name={host['metadata']['name']}")).stdout)["items"]
        assert event["message"] in {e["message"] for e in host_events if e["reason"] == "FailedScheduling"}

        # deleted in the tenant's cluster: the host pod goes, then the tenant's pod is gone too
        await asyncio.to_thread(tenant_cluster.kubectl, "delete", "pod", "train", "--timeout=60s")
        assert not await sides.host_pods()
        async def copies_gone():
            return all([await sides.host_get(kind, hostpod.host_name("default", name)) is None
                        for kind, name in (("configmap", "settings"), ("secret", "token"))])
        await eventually(copies_gone, timeout=60, what="the copies going with their pod (the host's garbage collector)")


async def test_a_restarted_syncer_loses_and_doubles_nothing(tenant_cluster, kube_plane, plane_namespace):
    await asyncio.to_thread(tenant_cluster.wait_for_service_account, "default", "default")
    identity = await asyncio.to_thread(host_identity, kube_plane, plane_namespace)
    sides = Sides(tenant_cluster, kube_plane, plane_namespace)
    names = ("kept", "gone", "late", "plain")
    try:
        async with syncing(tenant_cluster.admin_kubeconfig, identity, TENANT, plane_namespace, QUOTA):
            for name in ("kept", "gone"):
                await sides.create(gpu_pod(name))
            before = {name: await sides.hosted(name) for name in ("kept", "gone")}
        # the syncer is away: one pod deleted (bound to the node, so it waits, as for a kubelet),
        # one GPU pod and one that tolerates the node made
        await asyncio.to_thread(tenant_cluster.kubectl, "delete", "pod", "gone", "--wait=false")
        await sides.create(gpu_pod("late"))
        await sides.create(plain_pod("plain"))
        async with syncing(tenant_cluster.admin_kubeconfig, identity, TENANT, plane_namespace, QUOTA):
            want = {hostpod.host_name("default", n) for n in ("kept", "late", "plain")}

            async def converged():
                return set(await sides.host_pods()) == want and await sides.tenant_json(
                    "get", "pod", "gone", check=False) is None
            await eventually(converged, timeout=60, what="the host agreeing with the tenant again")
            after = await sides.host_pods()
            kept = after[hostpod.host_name("default", "kept")]
            assert kept["metadata"]["uid"] == before["kept"]["metadata"]["uid"]  # not made again
            plain = await sides.tenant_json("get", "pod", "plain")
            assert plain["spec"]["nodeName"] == NODE  # the tenant's scheduler put it there
    finally:
        for name in names:
            await asyncio.to_thread(tenant_cluster.kubectl, "delete", "pod", name, "--grace-period=0", "--force",
                                    "--ignore-not-found", check=False)


async def test_clearing_a_tenant_removes_its_node_policy_and_mirrored_objects(tenant_cluster, kube_plane,
                                                                               plane_namespace):
    await asyncio.to_thread(tenant_cluster.wait_for_service_account, "default", "default")
    await asyncio.to_thread(tenant_cluster.kubectl, "apply", "-f", "-", stdin=READS)
    identity = await asyncio.to_thread(host_identity, kube_plane, plane_namespace)
    sides = Sides(tenant_cluster, kube_plane, plane_namespace)
    try:
        async with syncing(tenant_cluster.admin_kubeconfig, identity, TENANT, plane_namespace, QUOTA) as sync:
            await sides.create(gpu_pod("doomed", reads=True))
            await sides.hosted("doomed")
            await eventually(lambda: sides.host_get("configmap", hostpod.host_name("default", "settings")),
                             timeout=30, what="the copy")
        try:
            await sync.clear()  # the tenant's teardown, with the syncer stopped first
        finally:
            await sync.tenant_api.close()
            await sync.host_api.close()

        async def cleared():
            left = {kind: json.loads((await asyncio.to_thread(
                kube_plane.kubectl, "get", kind, "-n", plane_namespace, "-l", f"{hostpod.TENANT}={TENANT}",
                "-o", "json")).stdout)["items"] for kind in ("pods", "configmaps", "secrets")}
            return not any(left.values())
        await eventually(cleared, timeout=30, what="no mirrored object left in the host namespace")
        assert await sides.tenant_json("get", "node", NODE, check=False) is None
        assert await sides.tenant_json("get", "lease", "-n", "kube-node-lease", NODE, check=False) is None
        assert await sides.tenant_json("get", "mutatingadmissionpolicy", toleration.NAME, check=False) is None
        assert await sides.tenant_json("get", "deviceclass", DEVICE_CLASS, check=False) is None
    finally:
        await asyncio.to_thread(tenant_cluster.kubectl, "delete", "pod", "doomed", "--grace-period=0", "--force",
                                "--ignore-not-found", check=False)


async def test_a_gpu_pod_admitted_before_the_policy_is_sent_to_the_node(tenant_cluster, kube_plane,
                                                                        plane_namespace):
    await asyncio.to_thread(tenant_cluster.wait_for_service_account, "default", "default")
    identity = await asyncio.to_thread(host_identity, kube_plane, plane_namespace)
    sides = Sides(tenant_cluster, kube_plane, plane_namespace)
    for kind in ("mutatingadmissionpolicybinding", "mutatingadmissionpolicy"):  # as before any syncer ran
        await asyncio.to_thread(tenant_cluster.kubectl, "delete", kind, toleration.NAME, "--ignore-not-found")

    async def untolerated():  # (the API server applies a policy's removal a moment after it is stored)
        made = await sides.create(gpu_pod("early"))
        if any(t["key"] == TAINT_KEY for t in made["spec"].get("tolerations") or []):
            await asyncio.to_thread(tenant_cluster.kubectl, "delete", "pod", "early", "--grace-period=0", "--force")
            return None
        return made
    try:
        await eventually(untolerated, timeout=30, every=0.5, what="a GPU pod admitted without the policy")
        async with syncing(tenant_cluster.admin_kubeconfig, identity, TENANT, plane_namespace, QUOTA):
            await sides.hosted("early")
            got = await sides.tenant_json("get", "pod", "early")
            assert got["spec"]["nodeName"] == NODE, got["spec"]
    finally:
        await asyncio.to_thread(tenant_cluster.kubectl, "delete", "pod", "early", "--grace-period=0", "--force",
                                "--ignore-not-found", check=False)


async def test_the_tenant_sees_tesseras_device_class_and_keeps_it(tenant_cluster, kube_plane, plane_namespace):
    """`kubectl get deviceclass gpu.tessera.dev` in the tenant's cluster: the host's selectors; deleted
    or changed by the tenant, it comes back as it was."""
    identity = await asyncio.to_thread(host_identity, kube_plane, plane_namespace)
    sides = Sides(tenant_cluster, kube_plane, plane_namespace)
    [host_class] = manifests("deviceclass.yaml", ("DeviceClass",))

    async def as_the_host():
        got = await sides.tenant_json("get", "deviceclass", DEVICE_CLASS, check=False)
        return got if got is not None and got["spec"] == host_class["spec"] else None
    async with syncing(tenant_cluster.admin_kubeconfig, identity, TENANT, plane_namespace, QUOTA):
        first = await as_the_host()
        assert first is not None, await sides.tenant_json("get", "deviceclass", check=False)
        await asyncio.to_thread(tenant_cluster.kubectl, "delete", "deviceclass", DEVICE_CLASS)
        back = await eventually(as_the_host, timeout=30, what="the class put back after its deletion")
        assert back["metadata"]["uid"] != first["metadata"]["uid"]
        await asyncio.to_thread(tenant_cluster.kubectl, "patch", "deviceclass", DEVICE_CLASS, "--type=merge", "-p",
                                json.dumps({"spec": {"selectors": [{"cel": {"expression": "true"}}]}}))
        await eventually(as_the_host, timeout=30, what="the class's selectors put back after a change")
