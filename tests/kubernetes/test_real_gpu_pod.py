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
come only from the claim's CDI spec.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import pytest

from tessera.shared.events import GpuQuota
from tessera.shared.kubeclaims import DRIVER, TENANT_LABEL, claim_id

from tessera.cli.client import Client

from kit import eventually
from gpupods import hami_pod
from kubetessera import KubeletDirs, create_tenant, ledgers, log_has, node_profile, quota_in_use, tessera_on_node
from webhook_tls import SERVING_NAMES, Authority

RC = "resource.k8s.io/v1"
MEMORY_MIB, CORES = 1024, 30
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
TENANT = "alpha"


def _checkpoint(dirs: KubeletDirs) -> dict:
    """The claims in the enforcer's kubelet-plugin checkpoint (ResourceClaim uid -> entry)."""
    return json.loads((dirs.plugin / "checkpoint.json").read_text())["body"]["claims"]


@pytest.fixture
def webhook_tls(tmp_path):
    ca = Authority()
    cert, key = ca.issue(tmp_path / "webhook-tls", list(SERVING_NAMES))
    return ca, cert, key


async def test_a_gpu_pod_runs_on_the_real_node_enforced_and_given_back(
        kube_cluster, kube_node, kube_namespace, nats_url, tmp_path, webhook_tls):
    async def kubectl(*args: str, **kw):
        return await asyncio.to_thread(kube_cluster.kubectl, *args, **kw)

    profile = node_profile(tmp_path / "fleet.yaml", kube_node.name)
    # (the services and the webhook go when the stack closes: the session's control plane outlives
    # this test, and no webhook, Fail for GPU pods, is left pointing at a translator that is gone)
    stack = contextlib.AsyncExitStack()
    tessera = await stack.enter_async_context(
        tessera_on_node(kube_cluster, kube_node, nats_url, tmp_path / "tessera", profile, webhook_tls))
    client = None
    try:
        cluster, dirs, image = tessera.cluster, tessera.dirs, tessera.image
        enforcer_log = cluster.find(f"enforcer-{kube_node.name}").log_path
        client = await Client.connect(nats_url)
        await create_tenant(client, TENANT, GpuQuota(gpus=2))
        await kubectl("label", "namespace", kube_namespace, f"{TENANT_LABEL}={TENANT}")

        pod = hami_pod("train", kube_namespace, image, MEMORY_MIB, CORES)
        created = time.monotonic()
        await kubectl("create", "-f", "-", stdin=json.dumps(pod))
        waited = await kubectl("wait", "-n", kube_namespace, "pod/train", "--for=condition=Ready",
                               "--timeout=120s", check=False)
        running_after = time.monotonic() - created
        got = json.loads((await kubectl("get", "-n", kube_namespace, "pod/train", "-o", "json")).stdout)
        assert waited.returncode == 0, (
            f"pod not Ready: {got['status']}\n"
            f"{(await kubectl('describe', '-n', kube_namespace, 'pod/train')).stdout[-3000:]}\n"
            f"kubelet:\n{kube_node.log('kubelet')[-4000:]}\nenforcer:\n{enforcer_log.read_text()[-3000:]}")
        assert got["spec"]["nodeName"] == kube_node.name
        # what the webhook made of it: a claim template, no nvidia.com/* left, the gate lifted
        [entry] = got["spec"]["resourceClaims"]
        assert entry["resourceClaimTemplateName"].startswith("tessera-")
        assert not [k for k in got["spec"]["containers"][0]["resources"].get("limits", {}) if k.startswith("nvidia")]
        assert not got["spec"].get("schedulingGates")

        [status] = got["status"]["resourceClaimStatuses"]
        claim = json.loads((await kubectl("get", "-n", kube_namespace, "resourceclaim", status["resourceClaimName"],
                                          "-o", "json")).stdout)
        cid = claim_id(claim["metadata"]["uid"])
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert result["driver"] == DRIVER and result["pool"] == kube_node.name, result
        assert [r["uid"] for r in claim["status"]["reservedFor"]] == [got["metadata"]["uid"]]
        # the kubelet asked the enforcer (NodePrepareResources) and handed its CDI id to containerd
        assert list(kube_node.cdi_dir.iterdir()), "no CDI spec for the prepared claim"
        ref = f"{kube_namespace}/{claim['metadata']['name']}"
        assert log_has(enforcer_log, f"prepared ResourceClaim {ref} ({cid}) for the kubelet"), enforcer_log.read_text()
        assert claim["metadata"]["uid"] in _checkpoint(dirs)

        # the container's probe: the claim's memory and not a byte more, read through kubectl logs
        async def probed():
            logs = await kubectl("logs", "-n", kube_namespace, "train", check=False)
            lines = [line for line in logs.stdout.splitlines() if line.startswith("{")]
            return json.loads(lines[-1]) if lines else None

        reply = await eventually(probed, timeout=30, what="the probe's line in kubectl logs")
        assert (reply["allocated_mib"], reply["stopped_by"], reply["one_more_byte"]) == (
            MEMORY_MIB, OUT_OF_MEMORY, OUT_OF_MEMORY), reply
        in_use = await ledgers(client)
        assert [e for lg in in_use.values() for e in lg.entries], in_use

        # the kubelet shows the device's health, from the plugin's dra-health stream, in the pod's status
        async def health():
            got = json.loads((await kubectl("get", "-n", kube_namespace, "pod/train", "-o", "json")).stdout)
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
        assert not list(kube_node.cdi_dir.iterdir()), "the CDI spec outlived the pod"
        assert claim["metadata"]["uid"] not in _checkpoint(dirs)

        async def given_back():
            return all(not lg.entries for lg in (await ledgers(client)).values()) \
                and not (await quota_in_use(client, TENANT)).claims

        assert await eventually(given_back, timeout=30), (await ledgers(client), await quota_in_use(client, TENANT))
        released_after = time.monotonic() - deleted
        assert not (cluster.state_dir(kube_node.name) / "claims" / cid).exists()
        gone = await kubectl("get", "-n", kube_namespace, "resourceclaim", claim["metadata"]["name"], check=False)
        assert gone.returncode != 0, gone.stdout
        # an ordinary end: the resourceclaim controller deallocates a claim whose pods are done, and
        # that is no news to warn anyone about (no Warning on the pod, none on its claim)
        assert released.reason == "resourceclaim-unused", released
        events = json.loads((await kubectl("get", "events", "-n", kube_namespace, "-o", "json")).stdout)["items"]
        warnings = [(e["involvedObject"]["kind"], e["reason"], e["message"]) for e in events if e["type"] == "Warning"
                    and e["involvedObject"]["kind"] in ("Pod", "ResourceClaim")]
        assert not warnings, warnings
        print(f"GPU pod created -> Ready in {running_after:.1f} s; probe {reply}; "
              f"deleted -> released in {released_after:.1f} s")
    finally:
        if client is not None:
            await client.close()
        await stack.aclose()
