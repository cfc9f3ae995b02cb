"""Reconcile, don't remember: repeat creates, a manager restarted from empty memory, full clean-up."""

from __future__ import annotations

import msgspec
import yaml

from tessera.controlplane.app import Manager
from tessera.controlplane.datastores.natskv import account_is
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared.kv import CasLost


async def call(mgr: Manager, verb: str, payload: dict) -> dict:
    handler = mgr.api.handlers()[verb]
    return msgspec.json.decode(await handler(msgspec.json.encode(payload), {}))


async def test_create_twice_is_harmless(manager):
    first = await call(manager, "create", {"name": "alpha", "quota": {"gpus": 2}})
    secrets = (await manager.store.secrets.get("alpha")).value
    second = await call(manager, "create", {"name": "alpha", "quota": {"gpus": 2}})
    assert first["ok"] and second["ok"]
    assert second["result"]["generation"] == 1 and second["result"]["phase"] == "Ready"
    again = (await manager.store.secrets.get("alpha")).value
    assert again.pki == secrets.pki and again.datastore == secrets.datastore
    changed = await call(manager, "create", {"name": "alpha", "quota": {"gpus": 3}})
    assert changed["result"]["generation"] == 2 and changed["result"]["observed_generation"] == 2
    record = (await manager.store.tenants.get("alpha")).value
    assert record.quota.gpus == 3


async def test_a_manager_restarted_from_empty_memory_repairs_what_drifted(platform_bus, secured_settings):
    first = await Manager.start(platform_bus, secured_settings)
    try:
        assert (await call(first, "create", {"name": "alpha"}))["ok"]
        creds = (await first.store.secrets.get("alpha")).value.datastore
    finally:
        await first.close()
    # Drift while no manager runs: the manifests vanish, the users file loses the tenant, and the
    # public tenants record is gone.
    manifest = first.host.path("alpha")
    manifest.unlink()
    users = first.drivers["nats"].users
    users.write({})
    await first.store.tenants.delete("alpha")

    second = await Manager.start(platform_bus, secured_settings)  # nothing carried over in memory
    try:
        await second.reconciler.resync()
        assert manifest.exists()
        assert account_is(users.read().get("alpha"), "alpha", creds.password)  # same credentials come back
        assert (await second.store.tenants.get("alpha")).value.phase == "Ready"
    finally:
        await second.close()


async def test_delete_removes_datastore_credentials_certificates_and_manifests(manager):
    assert (await call(manager, "create", {"name": "alpha"}))["ok"]
    manifest = manager.host.path("alpha")
    docs = list(yaml.safe_load_all(manifest.read_text()))
    assert {d["kind"] for d in docs} >= {"Deployment", "NetworkPolicy", "Secret", "Service"}
    assert (await call(manager, "delete", {"name": "alpha"}))["result"]["existed"]
    assert not manifest.exists()
    assert await manager.store.secrets.get("alpha") is None  # certificates and datastore credentials
    assert await manager.store.controlplanes.get("alpha") is None
    assert await manager.store.tenants.get("alpha") is None
    assert "alpha" not in manager.drivers["nats"].users.read()
    assert await manager.store.secrets.keys() == []
    again = await call(manager, "delete", {"name": "alpha"})
    assert again["ok"] and not again["result"]["existed"]


async def test_capacity_refusal_through_the_api(platform_bus, secured_settings):
    settings = ControlPlaneSettings(**{**secured_settings.__dict__, "host_cpu_millis": 1000, "host_memory_mib": 2048})
    mgr = await Manager.start(platform_bus, settings)
    try:
        ok = await call(mgr, "create", {"name": "alpha", "spec": {"kubernetes": {"replicas": 1}}})
        assert ok["ok"], ok
        refused = await call(mgr, "create", {"name": "beta", "spec": {"kubernetes": {"replicas": 2}}})
        assert not refused["ok"]
        assert refused["error"]["code"] == "insufficient-capacity"
        assert "cannot fit tenant 'beta'" in refused["error"]["message"]
        assert await mgr.store.controlplanes.get("beta") is None
    finally:
        await mgr.close()


async def test_a_delete_that_keeps_losing_the_race_to_mark_the_tenant_says_so(manager):
    """Deleting first marks the tenant deleting by compare-and-set; a delete that lost every race
    for that mark went on to reconcile an unmarked tenant and answered as if pending."""
    assert (await call(manager, "create", {"name": "alpha"}))["ok"]
    bucket = manager.store.controlplanes
    writes = bucket.put

    async def always_beaten(key, value, *, revision):
        if key == "alpha":
            raise CasLost(f"controlplanes/{key} changed since revision {revision}")
        return await writes(key, value, revision=revision)

    bucket.put = always_beaten
    try:
        reply = await call(manager, "delete", {"name": "alpha"})
    finally:
        bucket.put = writes
    assert not reply["ok"] and "kept losing" in reply["error"]["message"], reply
    stored = (await bucket.get("alpha")).value
    assert not stored.deleting and stored.status.phase == "Ready"
    assert manager.host.path("alpha").exists()
