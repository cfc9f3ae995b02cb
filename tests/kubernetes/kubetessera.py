"""The real Tessera services as processes, in Kubernetes mode, against the API-server emulator (or
a real control plane: ``kubeconfigs`` gives each service its own identity, ``kubelets`` a real
node's directories).

They reach the emulator as they would reach a cluster, through a kubeconfig (``KUBECONFIG``), and a
real nats-server; the emulator runs in the test's event loop, so a test awaits while they work.
Each service is its console script (`tessera.cli.cluster.LocalCluster.spawn`), one enforcer per
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

from kubeparts import add_node
from webhook_server import CertificateAuthority

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
WEBHOOK = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "webhook.yaml"
SERVICE = ("tessera-system", "tessera-translator-webhook", 443)  # the webhook's clientConfig.service


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emulator\n"
        f"clusters:\n- name: emulator\n  cluster: {{server: '{server}'}}\n"
        "users:\n- name: emulator\n  user: {token: test}\n"
        "contexts:\n- name: emulator\n  context: {cluster: emulator, user: emulator}\n")
    return path


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


async def start_services(workdir: Path, nats_url: str, apiserver_url: str | None, *,
                         profile: str | Path = "tiny.yaml",
                         services: tuple[str, ...] = ("controlplane", "capacity", "placement"),
                         placement_replicas: int = 1, env: dict[str, str] | None = None,
                         kubeconfigs: Mapping[str, Path] | None = None,
                         kubelets: Mapping[str, KubeletDirs] | None = None) -> KubeCluster:
    """``services`` (and an enforcer per node, its node's kubelet plugin) in Kubernetes mode; ready
    when this returns. ``kubeconfigs`` (service name -> kubeconfig, ``enforcer`` included): each
    service acts as its own identity, instead of all as the emulator's one user of
    ``apiserver_url``; ``kubelets``: the directories of a node's real kubelet and runtime
    (a profile path that is absolute is used as it is)."""
    workdir.mkdir(parents=True, exist_ok=True)
    # Nodes without a real kubelet have no plugin registered: their slices are written regardless.
    extra = {"TESSERA_KUBERNETES": "true", "TESSERA_HEARTBEAT_SECONDS": "1",
             "TESSERA_SLICES_NEED_PLUGIN": "true" if kubelets else "false", **(env or {})}
    if kubeconfigs is None:
        assert apiserver_url, "the emulator's URL, or a kubeconfig per service"
        extra["KUBECONFIG"] = str(write_kubeconfig(workdir / "kubeconfig", apiserver_url))
    identity = {name: {"KUBECONFIG": str(path)} for name, path in (kubeconfigs or {}).items()}
    cluster = KubeCluster(workdir=workdir, profile=PROFILES / profile, nats_url=nats_url, extra_env=extra,
                          kubelets=dict(kubelets or {}))
    for name in services:
        replicas = placement_replicas if name == "placement" else 1
        for i in range(replicas):
            cluster.spawn(name, instance=f"{name}-{i}" if replicas > 1 else name, env=identity.get(name))
    for node_name in cluster.nodes():
        cluster.spawn("enforcer", instance=f"enforcer-{node_name}",
                      env={"TESSERA_NODE": node_name, **cluster.kubelet(node_name).env(),
                           **identity.get("enforcer", {})})
    try:
        await asyncio.to_thread(cluster.wait_ready, 90)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def webhook_configuration(ca: CertificateAuthority) -> dict:
    """deploy/k8s's MutatingWebhookConfiguration with the caBundle cert-manager would inject."""
    [config] = [d for d in yaml.safe_load_all(WEBHOOK.read_text()) if d and d["kind"] == "MutatingWebhookConfiguration"]
    for hook in config["webhooks"]:
        hook["clientConfig"]["caBundle"] = ca.bundle
    return config


@contextlib.asynccontextmanager
async def whole_tessera(apiserver, nats_url: str, workdir: Path):
    """All of Tessera in Kubernetes mode on nodes gpu-0 and gpu-1 (tiny.yaml), its webhook installed
    as deploy/k8s configures it and reached over TLS verified against the caBundle; yields the
    services (`KubeCluster`) and a client on the bus."""
    ca = CertificateAuthority()
    cert, key = ca.issue(workdir / "webhook-tls", [f"{SERVICE[1]}.{SERVICE[0]}.svc"])
    port = free_port()
    for name in ("gpu-0", "gpu-1"):
        await add_node(apiserver, name)
    cluster = await start_services(
        workdir / "tessera", nats_url, apiserver.url,
        services=("controlplane", "capacity", "translator", "placement"),
        env={"TESSERA_WEBHOOK_PORT": str(port), "TESSERA_WEBHOOK_HOST": "127.0.0.1",
             "TESSERA_WEBHOOK_CERT": str(cert), "TESSERA_WEBHOOK_KEY": str(key)})
    client = None
    try:
        apiserver.route_service(*SERVICE, f"https://127.0.0.1:{port}")
        await apiserver.create(webhook_configuration(ca))
        client = await Client.connect(nats_url)
        yield cluster, client
    finally:
        if client is not None:
            await client.close()
        await asyncio.to_thread(cluster.stop)


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
