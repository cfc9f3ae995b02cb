"""Kubernetes mode against the strict API-server emulator (tests/kubernetes): apply, watch
readiness, delete. Every object the manager applies is validated by the emulator as a real API
server would (core/v1, apps/v1, networking.k8s.io/v1 schemas, strict)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tessera.controlplane import manifests
from tessera.controlplane.app import Manager
from tessera.controlplane.kube import KubeHost
from tessera.controlplane.settings import ControlPlaneSettings

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
        for _ in range(100):
            record = (await mgr.store.controlplanes.get("alpha")).value
            if record.status.phase == "Ready":
                break
            await asyncio.sleep(0.05)
        assert record.status.phase == "Ready"

        gone = await call(mgr, "delete", {"name": "alpha"})
        assert gone["ok"]
        assert await apiserver.wait_for(lambda: stored(apiserver) == {}), stored(apiserver)
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher
        await mgr.close()
