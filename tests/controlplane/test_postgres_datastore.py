"""PostgreSQL datastore against the real server: a database + role per tenant, refused across tenants."""

from __future__ import annotations

import base64
import hashlib
import hmac
import uuid

import psycopg
import pytest

from tessera.controlplane.datastores.postgres import PostgresDriver, database_name, role_name



@pytest.fixture
async def driver(postgres):
    drv = PostgresDriver(postgres.admin_url, postgres.host)
    tag = uuid.uuid4().hex[:6]
    names = [f"pg{tag}-a", f"pg{tag}-b"]
    try:
        yield drv, names
    finally:
        for name in names:
            await drv.remove(name)


async def test_tenant_role_reaches_its_database_and_is_refused_on_another(driver):
    drv, (a, b) = driver
    ca = await drv.ensure(a, None)
    cb = await drv.ensure(b, None)
    again = await drv.ensure(a, ca)  # idempotent: same credentials, nothing recreated
    assert again == ca

    async with await psycopg.AsyncConnection.connect(ca.endpoint, autocommit=True) as conn:
        await conn.execute("CREATE TABLE kine (id bigserial primary key, name text, value bytea)")
        await conn.execute("INSERT INTO kine (name, value) VALUES ('/registry/pods/x', 'v')")

    other = cb.endpoint.replace(database_name(b), database_name(a))
    with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
        await psycopg.AsyncConnection.connect(other)
    # the refusal above comes from the CONNECT privilege; the password is checked too (SCRAM):
    wrong = ca.endpoint.replace(ca.password, "not-" + ca.password)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        await psycopg.AsyncConnection.connect(wrong)


async def test_remove_drops_database_and_role(driver, postgres):
    drv, (a, _) = driver
    creds = await drv.ensure(a, None)
    conn = await psycopg.AsyncConnection.connect(creds.endpoint)  # an open session does not block removal
    await drv.remove(a)
    await drv.remove(a)  # twice is harmless
    await conn.close()
    async with await psycopg.AsyncConnection.connect(postgres.admin_url) as admin:
        db = await (await admin.execute("SELECT 1 FROM pg_database WHERE datname=%s", (database_name(a),))).fetchone()
        role = await (await admin.execute("SELECT 1 FROM pg_roles WHERE rolname=%s", (role_name(a),))).fetchone()
    assert db is None and role is None
    with pytest.raises(psycopg.OperationalError):
        await psycopg.AsyncConnection.connect(creds.endpoint)


def scram_stored_key(password: str, salt: bytes, iterations: int) -> bytes:
    """RFC 5802's StoredKey, from the password: what the server compares a client's proof with."""
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return hashlib.sha256(hmac.new(salted, b"Client Key", "sha256").digest()).digest()


async def test_the_server_is_given_a_scram_verifier_never_the_password(driver, postgres):
    drv, (a, _) = driver
    creds = await drv.ensure(a, None)
    async with await psycopg.AsyncConnection.connect(postgres.admin_url) as admin:
        (stored,) = await (await admin.execute("SELECT rolpassword FROM pg_authid WHERE rolname=%s",
                                               (role_name(a),))).fetchone()
    assert creds.password not in stored
    scheme, rest = stored.split("$", 1)
    iterations, salt = rest.split("$")[0].split(":")
    stored_key = rest.split("$")[1].split(":")[0]
    assert scheme == "SCRAM-SHA-256"
    assert base64.b64decode(stored_key) == scram_stored_key(creds.password, base64.b64decode(salt), int(iterations))
