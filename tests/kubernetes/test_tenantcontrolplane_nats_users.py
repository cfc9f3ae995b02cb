"""On a cluster the NATS datastore's tenant accounts live in a Secret the NATS pods mount (the
manager and nats-server share no filesystem): the manager writes it through the API server, and
what it writes is an accounts list nats-server accepts and enforces, included in the accounts block
next to the platform's account as nats.yaml includes it. On the real kube-apiserver, the manager
acting as its deploy/k8s ServiceAccount (controlplane/manager.yaml's RBAC); the Secret is the
cluster's one, so the tenant's name is this test's own."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import uuid

from tessera.controlplane.datastores.natskv import NatsKvDriver, account_is, connect_ok
from tessera.controlplane.kube import UsersSecret
from tessera.shared import identities
from tessera.shared.bus import Bus
from tessera.shared.kubeapi import KubeApi
from tessera.shared.natsserver import NatsServer, find_binary
from tessera.shared.kubeapi import object_path
from tessera.shared.settings import BusSettings

from kit.kubecluster import service_identity

PLATFORM = ("tessera", "platform-secret")


async def users_conf(admin: KubeApi) -> str:
    secret = await admin.get(object_path("v1", "secrets", "tessera-nats-users", "tessera-system"))
    return base64.b64decode(secret["data"]["users.conf"]).decode()


async def test_tenant_users_go_into_the_secret_nats_server_includes(kube_plane, tmp_path, nats_url):
    tenant = f"nats-{uuid.uuid4().hex[:8]}"
    identity = await asyncio.to_thread(service_identity, kube_plane, "controlplane/manager.yaml")
    bus = await Bus.connect(BusSettings(url=nats_url, file_storage=False), "controlplane")
    users = UsersSecret("tessera-system/tessera-nats-users", kube=KubeApi.for_kubeconfig(identity))
    admin = KubeApi.for_kubeconfig(kube_plane.admin_kubeconfig)
    driver = NatsKvDriver(bus, "nats://127.0.0.1:4222", users)
    try:
        creds = await driver.ensure(tenant, None)
        again = await driver.ensure(tenant, creds)  # a resync: the same password, nothing rewritten
        assert again == creds and creds.username == f"tenant-{tenant}"
        written = users.parse(await users_conf(admin))
        assert account_is(written[tenant], tenant, creds.password)
        assert creds.password not in await users_conf(admin)  # a bcrypt hash, never the password

        # what nats-server makes of that file, included as nats.yaml includes it
        (tmp_path / "nats-users").mkdir()
        (tmp_path / "nats-users" / "users.conf").write_text(await users_conf(admin))
        (tmp_path / "conf").mkdir()
        conf = tmp_path / "conf" / "nats.conf"
        conf.write_text(identities.operator_only_config(*PLATFORM, "../nats-users/users.conf"))
        checked = subprocess.run([find_binary(), "-c", str(conf), "-t"], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
        server = NatsServer(tmp_path / "store", config_file=conf).start()
        try:
            url = f"nats://127.0.0.1:{server.port}"
            assert await connect_ok(url, creds.username, creds.password, creds.inbox_prefix)
            assert await connect_ok(url, *PLATFORM, "_INBOX")
            assert not await connect_ok(url, creds.username, "not-the-password", creds.inbox_prefix)
        finally:
            server.stop()

        await driver.remove(tenant)
        assert tenant not in users.parse(await users_conf(admin))
    finally:
        await users.close()
        await admin.close()
        await bus.close()
