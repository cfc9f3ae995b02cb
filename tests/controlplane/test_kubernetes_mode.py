"""Kubernetes mode against kmock's stateful Kubernetes emulator: apply, watch readiness, delete."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest

from tessera.controlplane import manifests
from tessera.controlplane.app import Manager
from tessera.controlplane.kube import KubeHost
from tessera.controlplane.settings import ControlPlaneSettings


def stored(kmock) -> dict[tuple[str, str], dict]:
    """(kind, name) -> the object as the emulator holds it now."""
    out = {}
    for _, obj in kmock.objects.items():
        if obj.deleted:
            continue
        raw = obj.raw
        out[(raw["kind"], raw["metadata"]["name"])] = raw
    return out


async def call(mgr: Manager, verb: str, payload: dict) -> dict:
    return msgspec.json.decode(await mgr.api.handlers()[verb](msgspec.json.encode(payload), {}))


async def test_apply_watch_ready_and_delete(kmock, bus):
    for resource in ("v1/secrets", "v1/services", "apps/v1/deployments",
                     "networking.k8s.io/v1/networkpolicies"):
        kmock.resources[resource] = {}
    # kmock 0.8 cannot route the cluster-scoped /api/v1/namespaces paths (its parse_path reads
    # "namespaces" as a namespace prefix), so the emulated platform pre-creates tenant namespaces.
    host = KubeHost.for_url(str(kmock.url).rstrip("/"), manage_namespaces=False)
    mgr = await Manager.start(bus, ControlPlaneSettings(host_mode="kubernetes"), host=host)
    watcher = asyncio.create_task(mgr.follow_host())
    try:
        created = await call(mgr, "create", {"name": "alpha", "spec": {"network": {"nodeCidrs": ["192.168.7.0/24"]}}})
        assert created["ok"], created
        assert created["result"]["phase"] == "Provisioning"
        assert "0/2" in created["result"]["message"]

        objects = stored(kmock)
        kinds = sorted(k for k, _ in objects)
        assert kinds == ["Deployment", "NetworkPolicy", "Secret", "Secret", "Secret", "Service"]
        manifests.validate(list(objects.values()))  # what the API server holds passes the real schemas
        deployment = objects[("Deployment", "alpha-control-plane")]
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            assert c["resources"]["requests"] and c["resources"]["limits"]

        again = await call(mgr, "create", {"name": "alpha", "spec": {"network": {"nodeCidrs": ["192.168.7.0/24"]}}})
        assert again["ok"] and len(stored(kmock)) == 6
        applies = [r for r in kmock if r.method == "PATCH"]
        assert len(applies) >= 6
        for r in applies:  # server-side apply, not a merge patch
            assert r.params.get("fieldManager") == "tessera-controlplane" and r.params.get("force") == "true"
            assert r.headers.get("Content-Type", "").startswith("application/apply-patch+yaml")

        # The Deployment controller would report the replicas ready; the watch must notice.
        async with aiohttp.ClientSession() as http:
            url = f"{str(kmock.url).rstrip('/')}/apis/apps/v1/namespaces/tenant-alpha/deployments/alpha-control-plane"
            patch = {"status": {"readyReplicas": 2, "updatedReplicas": 2, "replicas": 2}}
            async with http.patch(url, json=patch, headers={"Content-Type": "application/merge-patch+json"}) as r:
                assert r.status == 200
        for _ in range(100):
            record = (await mgr.store.controlplanes.get("alpha")).value
            if record.status.phase == "Ready":
                break
            await asyncio.sleep(0.05)
        assert record.status.phase == "Ready"

        gone = await call(mgr, "delete", {"name": "alpha"})
        assert gone["ok"]
        assert stored(kmock) == {}
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher
        await mgr.close()
