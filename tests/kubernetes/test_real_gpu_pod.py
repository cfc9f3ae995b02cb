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
import json
import time
from pathlib import Path

import pytest
import yaml

from tessera.shared.events import GpuQuota
from tessera.shared.kubeclaims import DRIVER, TENANT_LABEL, claim_id
from tessera.shared.natsserver import free_port

from tessera.cli.client import Client

import probeimage
from kit import eventually
from kit.kubecluster import apply, manifests, service_identity
from kubetessera import KubeletDirs, create_tenant, ledgers, quota_in_use, start_services, webhook_configuration
from webhook_tls import SERVING_NAMES, Authority

RC = "resource.k8s.io/v1"
MEMORY_MIB, CORES = 1024, 30
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
TENANT = "alpha"
IDENTITIES = {"capacity": "capacity.yaml", "placement": "placement.yaml", "translator": "translator.yaml",
              "enforcer": "enforcer.yaml", "controlplane": "controlplane/manager.yaml"}
SERVICES = ("controlplane", "capacity", "translator", "placement")
GPU = {"model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "sm_count": 132, "architecture": "Hopper",
       "compute_capability": "9.0", "driver_version": "580.65.06"}


def _profile(path: Path, node: str) -> Path:
    """The fleet: the real node, with two simulated GPUs."""
    path.write_text(yaml.safe_dump({"nodes": [{"name": node, "gpus": [GPU, GPU]}]}))
    return path


def _webhook_service(ip: str, port: int) -> list[dict]:
    """deploy/k8s's webhook Service without its selector (no translator pod), and its endpoints: the
    translator's address on the node."""
    [service] = [d for d in manifests("translator.yaml", ("Service",))]
    service["spec"].pop("selector", None)
    [https] = service["spec"]["ports"]
    meta = service["metadata"]
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{meta['name']}-test", "namespace": meta["namespace"],
                     "labels": {"kubernetes.io/service-name": meta["name"],
                                "endpointslice.kubernetes.io/managed-by": "tests.tessera.dev"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
        "ports": [{"name": https["name"], "port": port, "protocol": "TCP"}],
    }
    return [service, endpoints]


def _gpu_pod(name: str, namespace: str, image: str) -> dict:
    """A pod as a user writes it for HAMi: nvidia.com/gpu and gpumem limits, nothing of DRA. Its
    container runs the probe and holds what it got until its stdin closes (``stdin: true`` keeps
    it open), so the pod stays Running with its memory in use."""
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "dnsPolicy": "Default",  # the node has no cluster DNS (the kubelet would warn MissingClusterDNS)
            "containers": [{
                "name": "main", "image": image, "imagePullPolicy": "Never", "stdin": True,
                "command": [probeimage.PROBE, "64", "0", "hold"],
                "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(MEMORY_MIB),
                                         "nvidia.com/gpucores": str(CORES)}},
            }],
        },
    }


def _checkpoint(dirs: KubeletDirs) -> dict:
    """The claims in the enforcer's kubelet-plugin checkpoint (ResourceClaim uid -> entry)."""
    return json.loads((dirs.plugin / "checkpoint.json").read_text())["body"]["claims"]


def _log_has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


@pytest.fixture
def webhook_tls(tmp_path):
    ca = Authority()
    cert, key = ca.issue(tmp_path / "webhook-tls", list(SERVING_NAMES))
    return ca, cert, key


async def test_a_gpu_pod_runs_on_the_real_node_enforced_and_given_back(
        kube_cluster, kube_node, kube_namespace, nats_url, tmp_path, webhook_tls):
    async def kubectl(*args: str, **kw):
        return await asyncio.to_thread(kube_cluster.kubectl, *args, **kw)

    ca, cert, key = webhook_tls
    apply(kube_cluster, manifests("namespace.yaml") + manifests("deviceclass.yaml")
          + manifests("admission-policies.yaml"))
    identities = {name: service_identity(kube_cluster, manifest) for name, manifest in IDENTITIES.items()}
    image, archive = probeimage.build()
    kube_node.ctr("images", "import", "--platform", "linux/amd64", str(archive))

    port = free_port()
    dirs = KubeletDirs(registry=kube_node.plugins_registry, plugin=kube_node.plugins_dir / DRIVER,
                       cdi=kube_node.cdi_dir)
    cluster = await start_services(
        tmp_path / "tessera", nats_url, None, profile=_profile(tmp_path / "fleet.yaml", kube_node.name),
        services=SERVICES, kubeconfigs=identities, kubelets={kube_node.name: dirs},
        env={"TESSERA_WEBHOOK_PORT": str(port), "TESSERA_WEBHOOK_HOST": kube_node.ip,
             "TESSERA_WEBHOOK_CERT": str(cert), "TESSERA_WEBHOOK_KEY": str(key)})
    client = None
    webhook = webhook_configuration(ca)
    try:
        enforcer_log = cluster.find(f"enforcer-{kube_node.name}").log_path
        # the real kubelet's plugin watcher found the registration socket, asked GetInfo, said yes
        await eventually(lambda: _log_has(enforcer_log, f"the kubelet registered DRA plugin {DRIVER}"), timeout=60,
                         what=f"the kubelet registering {DRIVER}")
        apply(kube_cluster, _webhook_service(kube_node.ip, port) + [webhook])

        client = await Client.connect(nats_url)
        await create_tenant(client, TENANT, GpuQuota(gpus=2))
        await kubectl("label", "namespace", kube_namespace, f"{TENANT_LABEL}={TENANT}")

        pod = _gpu_pod("train", kube_namespace, image)
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
        assert _log_has(enforcer_log, f"prepared ResourceClaim {ref} ({cid}) for the kubelet"), enforcer_log.read_text()
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
        assert _log_has(enforcer_log, f"unprepared ResourceClaim {ref} ({cid})"), enforcer_log.read_text()
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
        # the session's control plane outlives this test: no webhook (Fail for GPU pods) is left
        # pointing at a translator that is gone
        await kubectl("delete", "mutatingwebhookconfiguration", webhook["metadata"]["name"], "--ignore-not-found",
                      check=False)
        service, endpoints = _webhook_service(kube_node.ip, port)
        for kind, doc in (("endpointslices.discovery.k8s.io", endpoints), ("services", service)):
            await kubectl("delete", "-n", doc["metadata"]["namespace"], kind, doc["metadata"]["name"],
                          "--ignore-not-found", check=False)
        if client is not None:
            await client.close()
        await asyncio.to_thread(cluster.stop)
