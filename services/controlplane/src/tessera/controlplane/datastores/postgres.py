"""PostgreSQL datastore: a database and a login role per tenant on a shared server.

Isolation is PostgreSQL's own: the tenant's role owns its database, CONNECT on that database is
revoked from PUBLIC, so every other tenant's role is refused at connection time by the server. The
control plane reaches it the way Kamaji's kine does, with a postgresql:// DSN for its own role.
Every statement is idempotent (IF EXISTS / catalogue checks) so reconcile may run it forever.

Each tenant role carries a CONNECTION LIMIT, so one tenant (a kine with an unbounded pool, a flood of
its own control planes) cannot take every connection of the shared server: PostgreSQL refuses its
next one with "too many connections for role" while the others still connect. A role created before
the limit existed, or with another, gets it on the next reconcile (ALTER ROLE).
"""

from __future__ import annotations

import secrets
from urllib.parse import quote

import psycopg
from psycopg import sql

from tessera.controlplane.credentials import DatastoreCredentials
from tessera.controlplane.datastores import DatastoreUnavailable


def database_name(tenant: str) -> str:
    return "tessera_" + tenant.replace("-", "_")


def role_name(tenant: str) -> str:
    return "tessera_t_" + tenant.replace("-", "_")


class PostgresDriver:
    name = "postgres"

    def __init__(self, admin_dsn: str, tenant_host: str, connection_limit: int = 32) -> None:
        if connection_limit < 1:
            raise ValueError(f"connection_limit={connection_limit}: a tenant role needs at least 1 connection")
        self.admin_dsn = admin_dsn
        self.tenant_host = tenant_host  # host:port the tenants' control planes use
        self.connection_limit = connection_limit  # per tenant role, enforced by PostgreSQL

    async def _admin(self) -> psycopg.AsyncConnection:
        try:
            return await psycopg.AsyncConnection.connect(self.admin_dsn, autocommit=True, connect_timeout=5)
        except psycopg.OperationalError as exc:
            raise DatastoreUnavailable(f"cannot reach PostgreSQL as administrator: {exc}") from exc

    async def ensure(self, tenant: str, current: DatastoreCredentials | None) -> DatastoreCredentials:
        db, role = database_name(tenant), role_name(tenant)
        password = current.password if current and current.driver == self.name and current.username == role else ""
        password = password or secrets.token_urlsafe(24)
        conn = await self._admin()
        async with conn:
            exists = await (await conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))).fetchone()
            verb = "ALTER" if exists else "CREATE"
            # The SCRAM verifier, computed here by libpq: the server stores it as given, so the
            # password itself never reaches the server (nor its statement log).
            verifier = conn.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256").decode()
            await conn.execute(
                sql.SQL(verb + " ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE CONNECTION LIMIT {} PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(self.connection_limit), sql.Literal(verifier)
                )
            )
            has_db = await (await conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))).fetchone()
            if not has_db:
                await conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(db), sql.Identifier(role)))
            await conn.execute(sql.SQL("REVOKE ALL ON DATABASE {} FROM PUBLIC").format(sql.Identifier(db)))
            await conn.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(sql.Identifier(db), sql.Identifier(role)))
        dsn = f"postgresql://{quote(role)}:{quote(password)}@{self.tenant_host}/{db}"
        return DatastoreCredentials(driver=self.name, endpoint=dsn, username=role, password=password, scope=db,
                                    connection_limit=self.connection_limit)

    async def remove(self, tenant: str) -> None:
        db, role = database_name(tenant), role_name(tenant)
        conn = await self._admin()
        async with conn:
            await conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
            await conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))

    async def close(self) -> None:
        return None
