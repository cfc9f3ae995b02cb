"""Tenant secrets are sealed in the ``controlplane-secrets`` bucket, and only the manager's key opens them.

Against a real nats-server and a real manager: what the bucket holds raw is an envelope with no PEM
and no password in it; the manager reads its own values back; a rotated key re-seals everything;
a value a manager from before sealing wrote in plaintext is read and re-sealed, never re-issued; a
value under a key the manager lacks, or moved under another tenant's key, is refused with a reason
on the tenant's status, not a crash and not a silent replacement; a bad key file stops the service
before it connects to anything.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import sys
import urllib.request
from pathlib import Path

import msgspec
import pytest

from tessera.controlplane.app import Manager
from tessera.controlplane.credentials import TenantSecrets
from tessera.controlplane.sealing import UNSEALED_READ, Sealer, Unopenable
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.controlplane.store import KV_SECRETS
from tessera.shared.errors import ConfigError
from tessera.shared.natsserver import NatsServer, free_port, wait_for_port
from tessera.shared.secretkeys import SecretKeys, rotate_key_file, write_key_file


async def call(mgr: Manager, verb: str, payload: dict) -> dict:
    return msgspec.json.decode(await mgr.api.handlers()[verb](msgspec.json.encode(payload), {}))


async def raw(bus, tenant: str) -> bytes:
    return (await (await bus.kv(KV_SECRETS)).get(tenant)).value


def with_keys(settings: ControlPlaneSettings, keys: SecretKeys) -> ControlPlaneSettings:
    return dataclasses.replace(settings, secret_keys=keys)


def secret_strings(secrets: TenantSecrets) -> list[str]:
    """What must never be seen in the clear: every PEM body line, the password, the kubeconfig's key."""
    found = [secrets.datastore.password]
    for pem in secrets.pki.values():
        found += [line for line in pem.splitlines() if line and not line.startswith("-----")][:2]
    return [s for s in found if s]


async def test_the_raw_bucket_holds_an_envelope_with_no_pem_and_no_password(manager, platform_bus):
    assert (await call(manager, "create", {"name": "alpha"}))["ok"]
    secrets = (await manager.store.secrets.get("alpha")).value  # round trip: the manager reads it back
    assert "-----BEGIN" in secrets.pki["ca.key"] and secrets.datastore.password
    data = await raw(platform_bus, "alpha")
    assert b"BEGIN" not in data and b"PRIVATE KEY" not in data, data[:300]
    for text in secret_strings(secrets):
        assert text.encode() not in data, "a secret is in the raw bucket"
    assert data.startswith(b"tessera-sealed.1." + manager.settings.secret_keys.ids[0].encode() + b".")
    assert b"alpha" not in data  # not even whose it is: the key names the tenant, the value says nothing


async def test_a_rotated_key_reseals_every_value_and_the_old_key_can_then_go(platform_bus, secured_settings):
    first = await Manager.start(platform_bus, secured_settings)
    try:
        for name in ("alpha", "beta"):
            assert (await call(first, "create", {"name": name}))["ok"]
        before = {n: (await first.store.secrets.get(n)).value for n in ("alpha", "beta")}
    finally:
        await first.close()
    old = secured_settings.secret_keys
    new = SecretKeys.ephemeral()
    rotated = SecretKeys(new.keys + old.keys, "new, then old")
    second = await Manager.start(platform_bus, with_keys(secured_settings, rotated))
    try:
        await second.reconciler.resync()
    finally:
        await second.close()
    for name in ("alpha", "beta"):
        assert Sealer(rotated, KV_SECRETS).is_current(await raw(platform_bus, name))
    # The old key is gone from the file: the new one alone opens everything, unchanged.
    third = await Manager.start(platform_bus, with_keys(secured_settings, new))
    try:
        for name in ("alpha", "beta"):
            assert (await third.store.secrets.get(name)).value == before[name]
        assert (await call(third, "get", {"name": "alpha"}))["result"]["phase"] == "Ready"
    finally:
        await third.close()


async def test_a_plaintext_value_from_before_sealing_is_read_and_resealed_not_reissued(manager, platform_bus):
    assert (await call(manager, "create", {"name": "alpha"}))["ok"]
    secrets = (await manager.store.secrets.get("alpha")).value
    kv = await platform_bus.kv(KV_SECRETS)
    await kv.put("alpha", msgspec.json.encode(secrets))  # what a manager from before sealing stored
    unsealed = UNSEALED_READ[KV_SECRETS]
    await manager.reconciler.resync()
    assert UNSEALED_READ[KV_SECRETS] == unsealed + 1  # read once, then sealed: the next pass reads ciphertext
    await manager.reconciler.resync()
    assert UNSEALED_READ[KV_SECRETS] == unsealed + 1
    data = await raw(platform_bus, "alpha")
    assert data.startswith(b"tessera-sealed.1.") and b"BEGIN" not in data
    assert (await manager.store.secrets.get("alpha")).value == secrets  # same CA key and password: nothing lost


async def test_a_value_sealed_with_a_key_the_manager_lacks_is_refused_clearly_and_kept(platform_bus, secured_settings):
    first = await Manager.start(platform_bus, secured_settings)
    try:
        assert (await call(first, "create", {"name": "alpha"}))["ok"]
    finally:
        await first.close()
    sealed = await raw(platform_bus, "alpha")
    stranger = SecretKeys.ephemeral()
    second = await Manager.start(platform_bus, with_keys(secured_settings, stranger))
    try:
        with pytest.raises(Unopenable) as refused:
            await second.store.secrets.get("alpha")
        old_id = secured_settings.secret_keys.ids[0]
        assert f"sealed with key {old_id}, which an in-memory key does not hold" in str(refused.value)
        await second.reconciler.resync()  # no crash: the other tenants would go on
        status = (await call(second, "get", {"name": "alpha"}))["result"]
        assert status["phase"] == "NotReady" and status["reason"] == "SecretsUnreadable"
        assert old_id in status["message"]
    finally:
        await second.close()
    assert await raw(platform_bus, "alpha") == sealed  # not replaced by new credentials: the key may come back


async def test_a_sealed_value_moved_under_another_tenants_key_does_not_open(manager, platform_bus):
    for name in ("alpha", "beta"):
        assert (await call(manager, "create", {"name": name}))["ok"]
    kv = await platform_bus.kv(KV_SECRETS)
    await kv.put("beta", await raw(platform_bus, "alpha"))  # beta would get alpha's CA key and password
    with pytest.raises(Unopenable, match="copied from another key of the bucket"):
        await manager.store.secrets.get("beta")
    await manager.reconciler.reconcile("beta")
    assert (await call(manager, "get", {"name": "beta"}))["result"]["reason"] == "SecretsUnreadable"
    assert (await manager.store.secrets.get("alpha")).value.tenant == "alpha"


def test_an_envelope_relabelled_with_another_key_id_or_altered_does_not_open():
    one, two = SecretKeys.ephemeral(), SecretKeys.ephemeral()
    both = SecretKeys(one.keys + two.keys, "both")
    sealer = Sealer(both, KV_SECRETS)
    sealed = sealer.seal("alpha", b'{"tenant": "alpha"}')
    assert sealer.open("alpha", sealed) == b'{"tenant": "alpha"}'
    relabelled = sealed.replace(one.ids[0].encode(), two.ids[0].encode())
    with pytest.raises(Unopenable, match="does not open with key"):
        sealer.open("alpha", relabelled)
    head, body = sealed.rsplit(b".", 1)
    flipped = bytearray(base64.urlsafe_b64decode(body))
    flipped[0] ^= 1
    with pytest.raises(Unopenable, match="altered"):
        sealer.open("alpha", head + b"." + base64.urlsafe_b64encode(bytes(flipped)))
    with pytest.raises(Unopenable, match="envelope version '9'"):
        sealer.open("alpha", sealed.replace(b"tessera-sealed.1.", b"tessera-sealed.9.", 1))
    assert sealer.seal("alpha", b"x") != sealer.seal("alpha", b"x")  # a fresh nonce every time


def test_the_key_file_is_read_newest_first_and_rotated_in_place(tmp_path):
    path = tmp_path / "keys"
    assert write_key_file(path) and not write_key_file(path)  # an existing file is never replaced
    assert path.stat().st_mode & 0o777 == 0o600
    first = SecretKeys.from_file(str(path))
    rotate_key_file(path)
    after = SecretKeys.from_file(str(path))
    assert len(after.ids) == 2 and after.ids[1] == first.ids[0]
    assert path.stat().st_mode & 0o777 == 0o600
    assert "keys" not in repr(after.keys[0][1]) and str(after.keys[0][1]) not in repr(after)


@pytest.mark.parametrize("content, error", [
    (None, "no such file"),
    ("", "holds no key"),
    ("not base64 at all!\n", "line 1 is not base64"),
    ("# a comment\n" + base64.b64encode(b"k" * 16).decode() + "\n", "line 2 is a 16-byte key; AES-256 needs 32 bytes"),
])
def test_a_bad_key_file_is_a_configuration_error_naming_the_fix(tmp_path, content, error):
    path = tmp_path / "keys"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=error):
        ControlPlaneSettings.from_env({"TESSERA_CP_SECRET_KEY_FILE": str(path)})
    with pytest.raises(ConfigError, match="TESSERA_CP_SECRET_KEY_FILE is not set"):
        ControlPlaneSettings.from_env({})


def client_names(server: NatsServer) -> list[str]:
    """Names of every client connection the server has seen, open or closed (its /connz)."""
    wait_for_port(server.monitor_port, 20)  # (start() waits for the client port only)
    url = f"http://127.0.0.1:{server.monitor_port}/connz?state=all"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return [c.get("name", "") for c in json.load(reply).get("connections") or []]


async def test_the_service_stops_on_a_bad_key_file_before_it_connects(tmp_path):
    # The server is up and would accept it: the service must not get as far as connecting.
    with NatsServer(tmp_path / "nats", monitor_port=free_port()) as server:
        proc = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "tessera-controlplane"),
            env={"TESSERA_NATS_URL": server.url, "TESSERA_CP_SECRET_KEY_FILE": str(tmp_path / "absent"),
                 "PATH": "/usr/bin:/bin"},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 2, out
        assert f"TESSERA_CP_SECRET_KEY_FILE={tmp_path / 'absent'}: no such file" in out.decode()
        assert "tessera-controlplane" not in client_names(server)


async def test_a_tenant_whose_secrets_do_not_open_can_still_be_deleted(platform_bus, secured_settings):
    first = await Manager.start(platform_bus, secured_settings)
    try:
        assert (await call(first, "create", {"name": "alpha"}))["ok"]
        users = first.drivers["nats"].users
        assert "alpha" in users.read()
    finally:
        await first.close()
    second = await Manager.start(platform_bus, with_keys(secured_settings, SecretKeys.ephemeral()))
    try:
        assert (await call(second, "delete", {"name": "alpha"}))["ok"]
        assert "alpha" not in await second.store.secrets.keys()  # the unreadable value went too
        assert "alpha" not in users.read()  # its NATS account went with it
        assert (await call(second, "get", {"name": "alpha"}))["ok"] is False
    finally:
        await second.close()
