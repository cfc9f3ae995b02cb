"""PostgreSQL datastore: a database and a login role per tenant on a shared server.

Isolation is PostgreSQL's own: the tenant's role owns its database, CONNECT on that database is
revoked from PUBLIC, so every other tenant's role is refused at connection time by the server. The
control plane reaches it the way Kamaji's kine does, with a postgresql:// DSN for its own role.
Every statement is idempotent (IF EXISTS / catalogue checks) so reconcile may run it forever.

Each tenant role carries a CONNECTION LIMIT, so one tenant (a kine with an unbounded pool, a flood of
its own control planes) cannot take every connection of the shared server: PostgreSQL refuses its
next one with "too many connections for role" while the others still connect. A role created before
the limit existed, or with another, gets it on the next reconcile (ALTER ROLE).

A full disk has no alarm to read (etcd's NOSPACE): PostgreSQL says so only to a write that needs
new storage (SQLSTATE 53100), and an API server's reads go on working. So each ensure asks, as the
tenant's role in its own database (where kine writes), for one new page in a transaction it rolls
back: a full tablespace is ``DatastoreFull`` before the tenant's writes fail, and nothing is left.
"""

from __future__ import annotations

import secrets
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from tessera.controlplane.credentials import DatastoreCredentials
from tessera.controlplane.datastores import (CertificateMismatch, DatastoreAuthFailed, DatastoreFault, DatastoreFull,
                                             DatastoreUnavailable)


def database_name(tenant: str) -> str:
    return "tessera_" + tenant.replace("-", "_")


def role_name(tenant: str) -> str:
    return "tessera_t_" + tenant.replace("-", "_")


def fault(exc: psycopg.Error, server: str) -> DatastoreFault:
    """What PostgreSQL's refusal means, by its SQLSTATE where the server sent one (a refused
    connection has none: libpq's text says it)."""
    text = " ".join(str(exc).split())
    state = exc.sqlstate or ""
    if state.startswith("28") or "password authentication failed" in text or "no pg_hba.conf entry" in text:
        return DatastoreAuthFailed(f"PostgreSQL at {server} refuses the manager's administrator login ({text}): set "
                                   "TESSERA_CP_POSTGRES_DSN to a role and password the server accepts, or set that "
                                   "role's password back")
    # (a login to a database whose relation-cache file must be written again fails with FATAL "could
    # not write init file" and no SQLSTATE of class 53 when the disk under that database is full)
    if state == "53100" or "No space left on device" in text or "could not write init file" in text:
        return DatastoreFull(f"PostgreSQL at {server} is out of disk ({text}): free space on the volume of the "
                             "tenant's database (its tablespace or the data directory) or grow it; the tenant is "
                             "Ready again on the next resync")
    if state.startswith("53") or "too many connections" in text or "connection slots" in text:
        return DatastoreFull(f"PostgreSQL at {server} is full ({text}): free connections (close idle clients, lower "
                             "TESSERA_CP_POSTGRES_CONNECTION_LIMIT) or raise the server's max_connections")
    if "does not match host name" in text:
        return CertificateMismatch(f"TLS to PostgreSQL at {server} failed ({text}): the server's certificate is not "
                                   "for the host TESSERA_CP_POSTGRES_DSN names: connect by a name the certificate "
                                   "carries, or issue the server a certificate with this host among its names")
    if "certificate" in text or "SSL" in text:
        return CertificateMismatch(f"TLS to PostgreSQL at {server} failed ({text}): the sslrootcert in "
                                   "TESSERA_CP_POSTGRES_DSN must be the CA that signed the server's certificate")
    if isinstance(exc, psycopg.OperationalError):
        return DatastoreUnavailable(f"cannot reach PostgreSQL at {server} ({text}): start it, or set "
                                    "TESSERA_CP_POSTGRES_DSN to where it answers")
    return DatastoreFault(f"PostgreSQL at {server} refused the manager's statement ({text})")


class PostgresDriver:
    name = "postgres"

    def __init__(self, admin_dsn: str, tenant_host: str, connection_limit: int = 32) -> None:
        if connection_limit < 1:
            raise ValueError(f"connection_limit={connection_limit}: a tenant role needs at least 1 connection")
        self.admin_dsn = admin_dsn
        self.tenant_host = tenant_host  # host:port the tenants' control planes use
        self.connection_limit = connection_limit  # per tenant role, enforced by PostgreSQL
        where = conninfo_to_dict(admin_dsn)
        self.server = f"{where.get('host', 'localhost')}:{where.get('port', 5432)}"  # (no password in messages)

    async def _admin(self) -> psycopg.AsyncConnection:
        try:
            return await psycopg.AsyncConnection.connect(self.admin_dsn, autocommit=True, connect_timeout=5)
        except psycopg.Error as exc:
            raise fault(exc, self.server) from exc

    async def ensure(self, tenant: str, current: DatastoreCredentials | None) -> DatastoreCredentials:
        try:
            return await self._ensure(tenant, current)
        except psycopg.Error as exc:
            raise fault(exc, self.server) from exc

    async def _ensure(self, tenant: str, current: DatastoreCredentials | None) -> DatastoreCredentials:
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
        await self._room(conninfo_to_dict(self.admin_dsn), db, role, password)
        return DatastoreCredentials(driver=self.name, endpoint=dsn, username=role, password=password, scope=db,
                                    connection_limit=self.connection_limit)

    async def _room(self, admin: dict[str, Any], db: str, role: str, password: str) -> None:
        """One new page in the tenant's database, as its role, rolled back (a full disk is 53100)."""
        where = {k: v for k, v in admin.items() if k not in ("user", "password", "passfile")}
        where.update(dbname=db, user=role, password=password)
        where.setdefault("connect_timeout", 5)
        async with await psycopg.AsyncConnection.connect(**where) as conn:
            async with conn.transaction(force_rollback=True):
                await conn.execute("CREATE TABLE tessera_room (page bytea)")
                await conn.execute("INSERT INTO tessera_room VALUES (%s)", (secrets.token_bytes(64),))

    async def remove(self, tenant: str) -> None:
        db, role = database_name(tenant), role_name(tenant)
        conn = await self._admin()
        async with conn:
            try:
                await conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
                await conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
            except psycopg.Error as exc:
                raise fault(exc, self.server) from exc

    async def close(self) -> None:
        return None
