"""Tessera on the real control plane and the real node, as the GPU pod tests run it.

What `test_real_gpu_pod.py` describes, written once: the five services as processes in Kubernetes
mode on the tests' nats-server, each with its deploy/k8s identity; the enforcer as the real
kubelet's DRA plugin; the admission webhook reached by the real kube-apiserver through deploy/k8s's
MutatingWebhookConfiguration, its Service without a selector and an EndpointSlice with the
translator's address on the node; the probe image imported into containerd. `TesseraOnNode`
starts all of it and takes the cluster-wide objects away again (the session's control plane
outlives each test).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from tessera.cli.client import Client
from tessera.shared.events import GpuQuota
from tessera.shared.kubeclaims import DRIVER, TENANT_LABEL
from tessera.shared.natsserver import free_port

import probeimage
from kit import eventually
from kit.kubecluster import apply, manifests, node_bound_identity, service_identity
from kubetessera import (GPU, IDENTITIES, SERVICES, KubeletDirs, create_tenant, ledgers, log_has, quota_in_use,
                         start_services, webhook_configuration, webhook_endpoints)
from webhook_tls import SERVING_NAMES, Authority

OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


def profile(path: Path, node: str) -> Path:
    """The fleet: the real node, with two simulated GPUs."""
    path.write_text(yaml.safe_dump({"nodes": [{"name": node, "gpus": [GPU, GPU]}]}))
    return path


def checkpoint(dirs: KubeletDirs) -> dict:
    """The claims in the enforcer's kubelet-plugin checkpoint (ResourceClaim uid -> entry)."""
    return json.loads((dirs.plugin / "checkpoint.json").read_text())["body"]["claims"]


def probe_command(max_mib: int = 0) -> list[str]:
    """The probe allocating in 64 MiB steps until refused (or ``max_mib``), then holding what it got
    until its stdin closes (a container with ``stdin: true`` keeps it open)."""
    return [probeimage.PROBE, "64", str(max_mib), "hold"]


@dataclass
class TesseraOnNode:
    kube_cluster: object
    kube_node: object
    namespace: str
    nats_url: str
    workdir: Path

    async def kubectl(self, *args: str, **kw):
        return await asyncio.to_thread(self.kube_cluster.kubectl, *args, **kw)

    async def get(self, *what: str) -> dict:
        return json.loads((await self.kubectl("get", "-n", self.namespace, *what, "-o", "json")).stdout)

    @contextlib.asynccontextmanager
    async def running(self, tenant: str, quota: GpuQuota, enforcer_env: dict[str, str] | None = None,
                      slices: bool = False, env: dict[str, str] | None = None):
        """Start Tessera with a tenant of ``quota`` owning the namespace; yields self (with
        ``image``, ``client``, ``dirs``, ``cluster``, ``identities`` and ``enforcer_log`` set);
        ``enforcer_env``: more of the enforcer's environment; ``env``: more of every service's; ``slices``: the capacity publisher
        acts as its DaemonSet pod on the node (``node_bound_identity``), so that the
        tessera-node-slices policy lets it write the node's ResourceSlice."""
        plane, node = self.kube_cluster, self.kube_node
        ca = Authority()
        cert, key = ca.issue(self.workdir / "webhook-tls", list(SERVING_NAMES))
        apply(plane, manifests("namespace.yaml") + manifests("deviceclass.yaml") + manifests("admission-policies.yaml"))
        self.identities = identities = {name: service_identity(plane, manifest)
                                        for name, manifest in IDENTITIES.items()}
        if slices:
            identities["capacity"] = node_bound_identity(plane, IDENTITIES["capacity"], node.name)
        self.image, archive = probeimage.build()
        node.ctr("images", "import", "--platform", "linux/amd64", str(archive))
        port = free_port()
        self.dirs = KubeletDirs(registry=node.plugins_registry, plugin=node.plugins_dir / DRIVER, cdi=node.cdi_dir)
        self.cluster = await start_services(
            self.workdir / "tessera", self.nats_url, profile=profile(self.workdir / "fleet.yaml", node.name),
            services=SERVICES, kubeconfigs=identities, kubelets={node.name: self.dirs}, enforcer_env=enforcer_env,
            env={"TESSERA_WEBHOOK_PORT": str(port), "TESSERA_WEBHOOK_HOST": node.ip,
                 "TESSERA_WEBHOOK_CERT": str(cert), "TESSERA_WEBHOOK_KEY": str(key), **(env or {})})
        self.client = None
        webhook = webhook_configuration(ca)
        try:
            self.enforcer_log = self.cluster.find(f"enforcer-{node.name}").log_path
            # the real kubelet's plugin watcher found the registration socket, asked GetInfo, said yes
            await eventually(lambda: log_has(self.enforcer_log, f"the kubelet registered DRA plugin {DRIVER}"),
                             timeout=60, what=f"the kubelet registering {DRIVER}")
            apply(plane, webhook_endpoints(node.ip, port) + [webhook])
            self.client = await Client.connect(self.nats_url)
            await create_tenant(self.client, tenant, quota)
            await self.kubectl("label", "namespace", self.namespace, f"{TENANT_LABEL}={tenant}")
            yield self
        finally:
            # no webhook (Fail for GPU pods) is left pointing at a translator that is gone
            await self.kubectl("delete", "mutatingwebhookconfiguration", webhook["metadata"]["name"],
                               "--ignore-not-found", check=False)
            service, endpoints = webhook_endpoints(node.ip, port)
            for kind, doc in (("endpointslices.discovery.k8s.io", endpoints), ("services", service)):
                await self.kubectl("delete", "-n", doc["metadata"]["namespace"], kind, doc["metadata"]["name"],
                                   "--ignore-not-found", check=False)
            if self.client is not None:
                await self.client.close()
            await asyncio.to_thread(self.cluster.stop)

    async def ready(self, pod: str) -> dict:
        """Wait for the pod to be Ready and return it; a failure says what the pod, the kubelet and
        the enforcer said."""
        waited = await self.kubectl("wait", "-n", self.namespace, f"pod/{pod}", "--for=condition=Ready",
                                    "--timeout=120s", check=False)
        got = await self.get(f"pod/{pod}")
        assert waited.returncode == 0, (
            f"pod not Ready: {got['status']}\n"
            f"{(await self.kubectl('describe', '-n', self.namespace, f'pod/{pod}')).stdout[-3000:]}\n"
            f"kubelet:\n{self.kube_node.log('kubelet')[-4000:]}\nenforcer:\n{self.enforcer_log.read_text()[-3000:]}")
        return got

    async def probed(self, pod: str, container: str) -> dict:
        """The probe's report from a container's log (kubectl logs)."""
        async def line():
            logs = await self.kubectl("logs", "-n", self.namespace, pod, "-c", container, check=False)
            lines = [text for text in logs.stdout.splitlines() if text.startswith("{")]
            return json.loads(lines[-1]) if lines else None

        return await eventually(line, timeout=30, what=f"the probe's line in the log of {pod}/{container}")

    async def given_back(self, tenant: str) -> bool:
        """Whether every ledger is empty and the tenant holds no quota."""
        return all(not lg.entries for lg in (await ledgers(self.client)).values()) \
            and not (await quota_in_use(self.client, tenant)).claims
