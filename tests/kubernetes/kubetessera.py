"""The real Tessera services as processes, in Kubernetes mode, against the API-server emulator.

They reach the emulator as they would reach a cluster, through a kubeconfig (``KUBECONFIG``), and a
real nats-server; the emulator runs in the test's event loop, so a test awaits while they work.
Each service is its console script (`tessera.cli.cluster.LocalCluster.spawn`), one enforcer per
node of the profile (simulated hardware: it releases what it is told to, as on any node).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tessera.shared import api, subjects
from tessera.shared.claimstore import ClaimStore
from tessera.shared.events import ClaimRecord, ClaimRequested, ClaimSpec, GpuQuota, NodeLedger, TenantUsage
from tessera.shared.kubeclaims import KubeClaimRef, claim_id
from tessera.shared.ledger import Ledger

from tessera.cli.client import Client
from tessera.cli.cluster import LocalCluster

PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emulator\n"
        f"clusters:\n- name: emulator\n  cluster: {{server: '{server}'}}\n"
        "users:\n- name: emulator\n  user: {token: test}\n"
        "contexts:\n- name: emulator\n  context: {cluster: emulator, user: emulator}\n")
    return path


async def start_services(workdir: Path, nats_url: str, apiserver_url: str, *, profile: str = "tiny.yaml",
                         services: tuple[str, ...] = ("controlplane", "capacity", "placement"),
                         placement_replicas: int = 1, env: dict[str, str] | None = None) -> LocalCluster:
    """``services`` (and an enforcer per node) in Kubernetes mode; ready when this returns."""
    workdir.mkdir(parents=True, exist_ok=True)
    kubeconfig = write_kubeconfig(workdir / "kubeconfig", apiserver_url)
    extra = {"KUBECONFIG": str(kubeconfig), "TESSERA_KUBERNETES": "true", "TESSERA_HEARTBEAT_SECONDS": "1",
             **(env or {})}
    cluster = LocalCluster(workdir=workdir, profile=PROFILES / profile, nats_url=nats_url, extra_env=extra)
    for name in services:
        replicas = placement_replicas if name == "placement" else 1
        for i in range(replicas):
            cluster.spawn(name, instance=f"{name}-{i}" if replicas > 1 else name)
    for node in cluster.nodes():
        cluster.spawn("enforcer", instance=f"enforcer-{node}", env={"TESSERA_NODE": node})
    try:
        await asyncio.to_thread(cluster.wait_ready, 90)
    except BaseException:
        cluster.stop()
        raise
    return cluster


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


async def eventually(check, timeout: float = 30.0, every: float = 0.1):
    """Await ``check()`` (sync or async) until it returns something truthy; that value. On timeout
    the last falsy value is returned, so the caller's assert shows what was there."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(every)
