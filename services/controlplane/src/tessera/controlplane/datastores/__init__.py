"""Datastore drivers: one isolated store per tenant on a shared datastore server.

Each driver gives a tenant its own scope (a NATS KV bucket, a PostgreSQL database, an etcd key
prefix) and credentials that the server itself confines to that scope, so tenant A's credentials
are refused on tenant B's data by PostgreSQL, etcd or nats-server, not by our code. Drivers are
idempotent: ``ensure`` on an existing tenant keeps its credentials, ``remove`` on a missing one is
a no-op, which is what lets the reconciler run them again and again.
"""

from __future__ import annotations

from typing import Protocol

from tessera.controlplane.credentials import DatastoreCredentials


class DatastoreDriver(Protocol):
    name: str

    async def ensure(self, tenant: str, current: DatastoreCredentials | None) -> DatastoreCredentials:
        """Create the tenant's scope and user if missing; return working credentials."""
        ...

    async def remove(self, tenant: str) -> None:
        """Drop the tenant's data, user and grants; harmless if already gone."""
        ...

    async def close(self) -> None: ...


class DatastoreUnavailable(Exception):
    """The datastore server cannot be reached or refused an administrative call (retry later)."""
