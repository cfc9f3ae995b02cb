"""NATS datastore: an account per tenant holding its bucket, confined by nats-server's own accounts."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import nats
import pytest

from tessera.controlplane.app import Manager
from tessera.controlplane.datastores.natskv import NatsKvDriver, connect_ok, connect_tenant
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared.settings import BusSettings
from kit import eventually

async def create(mgr: Manager, name: str) -> dict:
    reply = msgspec.json.decode(await mgr.api.create(msgspec.json.encode({"name": name}), {}))
    assert reply["ok"], reply
    return reply["result"]


async def test_tenant_credentials_reach_only_their_own_account(manager):
    await create(manager, "alpha")
    await create(manager, "beta")
    a = (await manager.store.secrets.get("alpha")).value.datastore
    b = (await manager.store.secrets.get("beta")).value.datastore
    assert a.username == "tenant-alpha" and a.scope == "tenant-alpha" and a.password != b.password

    platform = manager.store.tenants.kv._js._nc
    heard: list[str] = []

    async def on_platform(msg) -> None:
        heard.append(msg.subject)

    platform_sub = await platform.subscribe("tessera.>", cb=on_platform)
    na, nb = await connect_tenant(a), await connect_tenant(b)
    try:
        # Each tenant's kine creates its own bucket, with its own configuration, in its own account.
        own = await na.jetstream(timeout=1.5).create_key_value(bucket="tenant-alpha", history=10,
                                                                description="Holds kine key/values")
        await own.put("registry/pods/x", b"pod")
        assert (await own.get("registry/pods/x")).value == b"pod"
        theirs = await nb.jetstream(timeout=1.5).create_key_value(bucket="tenant-beta", history=10)
        await theirs.put("registry/pods/y", b"beta's pod")
        # Beta's bucket is not in alpha's account at all; one alpha makes of that name is its own.
        with pytest.raises(nats.js.errors.BucketNotFoundError):
            await na.jetstream(timeout=1.5).key_value("tenant-beta")
        fake = await na.jetstream(timeout=1.5).create_key_value(bucket="tenant-beta", history=10)
        await fake.put("registry/pods/y", b"stolen")
        assert (await theirs.get("registry/pods/y")).value == b"beta's pod"

        # What a tenant publishes stays in its account: the platform hears none of it.
        seen: list[str] = []

        async def on_alpha(msg) -> None:
            seen.append(msg.subject)

        await na.subscribe("tessera.claims.*.*.prepared.>", cb=on_alpha)
        await na.publish("tessera.claims.beta.c1.requested._", b"{}")
        await na.publish("tessera.tenants.alpha.created", b"{}")
        await na.flush()
        # Its own claim events reach it (imported); another tenant's do not.
        await platform.publish("tessera.claims.beta.c2.prepared.gpu-0", b"{}")
        await platform.publish("tessera.claims.alpha.c3.prepared.gpu-0", b"{}")
        await eventually(lambda: "tessera.claims.alpha.c3.prepared.gpu-0" in seen, timeout=30, every=0.05)
        assert "tessera.claims.beta.c2.prepared.gpu-0" not in seen
        assert "tessera.claims.beta.c1.requested._" not in heard and "tessera.tenants.alpha.created" not in heard
    finally:
        await na.close()
        await nb.close()
        await platform_sub.unsubscribe()


async def test_delete_removes_bucket_and_revokes_the_user(manager):
    await create(manager, "gamma")
    creds = (await manager.store.secrets.get("gamma")).value.datastore
    assert await connect_ok(creds.endpoint, creds.username, creds.password, creds.inbox_prefix)
    nc = await connect_tenant(creds)
    try:  # (what the tenant's kine does first)
        await nc.jetstream(timeout=1.5).create_key_value(bucket="tenant-gamma", history=10)
    finally:
        await nc.close()
    reply = msgspec.json.decode(await manager.api.delete(msgspec.json.encode({"name": "gamma"}), {}))
    assert reply["ok"] and reply["result"]["existed"]
    assert not await connect_ok(creds.endpoint, creds.username, creds.password, creds.inbox_prefix)
    with pytest.raises(nats.js.errors.BucketNotFoundError):
        await manager.store.tenants.kv._js.key_value("tenant-gamma")
    assert await manager.store.secrets.get("gamma") is None
    assert "gamma" not in manager.drivers["nats"].users.read()
    # A tenant created again under that name starts with an empty account: its old bucket is gone.
    await create(manager, "gamma")
    creds = (await manager.store.secrets.get("gamma")).value.datastore
    nc = await connect_tenant(creds)
    try:
        with pytest.raises(nats.js.errors.BucketNotFoundError):
            await nc.jetstream(timeout=1.5).key_value("tenant-gamma")
    finally:
        await nc.close()


def test_a_nats_url_without_a_host_is_refused_saying_what_to_set():
    # (only the driver's URL handling: a Bus with this URL could not be connected to compare with)
    bus = SimpleNamespace(settings=BusSettings(url="nats://:4222"))
    with pytest.raises(ValueError, match="names no host: set TESSERA_NATS_URL to nats://<host>:<port>"):
        NatsKvDriver.from_settings(bus, ControlPlaneSettings())
