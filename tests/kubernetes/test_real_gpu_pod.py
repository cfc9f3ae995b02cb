"""One GPU pod end to end on the real control plane and the real node: created with kubectl as a
user writes it for HAMi, it runs, its container stops at exactly its claim's memory, and deleting it
gives everything back.

Nothing here is played by the test. Tessera's five services run as processes in Kubernetes mode
(tests/kubernetes/kubetessera.py) on the tests' nats-server, each acting as the ServiceAccount of
its deploy/k8s manifest with that manifest's RBAC (``service_identity``): no service is an admin.
The control plane is tests/kit/kubecluster.py's (kube-apiserver, kube-controller-manager with the
resourceclaim controller, kube-scheduler), the node tests/kit/kubenode.py's (the kubelet and
containerd 2.x with CDI); the enforcer is pointed at that node's plugin registry, plugin directory
and CDI directory and is named after it (``TESSERA_NODE``), so the real kubelet finds Tessera's DRA
plugin through ``plugins_registry``, calls NodePrepareResources and hands the CDI ids to containerd,
which applies the spec the enforcer wrote.

The admission webhook, as the real kube-apiserver reaches it: deploy/k8s/webhook.yaml's
MutatingWebhookConfiguration (``clientConfig.service``, tessera-system/tessera-translator-webhook,
port 443) with the caBundle of the tests' CA, which cert-manager would inject. The translator runs
outside the cluster, so its Service has no selector and its endpoints are written here, as for any
backend outside a cluster: an EndpointSlice with the address the translator serves on, the node's
bridge gateway (a local, non-loopback address: the API server refuses loopback endpoints). No
kube-proxy runs, so the Service's ClusterIP leads nowhere; the API server runs with
``--enable-aggregator-routing=true`` (kubecluster.py), which makes it send webhook calls to a
service's endpoints instead of its ClusterIP. TLS is verified as in a cluster: the certificate
names ``tessera-translator-webhook.tessera-system.svc``, checked against the caBundle.

The pod's image is Debian's minimal system with the CUDA probe in it (probeimage.py), imported into
containerd's ``k8s.io`` namespace; the driver (the simulated one here), ``libvgpu.so`` and the limits
come only from the claim's CDI spec. (The set-up is `realpods.TesseraOnNode`, which the other real
pod tests share.)
"""

from __future__ import annotations

import json
import time

from tessera.shared.events import GpuQuota
from tessera.shared import quantity
from tessera.shared.kubeclaims import DRIVER, SCHEDULING_GATE, claim_id
from tessera.enforcer.cdi import spec_path
from tessera.placement.claimstatus import allocation, same_allocation

from gpupods import hami_pod
from kit import eventually
from kubetessera import ledgers, quota_in_use
from realpods import OUT_OF_MEMORY, TesseraOnNode, checkpoint, log_has

MEMORY_MIB, CORES = 1024, 30
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"  # (kube-scheduler's, and placement's)
TENANT = "alpha"


async def test_a_gpu_pod_runs_on_the_real_node_enforced_and_given_back(
        kube_cluster, kube_node, kube_namespace, nats_url, tmp_path):
    on = TesseraOnNode(kube_cluster, kube_node, kube_namespace, nats_url, tmp_path)
    kubectl = on.kubectl
    async with on.running(TENANT, GpuQuota(gpus=2)):
        client, dirs, enforcer_log = on.client, on.dirs, on.enforcer_log
        pod = hami_pod("train", kube_namespace, on.image, MEMORY_MIB, CORES)
        created = time.monotonic()
        admitted = json.loads((await kubectl("create", "-f", "-", "-o", "json", stdin=json.dumps(pod))).stdout)
        # as the API server stored it: the webhook's template in the pod's namespace, and Tessera's
        # gate, so kube-scheduler leaves the pod be until placement has allocated its claim
        assert [g["name"] for g in admitted["spec"]["schedulingGates"]] == [SCHEDULING_GATE], admitted["spec"]
        assert not admitted["spec"].get("nodeName")
        assert [(c["status"], c.get("reason")) for c in admitted["status"]["conditions"]
                if c["type"] == "PodScheduled"] == [("False", "SchedulingGated")], admitted["status"]
        [entry] = admitted["spec"]["resourceClaims"]
        assert await on.get("resourceclaimtemplate", entry["resourceClaimTemplateName"])
        got = await on.ready("train")
        running_after = time.monotonic() - created
        assert got["spec"]["nodeName"] == kube_node.name
        # what the webhook made of it: a claim template, no nvidia.com/* left, the gate lifted
        [entry] = got["spec"]["resourceClaims"]
        assert entry["resourceClaimTemplateName"].startswith("tessera-")
        assert not [k for k in got["spec"]["containers"][0]["resources"].get("limits", {}) if k.startswith("nvidia")]
        assert not got["spec"].get("schedulingGates")

        [status] = got["status"]["resourceClaimStatuses"]
        claim = await on.get("resourceclaim", status["resourceClaimName"])
        cid = claim_id(claim["metadata"]["uid"])
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert result["driver"] == DRIVER and result["pool"] == kube_node.name, result
        assert [r["uid"] for r in claim["status"]["reservedFor"]] == [got["metadata"]["uid"]]
        assert DELETE_PROTECTION in claim["metadata"]["finalizers"]  # it outlives its pod until unused
        # the claim's record, and the allocation placement wrote is what its ledger holds (the
        # server stores quantities canonically, 1024Mi as 1Gi: compared by value)
        record = await client.wait_for(cid, {"allocated", "prepared", "running"}, timeout=30)
        assert (record.kube.pod, record.tenant, record.node) == ("train", TENANT, kube_node.name), record
        held = (await ledgers(client))[record.node].entries[cid]
        assert same_allocation(claim["status"]["allocation"], allocation(cid, record.node, held.shares))
        assert quantity.parse(result["consumedCapacity"]["memory"]) == MEMORY_MIB << 20, result
        assert set((await quota_in_use(client, TENANT)).claims) == {cid}
        # the kubelet asked the enforcer (NodePrepareResources) and handed its CDI id to containerd
        assert list(kube_node.cdi_dir.iterdir()), "no CDI spec for the prepared claim"
        ref = f"{kube_namespace}/{claim['metadata']['name']}"
        assert log_has(enforcer_log, f"prepared ResourceClaim {ref} ({cid}) for the kubelet"), enforcer_log.read_text()
        assert claim["metadata"]["uid"] in checkpoint(dirs)
        # what the kubelet took from the plugin's answer (its DRA checkpoint): the allocation's
        # request, pool, device and share, and the CDI id it handed to containerd
        [device] = kube_node.prepared_claims()[claim["metadata"]["uid"]]["DriverState"][DRIVER]["Devices"]
        assert (device["RequestNames"], device["PoolName"], device["DeviceName"], device["ShareID"]) == (
            [result["request"]], result["pool"], result["device"], result["shareID"]), device
        assert device["CDIDeviceIDs"] == [f"{DRIVER}/gpu={cid}"], device

        # the container's probe: the claim's memory and not a byte more, read through kubectl logs
        reply = await on.probed("train", "main")
        assert (reply["allocated_mib"], reply["stopped_by"], reply["one_more_byte"]) == (
            MEMORY_MIB, OUT_OF_MEMORY, OUT_OF_MEMORY), reply
        in_use = await ledgers(client)
        assert [e for lg in in_use.values() for e in lg.entries], in_use

        # the kubelet shows the device's health, from the plugin's dra-health stream, in the pod's status
        async def health():
            got = await on.get("pod/train")
            statuses = [r for c in got["status"].get("containerStatuses") or []
                        for r in c.get("allocatedResourcesStatus") or []]
            return [h for r in statuses for h in r.get("resources") or []]
        reported = await eventually(health, timeout=60, what="the device's health in the pod's status")
        assert {h.get("health") for h in reported} == {"Healthy"}, reported

        # kubectl delete: the kubelet stops the container and unprepares; the claim goes with the pod
        deleted = time.monotonic()
        await kubectl("delete", "-n", kube_namespace, "pod/train", "--timeout=90s")
        released = await client.wait_for(cid, {"released"}, timeout=60)
        # the kubelet unprepares after the containers stop and before the pod's phase is final,
        # and only then does the resourceclaim controller deallocate: unprepared before released
        assert log_has(enforcer_log, f"unprepared ResourceClaim {ref} ({cid})"), enforcer_log.read_text()
        assert not spec_path(kube_node.cdi_dir, cid).exists(), "the CDI spec outlived the pod"
        assert claim["metadata"]["uid"] not in checkpoint(dirs)
        assert claim["metadata"]["uid"] not in kube_node.prepared_claims()
        # no CDI spec left that defines the claim's device: its id resolves nowhere
        assert not [p.name for p in kube_node.cdi_dir.iterdir() if cid in p.read_text()]

        assert await eventually(lambda: on.given_back(TENANT), timeout=30), (
            await ledgers(client), await quota_in_use(client, TENANT))
        released_after = time.monotonic() - deleted
        assert not (on.cluster.state_dir(kube_node.name) / "claims" / cid).exists()
        gone = await kubectl("get", "-n", kube_namespace, "resourceclaim", claim["metadata"]["name"], check=False)
        assert gone.returncode != 0, gone.stdout
        # an ordinary end: the resourceclaim controller deallocates a claim whose pods are done, and
        # that is no news to warn anyone about (no Warning on the pod, none on its claim)
        assert released.reason == "resourceclaim-unused", released
        events = (await on.get("events"))["items"]
        warnings = [(e["involvedObject"]["kind"], e["reason"], e["message"]) for e in events if e["type"] == "Warning"
                    and e["involvedObject"]["kind"] in ("Pod", "ResourceClaim")]
        assert not warnings, warnings
        print(f"GPU pod created -> Ready in {running_after:.1f} s; probe {reply}; "
              f"deleted -> released in {released_after:.1f} s")
