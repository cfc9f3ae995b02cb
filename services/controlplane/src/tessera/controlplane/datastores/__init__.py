"""Datastore drivers: one isolated store per tenant on a shared datastore server.

Each driver gives a tenant its own scope (a NATS KV bucket, a PostgreSQL database, an etcd key
prefix) and credentials that the server itself confines to that scope, so tenant A's credentials
are refused on tenant B's data by PostgreSQL, etcd or nats-server, not by our code. Drivers are
idempotent: ``ensure`` on an existing tenant keeps its credentials, ``remove`` on a missing one is
a no-op, which is what lets the reconciler run them again and again.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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


@runtime_checkable
class ReleasesSessions(Protocol):
    """A driver whose datastore keeps what a dead client held (NATS: the ordered consumers of a killed
    kine live on until their inactivity threshold): freed before that client's successor starts."""

    async def release_sessions(self, tenant: str, creds: DatastoreCredentials) -> int:
        """Free what the tenant's stopped datastore client left behind; how many were freed."""
        ...


class DatastoreFault(Exception):
    """What a driver knows is wrong with a tenant's datastore; ``reason`` is the word the tenant's
    status carries (`tessera.controlplane.reconciler`), the message says what is wrong and how to fix
    it. Each driver raises the subclass that fits, so the reconciler never reads a message. The next
    reconcile tries again: what was mended by then (a password set back, space freed) is Ready."""

    reason = "DatastoreError"


class DatastoreUnavailable(DatastoreFault):
    """The datastore server is away: connection refused, a timeout, a server that did not start."""

    reason = "DatastoreUnavailable"


class DatastoreAuthFailed(DatastoreFault):
    """The datastore refused the credentials: the manager's administrator login (a wrong password in
    its setting, a password changed on the server) or a tenant user it does not accept."""

    reason = "DatastoreAuthFailed"


class DatastoreFull(DatastoreFault):
    """The datastore is out of space or connections (etcd's NOSPACE alarm, PostgreSQL's class 53:
    disk full, too many connections)."""

    reason = "DatastoreFull"


class CertificateMismatch(DatastoreFault):
    """TLS to the datastore failed: its certificate is not signed by the CA the manager was given,
    or it refused the manager's client certificate."""

    reason = "CertificateMismatch"


class PortInUse(DatastoreFault):
    """A port of a datastore server the manager runs (dedicated etcd) is taken by another process."""

    reason = "PortInUse"


class BinaryMissing(DatastoreFault):
    """The executable of a datastore server the manager runs (dedicated etcd) is not there."""

    reason = "BinaryMissing"
