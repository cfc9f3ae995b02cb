"""NATS datastore: a bucket and a user per tenant, confined by nats-server's own authorization."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest

from tessera.controlplane.app import Manager
from tessera.controlplane.datastores.natskv import connect_ok, connect_tenant

async def create(mgr: Manager, name: str) -> dict:
    reply = msgspec.json.decode(await mgr.api.create(msgspec.json.encode({"name": name}), {}))
    assert reply["ok"], reply
    return reply["result"]


async def test_tenant_credentials_reach_only_their_own_bucket_and_subjects(manager):
    await create(manager, "alpha")
    await create(manager, "beta")
    a = (await manager.store.secrets.get("alpha")).value.datastore
    b = (await manager.store.secrets.get("beta")).value.datastore
    assert a.username == "tenant-alpha" and a.scope == "tenant-alpha" and a.password != b.password

    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await connect_tenant(a, error_cb=on_error)
    try:
        js = nc.jetstream(timeout=1.5)
        # the tenant's kine creates its own bucket, with its own configuration, as the tenant
        own = await js.create_key_value(bucket="tenant-alpha", history=10, description="Holds kine key/values")
        await own.put("registry/pods/x", b"pod")
        assert (await own.get("registry/pods/x")).value == b"pod"
        assert (await js.key_value("tenant-alpha")) is not None

        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error, asyncio.TimeoutError)):
            await js.key_value("tenant-beta")  # the server drops the API request: denied
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error, asyncio.TimeoutError)):
            await js.create_key_value(bucket="tenant-beta", history=10)  # nor may it make another's
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error, asyncio.TimeoutError)):
            await nc.request("$KV.tenant-beta.registry.x", b"stolen", timeout=1)

        await nc.subscribe("tessera.claims.beta.>")
        await nc.publish("tessera.claims.beta.c1.requested", b"{}")
        await nc.publish("tessera.tenants.alpha.created", b"{}")  # the manager's subject, not theirs
        await nc.publish("tessera.claims.alpha.c1.release.gpu-0", b"{}")  # only the platform addresses nodes
        await nc.publish("tessera.claims.alpha.c1.requested._", b"{}")  # allowed (placement checks it)
        await nc.subscribe("tessera.claims.alpha.>")  # allowed
        await nc.flush()
        expected = ('subscription to "tessera.claims.beta.>"', 'publish to "tessera.claims.beta.c1.requested"',
                    'publish to "tessera.tenants.alpha.created"', 'publish to "tessera.claims.alpha.c1.release.gpu-0"')
        for _ in range(100):  # the server reports violations asynchronously, one -ERR each
            if all(e in "\n".join(errors).lower() for e in expected):
                break
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
    joined = "\n".join(errors).lower()
    assert "subscription to \"tessera.claims.beta.>\"" in joined
    assert "publish to \"tessera.claims.beta.c1.requested\"" in joined
    assert "publish to \"tessera.tenants.alpha.created\"" in joined
    assert "publish to \"tessera.claims.alpha.c1.release.gpu-0\"" in joined
    assert "requested._" not in joined
    assert "alpha.>" not in joined.replace("tenants.alpha", "")  # own claims subscription allowed

    # Beta's store was never touched by all of the above: not even created.
    with pytest.raises(nats.js.errors.BucketNotFoundError):
        await manager.store.tenants.kv._js.key_value("tenant-beta")


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
    assert "tenant-gamma" not in manager.drivers["nats"].users.read()
