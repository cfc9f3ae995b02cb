"""A tenant's PostgreSQL role has a CONNECTION LIMIT: one tenant cannot take the shared server's
connections from the others. Against a real server the tests start (tests/kit/postgres.py)."""

from __future__ import annotations

import contextlib
import uuid

import psycopg
import pytest
from psycopg import sql

from tessera.controlplane.datastores.postgres import PostgresDriver, role_name

LIMIT = 3


@pytest.fixture
async def tenants(postgres):
    drv = PostgresDriver(postgres.admin_url, postgres.host, connection_limit=LIMIT)
    tag = uuid.uuid4().hex[:6]
    names = [f"cl{tag}-a", f"cl{tag}-b"]
    try:
        yield drv, names
    finally:
        for name in names:
            await drv.remove(name)


async def connection_limit_of(admin_url: str, role: str) -> int:
    async with await psycopg.AsyncConnection.connect(admin_url) as admin:
        row = await (await admin.execute("SELECT rolconnlimit FROM pg_roles WHERE rolname = %s", (role,))).fetchone()
    return row[0]


async def test_one_tenant_past_its_connection_limit_is_refused_while_another_connects(tenants, postgres):
    drv, (a, b) = tenants
    ca = await drv.ensure(a, None)
    cb = await drv.ensure(b, None)
    assert await connection_limit_of(postgres.admin_url, role_name(a)) == LIMIT
    async with contextlib.AsyncExitStack() as held:
        for _ in range(LIMIT):
            await held.enter_async_context(await psycopg.AsyncConnection.connect(ca.endpoint))
        with pytest.raises(psycopg.OperationalError, match=f'FATAL: +too many connections for role "{role_name(a)}"'):
            await psycopg.AsyncConnection.connect(ca.endpoint)
        # the other tenant, on the same server at the same moment, is not affected
        async with await psycopg.AsyncConnection.connect(cb.endpoint) as other:
            assert (await (await other.execute("SELECT 1")).fetchone()) == (1,)


async def test_reconcile_applies_the_limit_to_an_existing_role(tenants, postgres):
    drv, (a, _) = tenants
    creds = await drv.ensure(a, None)
    # A role as the manager created it before the limit existed: no limit (-1).
    async with await psycopg.AsyncConnection.connect(postgres.admin_url, autocommit=True) as admin:
        await admin.execute(sql.SQL("ALTER ROLE {} CONNECTION LIMIT -1").format(sql.Identifier(role_name(a))))
    assert await connection_limit_of(postgres.admin_url, role_name(a)) == -1
    assert await drv.ensure(a, creds) == creds  # the next reconcile pass: same credentials...
    assert await connection_limit_of(postgres.admin_url, role_name(a)) == LIMIT  # ...and the limit
    tighter = PostgresDriver(postgres.admin_url, postgres.host, connection_limit=1)  # the setting changed
    await tighter.ensure(a, creds)
    assert await connection_limit_of(postgres.admin_url, role_name(a)) == 1


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        PostgresDriver("postgresql://postgres@127.0.0.1:5432/postgres", "127.0.0.1:5432", connection_limit=0)
