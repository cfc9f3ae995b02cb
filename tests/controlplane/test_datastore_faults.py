"""A datastore that refuses the manager is named in the tenant's status: each driver raises the fault
that fits (`tessera.controlplane.datastores`: away, wrong password, full, a certificate that does not
match), against the real servers — PostgreSQL, etcd over TLS with client-certificate auth, nats-server.
The reconciler puts the fault's reason and message in the status; the tenants on other datastores
stay Ready, and the next resync after the fault is mended makes the tenant Ready again.

(A tenant's API server port taken, a binary missing, its serving certificate replaced, PostgreSQL's
disk full: test_tenant_plane_faults.py; a dedicated etcd's own: test_etcd_dedicated.py; etcd full:
test_etcd_quota.py.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid

import msgspec
import psycopg
import pytest
from psycopg import sql

from controlplane.planes import ETCD_ROOT_PASSWORD, start_etcd_tls
from kit import eventually
from kit.kubecluster import Pki, terminate
from kit.postgres import Postgres, start_postgres, stop_postgres
from tessera.controlplane.app import Manager
from tessera.controlplane.datastores import (CertificateMismatch, DatastoreAuthFailed, DatastoreFull,
                                             DatastoreUnavailable)
from tessera.controlplane.datastores.etcd import EtcdCa, EtcdClient, EtcdDriver, tls_context
from tessera.controlplane.datastores.natskv import NatsKvDriver, UsersFile
from tessera.controlplane.datastores.postgres import PostgresDriver
from tessera.controlplane.pki import PkiAuthority
from tessera.shared.natsserver import free_port


# --- PostgreSQL -----------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def role(postgres, options: str, password: str):
    """A login role on the tests' server (the superuser `postgres` is trusted on loopback; every
    other role presents its password, as a managed server's administrator does)."""
    name = f"admin_{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(postgres.admin_url, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE ROLE {} LOGIN " + options + " PASSWORD {}").format(
            sql.Identifier(name), sql.Literal(password)))
    try:
        yield name
    finally:
        async with await psycopg.AsyncConnection.connect(postgres.admin_url, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


async def set_password(postgres, name: str, password: str) -> None:
    async with await psycopg.AsyncConnection.connect(postgres.admin_url, autocommit=True) as conn:
        await conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(name), sql.Literal(password)))


async def test_postgres_away_is_unavailable():
    port = free_port()  # nothing listens there
    driver = PostgresDriver(f"postgresql://postgres@127.0.0.1:{port}/postgres", f"127.0.0.1:{port}")
    with pytest.raises(DatastoreUnavailable, match="TESSERA_CP_POSTGRES_DSN") as caught:
        await driver.ensure("away", None)
    assert caught.value.reason == "DatastoreUnavailable"


async def test_postgres_out_of_connections_is_full(postgres):
    async with role(postgres, "CONNECTION LIMIT 1", "p") as name:
        dsn = f"postgresql://{name}:p@{postgres.host}/postgres"
        async with await psycopg.AsyncConnection.connect(dsn):  # the one connection it may have
            with pytest.raises(DatastoreFull, match="too many connections") as caught:
                await PostgresDriver(dsn, postgres.host).ensure("crowded", None)
    assert caught.value.reason == "DatastoreFull"


@contextlib.contextmanager
def serving_tls(postgres: Postgres, cert: str, key: str):
    """The server answers TLS with this certificate (reloaded, as an administrator rotates it)."""
    data = postgres.datadir / "data"
    owner = data.stat().st_uid
    for name, pem in (("server.crt", cert), ("server.key", key)):
        (data / name).write_text(pem)
        os.chown(data / name, owner, -1)
        (data / name).chmod(0o600)
    with psycopg.connect(postgres.admin_url, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET ssl = on")
        conn.execute("SELECT pg_reload_conf()")
    try:
        yield
    finally:
        with psycopg.connect(postgres.admin_url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET ssl")
            conn.execute("SELECT pg_reload_conf()")


@pytest.fixture
def own_postgres():
    """A server of this test's own (its TLS settings changed; the session's server is left alone)."""
    server, proc = start_postgres()
    try:
        yield server
    finally:
        stop_postgres(server, proc)


async def test_postgres_tls_from_another_ca_or_for_another_host_is_a_certificate_mismatch(own_postgres, tmp_path):
    authority = PkiAuthority()
    ca, ca_key = authority.new_ca("postgres-ca")
    crt, key = authority.issue_serving(ca, ca_key, "db.example", ["db.example"], [])
    other, _ = authority.new_ca("not-postgres-ca")
    (tmp_path / "ca.crt").write_text(ca)
    (tmp_path / "other.crt").write_text(other)
    server = own_postgres.host

    def dsn(mode: str, root: str) -> str:
        return f"{own_postgres.admin_url}?sslmode={mode}&sslrootcert={tmp_path / root}"

    with serving_tls(own_postgres, crt, key):
        async def serves_tls() -> bool:  # (the reload takes a moment)
            try:
                await PostgresDriver(dsn("verify-ca", "ca.crt"), server).ensure("trusting", None)
            except CertificateMismatch:
                return False
            return True
        await eventually(serves_tls, timeout=30, what="PostgreSQL serving TLS with its new certificate")

        with pytest.raises(CertificateMismatch, match="must be the CA that signed") as caught:
            await PostgresDriver(dsn("verify-full", "other.crt"), server).ensure("alpha", None)
        assert caught.value.reason == "CertificateMismatch" and "certificate verify failed" in str(caught.value)
        with pytest.raises(CertificateMismatch, match="a name the certificate carries") as caught:
            await PostgresDriver(dsn("verify-full", "ca.crt"), server).ensure("alpha", None)
        assert "db.example" in str(caught.value), caught.value


async def test_a_refused_admin_password_is_named_the_others_stay_ready_and_resync_repairs(
        platform_bus, secured_settings, postgres):
    async with role(postgres, "SUPERUSER", "right") as admin:
        settings = dataclasses.replace(secured_settings, drivers=("nats", "postgres"),
                                       postgres_dsn=f"postgresql://{admin}:right@{postgres.host}/postgres",
                                       postgres_tenant_host=postgres.host)
        mgr = await Manager.start(platform_bus, settings)
        try:
            for name, driver in (("steady", "nats"), ("victim", "postgres")):
                made = await call(mgr, "create", {"name": name, "spec": {"datastore": {"driver": driver}}})
                assert made["ok"] and made["result"]["phase"] == "Ready", made

            await set_password(postgres, admin, "changed-behind-its-back")
            await mgr.reconciler.resync()
            victim = await status(mgr, "victim")
            assert (victim.phase, victim.reason) == ("NotReady", "DatastoreAuthFailed"), victim
            assert "password" in victim.message and "TESSERA_CP_POSTGRES_DSN" in victim.message, victim.message
            assert (await status(mgr, "steady")).phase == "Ready"

            await set_password(postgres, admin, "right")  # the password set back
            await mgr.reconciler.resync()
            assert (await status(mgr, "victim")).phase == "Ready"
        finally:
            await mgr.close()
            await PostgresDriver(postgres.admin_url, postgres.host).remove("victim")


async def test_a_datastore_this_manager_does_not_offer_is_named(manager):
    """(The `manager` fixture offers NATS only.)"""
    for name, driver in (("steady", "nats"), ("elsewhere", "postgres")):
        await call(manager, "create", {"name": name, "spec": {"datastore": {"driver": driver}}})
    elsewhere = await status(manager, "elsewhere")
    assert (elsewhere.phase, elsewhere.reason) == ("NotReady", "DatastoreNotConfigured"), elsewhere
    assert "TESSERA_CP_DRIVERS" in elsewhere.message and "nats" in elsewhere.message, elsewhere.message
    assert (await status(manager, "steady")).phase == "Ready"


async def call(mgr: Manager, verb: str, payload: dict) -> dict:
    return msgspec.json.decode(await mgr.api.handlers()[verb](msgspec.json.encode(payload), {}))


async def status(mgr: Manager, name: str):
    stored = await mgr.store.controlplanes.get(name)
    assert stored is not None
    return stored.value.status


# --- etcd over TLS with client-certificate auth ---------------------------------------------------

@pytest.fixture
async def etcd(tmp_path):
    (tmp_path / "etcd").mkdir()
    server, proc = start_etcd_tls(tmp_path / "etcd")
    admin = server.gateway()
    try:
        await eventually(lambda: admin.call("maintenance/status", {}), timeout=20, what="etcd answers")
        await admin.enable_auth(ETCD_ROOT_PASSWORD)
        yield server
    finally:
        await admin.close()
        terminate(proc)


async def test_etcd_refusing_root_s_password_is_auth_failed(etcd):
    driver = EtcdDriver(etcd.endpoint, "not-root-s", EtcdCa(str(etcd.ca_file), str(etcd.ca_key_file)))
    try:
        with pytest.raises(DatastoreAuthFailed, match="TESSERA_CP_ETCD_ROOT_PASSWORD"):
            await driver.ensure("alpha", None)
    finally:
        await driver.close()


async def test_etcd_with_another_ca_is_a_certificate_mismatch(etcd, tmp_path):
    other = Pki(tmp_path / "other-pki")  # a CA etcd never heard of
    driver = EtcdDriver(etcd.endpoint, ETCD_ROOT_PASSWORD, EtcdCa(str(other.ca_file), str(other.ca_key_file)))
    try:
        with pytest.raises(CertificateMismatch, match="TESSERA_CP_ETCD_CA_FILE") as caught:
            await driver.ensure("alpha", None)
        assert caught.value.reason == "CertificateMismatch"
    finally:
        await driver.close()
    # etcd's CA trusted, but a client certificate from the other CA: etcd refuses the handshake
    mine = EtcdCa(str(etcd.ca_file), str(etcd.ca_key_file))
    stranger = EtcdCa(str(other.ca_file), str(other.ca_key_file))
    client = EtcdClient(etcd.endpoint, tls=tls_context(mine.cert, *stranger.gateway_client()))
    try:
        with pytest.raises(CertificateMismatch, match="client certificate"):
            await client.call("maintenance/status", {})
    finally:
        await client.close()


# --- NATS -----------------------------------------------------------------------------------------

async def test_nats_refusing_the_tenant_user_is_auth_failed(platform_bus, secured_nats, tmp_path):
    server, _, pid = secured_nats
    # an accounts file nats-server does not include: the user written there is never accepted
    elsewhere = UsersFile(tmp_path / "not-included.conf", pid)
    driver = NatsKvDriver(platform_bus, f"nats://127.0.0.1:{server.port}", elsewhere)
    with pytest.raises(DatastoreAuthFailed, match="TESSERA_CP_NATS_AUTH_FILE") as caught:
        await driver.ensure("alpha", None)
    assert "uthorization" in str(caught.value)


async def test_nats_away_is_unavailable(platform_bus, secured_nats):
    _, users, pid = secured_nats
    driver = NatsKvDriver(platform_bus, f"nats://127.0.0.1:{free_port()}", UsersFile(users, pid))
    with pytest.raises(DatastoreUnavailable, match="TESSERA_CP_NATS_TENANT_URL"):
        await driver.ensure("alpha", None)
