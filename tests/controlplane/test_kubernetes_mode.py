"""Kubernetes mode against the strict API-server emulator (tests/kubernetes): apply, watch
readiness, delete. Every object the manager applies is validated by the emulator as a real API
server would (core/v1, apps/v1, networking.k8s.io/v1 schemas, strict)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from tessera.cli.client import Client
from tessera.cli.cluster import LocalCluster
from tessera.controlplane import crd, manifests
from tessera.controlplane.app import Manager
from tessera.controlplane.kube import KubeHost
from tessera.controlplane.resources import FINALIZER
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared import subjects
from tessera.shared.api import SubmitRequest
from tessera.shared.ledger import Ledger
from tessera.shared.cancelling import cancel_and_wait

from kit import eventually

PROFILES = Path(__file__).resolve().parents[1] / "profiles"

NS = "tenant-alpha"
KINDS = (("v1", "secrets"), ("v1", "services"), ("apps/v1", "deployments"),
         ("networking.k8s.io/v1", "networkpolicies"))


def stored(apiserver) -> dict[tuple[str, str], dict]:
    """(kind, name) -> the tenant namespace and what is in it, as the emulator holds them now."""
    out = {}
    for api_version, plural in KINDS:
        for obj in apiserver.objects(api_version, plural, NS):
            out[(obj["kind"], obj["metadata"]["name"])] = obj
    namespace = apiserver.object("v1", "namespaces", NS)
    if namespace is not None:
        out[("Namespace", NS)] = namespace
    return out


async def call(mgr: Manager, verb: str, payload: dict) -> dict:
    return msgspec.json.decode(await mgr.api.handlers()[verb](msgspec.json.encode(payload), {}))


async def test_apply_watch_ready_and_delete(apiserver, bus):
    host = KubeHost.for_url(apiserver.url)
    mgr = await Manager.start(bus, ControlPlaneSettings(host_mode="kubernetes"), host=host)
    watcher = asyncio.create_task(mgr.follow_host())
    try:
        created = await call(mgr, "create", {"name": "alpha", "spec": {"network": {"nodeCidrs": ["192.168.7.0/24"]}}})
        assert created["ok"], created
        assert created["result"]["phase"] == "Provisioning"
        assert "0/2" in created["result"]["message"]

        objects = stored(apiserver)
        kinds = sorted(k for k, _ in objects)
        assert kinds == ["Deployment", "Namespace", "NetworkPolicy", "Secret", "Secret", "Secret", "Service"]
        manifests.validate(list(objects.values()))  # what the API server holds passes the real schemas
        deployment = objects[("Deployment", "alpha-control-plane")]
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            assert c["resources"]["requests"] and c["resources"]["limits"]

        versions = {key: obj["metadata"]["resourceVersion"] for key, obj in objects.items()}
        again = await call(mgr, "create", {"name": "alpha", "spec": {"network": {"nodeCidrs": ["192.168.7.0/24"]}}})
        assert again["ok"] and set(stored(apiserver)) == set(objects)
        applies = [(path, query) for method, path, query in apiserver.requests if method == "PATCH"]
        assert len(applies) >= 2 * len(objects)
        for _, query in applies:  # server-side apply (the emulator refuses one without a field manager)
            assert query.get("fieldManager") == "tessera-controlplane" and query.get("force") == "true"
        # applying the same objects again changes nothing the API server stores
        assert {k: o["metadata"]["resourceVersion"] for k, o in stored(apiserver).items()} == versions

        # The Deployment controller reports the replicas ready (its status subresource); the watch notices.
        await apiserver.patch("apps/v1", "deployments", "alpha-control-plane",
                              {"status": {"readyReplicas": 2, "updatedReplicas": 2, "replicas": 2}}, NS,
                              subresource="status")
        async def ready() -> bool:
            return (await mgr.store.controlplanes.get("alpha")).value.status.phase == "Ready"

        await eventually(ready, timeout=5, every=0.05, what="alpha's record Ready")

        gone = await call(mgr, "delete", {"name": "alpha"})
        assert gone["ok"]
        assert await apiserver.wait_for(lambda: stored(apiserver) == {}), stored(apiserver)
    finally:
        await cancel_and_wait([watcher])  # (one cancel may be lost: tessera.shared.cancelling)
        assert watcher.cancelled()
        await mgr.close()


# --- deleting a TenantControlPlane whose tenant still has claims ----------------------------------

TEAM = "team-a"
GPUMEM = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}


@pytest.fixture
async def gpu_services(nats_url, tmp_path):
    """Capacity, translator, placement and the enforcers of tests/profiles/tiny.yaml (simulated
    hardware) as processes on this test's nats-server: the real services that hold and release claims."""
    cluster = LocalCluster(workdir=tmp_path / "services", profile=PROFILES / "tiny.yaml", nats_url=nats_url,
                           extra_env={"TESSERA_STREAM_STORAGE": "memory"})  # as the in-loop manager's bus
    try:
        for name in ("capacity", "translator", "placement"):
            cluster.spawn(name, instance=name)
        for node in cluster.nodes():
            cluster.spawn("enforcer", instance=f"enforcer-{node}", env={"TESSERA_NODE": node})
        await asyncio.to_thread(cluster.wait_ready, 90)
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


async def test_a_deleted_tenant_control_plane_keeps_its_finalizer_until_its_claims_are_released(
        apiserver, bus, gpu_services):
    cluster = gpu_services
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TEAM}})
    settings = ControlPlaneSettings(host_mode="kubernetes", teardown_wait_seconds=1.0, resync_seconds=0.5)
    mgr = await Manager.start(bus, settings, host=KubeHost.for_url(apiserver.url))
    tasks = [asyncio.create_task(coro, name=name) for name, coro in mgr.root_tasks().items()]
    client = await Client.connect(cluster.url)
    tcp = (f"{crd.GROUP}/{crd.VERSION}", crd.PLURAL, "alpha", TEAM)
    try:
        await apiserver.create({"apiVersion": tcp[0], "kind": "TenantControlPlane",
                                "metadata": {"name": "alpha", "namespace": TEAM},
                                "spec": {"quota": {"gpus": 2}, "network": {"nodeCidrs": ["192.168.7.0/24"]}}})
        await eventually(lambda: apiserver.object(*tcp).get("status", {}).get("phase"), what="the tenant served")
        assert (await mgr.store.tenants.get("alpha")).value.quota.gpus == 2
        claim = (await client.submit(SubmitRequest(tenant="alpha", resources=GPUMEM)))["claim"]
        node = (await client.wait_for(claim, {"prepared"})).node
        enforcer = cluster.find(f"enforcer-{node}")
        await asyncio.to_thread(cluster.stop_process, enforcer)  # nobody can release it for now

        await apiserver.delete(tcp[0], tcp[1], "alpha", TEAM)

        async def pending():
            obj = apiserver.object(*tcp)
            return obj if (obj or {}).get("status", {}).get("reason") == "ClaimsNotReleased" else None

        obj = await eventually(pending, what="the object to say its claims are not released")
        assert FINALIZER in obj["metadata"]["finalizers"] and obj["metadata"].get("deletionTimestamp")
        assert obj["status"]["phase"] == "Deleting" and claim in obj["status"]["message"]
        assert (await client.claim(claim)).state == "prepared"
        assert apiserver.object("apps/v1", "deployments", "alpha-control-plane", "tenant-alpha") is not None

        cluster.spawn("enforcer", instance=enforcer.name, env={"TESSERA_NODE": node})
        await eventually(lambda: apiserver.object(*tcp) is None, what="the object gone")
        assert (await client.claim(claim)).state == "released"
        ledger = Ledger(await bus.kv(subjects.KV_LEDGER))
        assert claim not in (await ledger.read_node(node))[0].entries
        assert (await ledger.read_tenant("alpha"))[0].claims == {}
        assert await mgr.store.controlplanes.get("alpha") is None and await mgr.store.tenants.get("alpha") is None
        assert apiserver.object("apps/v1", "deployments", "alpha-control-plane", "tenant-alpha") is None
        assert not any(t.done() for t in tasks), [t for t in tasks if t.done()]
    finally:
        await client.close()
        await cancel_and_wait(tasks)
        await mgr.close()
