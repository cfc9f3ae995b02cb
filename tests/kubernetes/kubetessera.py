"""The real Tessera services as processes, in Kubernetes mode, on a real control plane
(tests/kit/kubecluster.py): ``kubeconfigs`` gives each service its own identity, ``kubelets`` a real
node's directories.

They reach the API server as they would in a cluster, through a kubeconfig (``KUBECONFIG``), and a
real nats-server. Each service is its console script (`tessera.cli.cluster.LocalCluster.spawn`), one enforcer per
node of the profile (simulated hardware: it releases what it is told to, as on any node). In
Kubernetes mode each enforcer is also its node's kubelet plugin: every node gets kubelet directories
of its own (plugin registry, plugin directory, CDI directory) under one short root in /tmp (unix
socket paths are limited to 107 bytes), never the machine's /var/lib/kubelet and /var/run/cdi, and
never shared with another node's enforcer; the root is removed when the services stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import yaml

from tessera.shared import api, subjects
from tessera.shared.claimstore import ClaimStore
from tessera.shared.events import ClaimRecord, ClaimRequested, ClaimSpec, GpuQuota, NodeLedger, TenantUsage
from tessera.shared.kubeclaims import DRIVER, KubeClaimRef, claim_id
from tessera.shared.ledger import Ledger

from tessera.shared.natsserver import free_port

from tessera.cli.client import Client
from tessera.cli.cluster import LocalCluster

import probeimage
from kit import eventually
from kit.kubecluster import KubeControlPlane, apply, manifests, service_identity
from kit.kubenode import KubeNode
from webhook_server import CertificateAuthority

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
WEBHOOK = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "webhook.yaml"


@dataclass(frozen=True)
class KubeletDirs:
    """What one node's kubelet and container runtime share with its enforcer."""

    registry: Path  # the plugin watcher's registry (the registration socket)
    plugin: Path  # the plugin's own directory (the DRA socket)
    cdi: Path  # where the container runtime reads CDI specs

    @classmethod
    def of(cls, root: Path, node: str) -> "KubeletDirs":
        return cls(registry=root / node / "plugins_registry", plugin=root / node / "plugins" / DRIVER,
                   cdi=root / node / "cdi")

    def env(self) -> dict[str, str]:
        return {"TESSERA_KUBELET_REGISTRY_DIR": str(self.registry), "TESSERA_KUBELET_PLUGIN_DIR": str(self.plugin),
                "TESSERA_CDI_DIR": str(self.cdi)}


@dataclass
class KubeCluster(LocalCluster):
    """The services of one test, with the kubelet directories of each node."""

    kubelet_root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp")))
    kubelets: Mapping[str, KubeletDirs] = field(default_factory=dict)  # real nodes' own directories

    def kubelet(self, node: str) -> KubeletDirs:
        return self.kubelets.get(node) or KubeletDirs.of(self.kubelet_root, node)

    def state_dir(self, node: str) -> Path:
        """The enforcer's state directory on ``node`` (claim directories under ``claims/``)."""
        return self.workdir / "state" / f"enforcer-{node}"

    def stop(self, *, timeout: float = 10.0) -> dict[str, int]:
        try:
            return super().stop(timeout=timeout)
        finally:
            shutil.rmtree(self.kubelet_root, ignore_errors=True)


async def start_services(workdir: Path, nats_url: str, *, kubeconfigs: Mapping[str, Path],
                         profile: str | Path = "tiny.yaml",
                         services: tuple[str, ...] = ("controlplane", "capacity", "placement"),
                         placement_replicas: int = 1, env: dict[str, str] | None = None,
                         kubelets: Mapping[str, KubeletDirs] | None = None, enforcers: bool = True,
                         enforcer_env: Mapping[str, str] | None = None) -> KubeCluster:
    """``services`` (and an enforcer per node, its node's kubelet plugin) in Kubernetes mode; ready
    when this returns. ``kubeconfigs`` (service name -> kubeconfig, ``enforcer`` included): each
    service acts as its own identity; ``kubelets``: the directories of a node's real kubelet and
    runtime (a profile path that is absolute is used as it is); ``enforcers=False``: none (simulated
    nodes that no kubelet serves, as in tests/kubernetes/benchfleet.py); ``enforcer_env``: more of
    each enforcer's environment (its pod's uid, ``TESSERA_POD_UID``, as the DaemonSet gives it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    # Nodes without a real kubelet have no plugin registered: their slices are written regardless.
    extra = {"TESSERA_KUBERNETES": "true", "TESSERA_HEARTBEAT_SECONDS": "1",
             "TESSERA_SLICES_NEED_PLUGIN": "true" if kubelets else "false", **(env or {})}
    identity = {name: {"KUBECONFIG": str(path)} for name, path in kubeconfigs.items()}
    cluster = KubeCluster(workdir=workdir, profile=PROFILES / profile, nats_url=nats_url, extra_env=extra,
                          kubelets=dict(kubelets or {}))
    for name in services:
        replicas = placement_replicas if name == "placement" else 1
        for i in range(replicas):
            cluster.spawn(name, instance=f"{name}-{i}" if replicas > 1 else name, env=identity.get(name))
    for node_name in cluster.nodes() if enforcers else ():
        cluster.spawn("enforcer", instance=f"enforcer-{node_name}",
                      env={"TESSERA_NODE": node_name, **cluster.kubelet(node_name).env(),
                           **identity.get("enforcer", {}), **(enforcer_env or {})})
    try:
        await asyncio.to_thread(cluster.wait_ready, 90)
    except BaseException:
        cluster.stop()
        raise
    return cluster


# Each service's identity on a real control plane: the ServiceAccount of its deploy/k8s manifest.
IDENTITIES = {"capacity": "capacity.yaml", "placement": "placement.yaml", "translator": "translator.yaml",
              "enforcer": "enforcer.yaml", "controlplane": "controlplane/manager.yaml"}


def webhook_endpoints(ip: str, port: int) -> list[dict]:
    """deploy/k8s's webhook Service without its selector (no translator pod), and its endpoints: the
    translator's address on the node (the real API server refuses loopback endpoints)."""
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


GPU = {"model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "sm_count": 132, "architecture": "Hopper",
       "compute_capability": "9.0", "driver_version": "580.65.06"}
SERVICES = ("controlplane", "capacity", "translator", "placement")


def node_profile(path: Path, node_name: str, gpus: int = 2, max_shares: int = 10) -> Path:
    """The fleet of a real node: that node, with ``gpus`` simulated H100s."""
    path.write_text(yaml.safe_dump({"nodes": [{"name": node_name,
                                               "gpus": [{**GPU, "max_shares": max_shares}] * gpus}]}))
    return path


def log_has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


@dataclass(frozen=True)
class OnNode:
    """Tessera running on a real node (`tessera_on_node`)."""

    cluster: KubeCluster
    dirs: KubeletDirs  # the enforcer's, which are the node's kubelet's and containerd's
    image: str  # the probe image (probeimage.py), imported into the node's containerd


@contextlib.asynccontextmanager
async def tessera_on_node(plane: KubeControlPlane, kube_node: KubeNode, nats_url: str, workdir: Path,
                          profile: Path, tls: tuple[CertificateAuthority, Path, Path]):
    """Tessera's services in Kubernetes mode on a real control plane and node, as deployed: each acts
    as the ServiceAccount of its deploy/k8s manifest with that file's RBAC (``service_identity``),
    the enforcer is the node's DRA plugin (its kubelet's plugin registry, plugin and CDI
    directories; ready once the kubelet registered it), and the translator's webhook is installed as
    deploy/k8s/webhook.yaml configures it, reached at the node's address (``webhook_endpoints``)
    with TLS verified against ``tls``'s CA. On the way out the webhook (Fail for GPU pods) goes
    before the translator does, so that the control plane can outlive this."""
    ca, cert, key = tls
    apply(plane, manifests("namespace.yaml") + manifests("deviceclass.yaml") + manifests("admission-policies.yaml"))
    identities = {name: service_identity(plane, manifest) for name, manifest in IDENTITIES.items()}
    image, archive = probeimage.build()
    kube_node.ctr("images", "import", "--platform", "linux/amd64", str(archive))
    port = free_port()
    dirs = KubeletDirs(registry=kube_node.plugins_registry, plugin=kube_node.plugins_dir / DRIVER,
                       cdi=kube_node.cdi_dir)
    cluster = await start_services(
        workdir, nats_url, profile=profile, services=SERVICES, kubeconfigs=identities,
        kubelets={kube_node.name: dirs},
        env={"TESSERA_WEBHOOK_PORT": str(port), "TESSERA_WEBHOOK_HOST": kube_node.ip,
             "TESSERA_WEBHOOK_CERT": str(cert), "TESSERA_WEBHOOK_KEY": str(key)})
    webhook = webhook_configuration(ca)
    endpoints = webhook_endpoints(kube_node.ip, port)
    try:
        enforcer_log = cluster.find(f"enforcer-{kube_node.name}").log_path
        # the real kubelet's plugin watcher found the registration socket, asked GetInfo, said yes
        await eventually(lambda: log_has(enforcer_log, f"the kubelet registered DRA plugin {DRIVER}"), timeout=60,
                         what=f"the kubelet registering {DRIVER}")
        apply(plane, endpoints + [webhook])
        yield OnNode(cluster, dirs, image)
    finally:
        await asyncio.to_thread(plane.kubectl, "delete", "mutatingwebhookconfiguration", webhook["metadata"]["name"],
                                "--ignore-not-found", check=False)
        service, slice_ = endpoints
        for kind, doc in (("endpointslices.discovery.k8s.io", slice_), ("services", service)):
            await asyncio.to_thread(plane.kubectl, "delete", "-n", doc["metadata"]["namespace"], kind,
                                    doc["metadata"]["name"], "--ignore-not-found", check=False)
        await asyncio.to_thread(cluster.stop)


def webhook_configuration(ca: CertificateAuthority) -> dict:
    """deploy/k8s's MutatingWebhookConfiguration with the caBundle cert-manager would inject."""
    [config] = [d for d in yaml.safe_load_all(WEBHOOK.read_text()) if d and d["kind"] == "MutatingWebhookConfiguration"]
    for hook in config["webhooks"]:
        hook["clientConfig"]["caBundle"] = ca.bundle
    return config


async def create_tenant(client: Client, name: str, quota: GpuQuota) -> None:
    await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name=name, quota=quota), timeout=30)


def kube_ref(claim: dict, pod: dict) -> KubeClaimRef:
    meta = claim["metadata"]
    return KubeClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"],
                        pod=pod["metadata"]["name"], pod_uid=pod["metadata"]["uid"])


async def request_claim(client: Client, tenant: str, claim: dict, pod: dict, spec: ClaimSpec) -> str:
    """What the translator's claim watcher does for a new ResourceClaim: record it and publish
    ``requested`` carrying the ResourceClaim (for tests that exercise placement without it)."""
    ref = kube_ref(claim, pod)
    cid = claim_id(ref.uid)
    store = ClaimStore(await client.bus.kv(subjects.KV_CLAIMS))
    revision = await store.create(ClaimRecord(claim=cid, tenant=tenant, state="requested", spec=spec, kube=ref))
    await client.bus.publish(subjects.claim(tenant, cid, "requested"),
                             ClaimRequested(claim=cid, tenant=tenant, spec=spec, source="kubernetes",
                                            record_revision=revision or 0, kube=ref),
                             msg_id=f"{cid}:requested")
    return cid


async def ledgers(client: Client) -> dict[str, NodeLedger]:
    return await Ledger(await client.bus.kv(subjects.KV_LEDGER)).all_nodes()


async def quota_in_use(client: Client, tenant: str) -> TenantUsage:
    usage, _ = await Ledger(await client.bus.kv(subjects.KV_LEDGER)).read_tenant(tenant)
    return usage
