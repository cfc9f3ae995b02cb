"""NATS JetStream KV datastore: one bucket per tenant, and a NATS user confined to it.

This is the one module of the manager that talks to nats-py directly (beyond the shared Bus): it
deletes tenant buckets, and it checks the tenant's own connection after each change of credentials.
The bucket itself is created by the tenant's kine, as the tenant, with kine's own bucket
configuration: kine refuses a bucket that exists with any other configuration, so the manager
does not create it first (it may create and update that one stream and no other).

Each tenant is its own NATS account (`tessera.shared.identities.tenant_account`), written to a
file that nats-server includes inside its ``accounts`` block (config-file authorization); after
each change the server is told to reload (SIGHUP to the pid in its pid file) and the manager waits
until the server really accepts the tenant's user. The account's JetStream holds the tenant's
bucket within the account's limits (storage, streams, consumers; connections and payload size
too); it sees nothing of the platform's account but the claim API and its own events, imported
with its name written in by the platform. The file is the durable record of which tenants exist
(reconcile reads it back); it holds bcrypt hashes, the passwords are in the tenant's credentials.
Without an auth file (the embedded development server has no authorization), tenants get a bucket
but no credentials of their own, and the driver says so in the credentials it returns.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.js.errors import BucketNotFoundError, NotFoundError

from tessera.controlplane.credentials import DatastoreCredentials
from tessera.controlplane.datastores import DatastoreAuthFailed, DatastoreUnavailable
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared import identities
from tessera.shared.bus import Bus

log = logging.getLogger("tessera.controlplane.natskv")

RELOAD_TIMEOUT = 10.0


def bucket_name(tenant: str) -> str:
    return f"tenant-{tenant}"


def inbox_prefix(tenant: str) -> str:
    return f"_INBOX_{tenant}"


class UsersFile:
    """The tenants' accounts file nats-server includes: read back, rewritten atomically, reload
    signalled. Keys are tenant names, values their account blocks
    (`tessera.shared.identities.tenant_account`: a bcrypt hash, never the password).

    ``load``/``store`` are what the driver calls; a list kept elsewhere (on Kubernetes, a Secret
    the NATS pods mount: `tessera.controlplane.kube.UsersSecret`) offers the same two, with the
    same text."""

    HEADER = "# Written by tessera-controlplane: tenant accounts. Do not edit; changes are overwritten.\n"
    # Whether ``store`` returns only once the server has loaded the new list (the driver then
    # checks the user is accepted or refused before going on).
    confirm = True

    def __init__(self, path: Path, pid_file: Path | None) -> None:
        self.path = path
        self.pid_file = pid_file
        self.lock = asyncio.Lock()

    def parse(self, text: str) -> dict[str, dict]:
        return identities.parse_tenant_accounts(text)

    def render(self, tenants: dict[str, dict]) -> str:
        return self.HEADER + identities.render_tenant_accounts(tenants)

    def read(self) -> dict[str, dict]:
        try:
            return self.parse(self.path.read_text())
        except FileNotFoundError:
            return {}

    def write(self, tenants: dict[str, dict]) -> None:
        body = self.render(tenants)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".users-")
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)

    async def load(self) -> dict[str, dict]:
        return self.read()

    async def store(self, tenants: dict[str, dict]) -> None:
        self.write(tenants)
        self.reload()

    async def close(self) -> None:
        return None

    def reload(self) -> None:
        if self.pid_file is None:
            return
        try:
            pid = int(self.pid_file.read_text().strip())
            os.kill(pid, signal.SIGHUP)
        except (OSError, ValueError) as exc:
            raise DatastoreUnavailable(f"cannot signal nats-server to reload ({self.pid_file}): {exc}") from exc


def account_is(account: dict | None, tenant: str, password: str) -> bool:
    """Whether ``account`` is the one `tenant_account` would write for this password (the hash's
    salt differs on every call, so the password is checked against it, the rest compared)."""
    if not account or not password:
        return False
    hashed = account["users"][0]["password"]
    return identities.password_matches(password, hashed) and account == identities.tenant_account(tenant, hashed)


class NatsKvDriver:
    name = "nats"

    def __init__(self, bus: Bus, tenant_url: str, users: UsersFile | None) -> None:
        self.bus = bus
        self.tenant_url = tenant_url
        self.users = users

    @classmethod
    def from_settings(cls, bus: Bus, settings: ControlPlaneSettings) -> "NatsKvDriver":
        parts = urlsplit(bus.settings.servers[0])  # a cluster: its first member
        if parts.hostname is None:
            raise ValueError(f"the NATS URL {parts.scheme}://{parts.path} names no host: set TESSERA_NATS_URL "
                             "to nats://<host>:<port> (or TESSERA_CP_NATS_TENANT_URL to the tenants' URL)")
        bare = urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))
        users: UsersFile | None = None  # (UsersSecret is one)
        if settings.nats_users_secret:
            from tessera.controlplane.kube import UsersSecret

            users = UsersSecret(settings.nats_users_secret)
        elif settings.nats_auth_file:
            users = UsersFile(
                Path(settings.nats_auth_file),
                Path(settings.nats_pid_file) if settings.nats_pid_file else None,
            )
        return cls(bus, settings.nats_tenant_url or bare, users)

    async def ensure(self, tenant: str, current: DatastoreCredentials | None) -> DatastoreCredentials:
        bucket = bucket_name(tenant)
        replicas = self.bus.settings.replicas
        if self.users is None:
            return DatastoreCredentials(
                driver=self.name, endpoint=self.tenant_url, username="", password="", scope=bucket,
                inbox_prefix=inbox_prefix(tenant), replicas=replicas,
            )
        user = identities.tenant_user(tenant)
        password = current.password if current and current.driver == self.name and current.username == user else ""
        async with self.users.lock:
            accounts = await self.users.load()
            if not account_is(accounts.get(tenant), tenant, password):
                # A password the manager no longer holds cannot be read back from its hash: a new one.
                password = password or secrets.token_urlsafe(24)
                accounts[tenant] = identities.tenant_account(tenant, identities.hash_password(password))
                await self.users.store(accounts)
                if self.users.confirm:
                    await self._wait_for(user, password, tenant, accepted=True)
        return DatastoreCredentials(
            driver=self.name, endpoint=self.tenant_url, username=user, password=password,
            scope=bucket, inbox_prefix=inbox_prefix(tenant), replicas=replicas,
        )

    async def remove(self, tenant: str) -> None:
        if self.users is None:
            try:
                await self.bus.delete_bucket(bucket_name(tenant))
            except (BucketNotFoundError, NotFoundError):
                pass
            return
        user = identities.tenant_user(tenant)
        async with self.users.lock:
            accounts = await self.users.load()
            if tenant not in accounts:
                return
            if self.users.confirm:
                # The bucket is in the tenant's own account, out of the platform's reach: the manager
                # becomes the tenant for a moment (a password only it knows) to delete it, so a tenant
                # created later under the same name starts empty.
                password = secrets.token_urlsafe(24)
                accounts[tenant] = identities.tenant_account(tenant, identities.hash_password(password))
                await self.users.store(accounts)
                await self._wait_for(user, password, tenant, accepted=True)
                await delete_own_bucket(self.tenant_url, user, password, tenant)
            del accounts[tenant]
            await self.users.store(accounts)
            if self.users.confirm:
                await self._wait_for(user, password, tenant, accepted=False)

    async def release_sessions(self, tenant: str, creds: DatastoreCredentials) -> int:
        return await release_consumers(creds, tenant)

    async def close(self) -> None:
        if self.users is not None:
            await self.users.close()

    async def _wait_for(self, user: str, password: str, tenant: str, *, accepted: bool) -> None:
        """Poll until nats-server has reloaded: the user connects (accepted) or is refused."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RELOAD_TIMEOUT
        while True:
            error = await connect_error(self.tenant_url, user, password, inbox_prefix(tenant))
            if (error is None) == accepted:
                return
            if loop.time() > deadline:
                break
            await asyncio.sleep(0.01)
        if not accepted:
            raise DatastoreUnavailable(f"nats-server at {self.tenant_url} still accepts user {user} "
                                       f"{RELOAD_TIMEOUT:.0f}s after its account was removed: {RELOAD_HINT}")
        if refused_login(error):
            where = getattr(self.users, "path", None) or "the users Secret (TESSERA_CP_NATS_USERS_SECRET)"
            raise DatastoreAuthFailed(f"nats-server at {self.tenant_url} refuses tenant user {user} ({error}) "
                                      f"{RELOAD_TIMEOUT:.0f}s after its account was written to {where}: "
                                      f"{RELOAD_HINT}")
        raise DatastoreUnavailable(f"cannot reach nats-server at {self.tenant_url} as tenant user {user} "
                                   f"({type(error).__name__}: {error}): TESSERA_CP_NATS_TENANT_URL (else TESSERA_NATS_URL) must name "
                                   "where the tenants reach it")


RELOAD_HINT = ("the server's configuration must include that file (TESSERA_CP_NATS_AUTH_FILE) inside its "
               "accounts block, and TESSERA_CP_NATS_PID_FILE must be its pid file (the manager signals it to reload)")


def refused_login(error: BaseException | None) -> bool:
    """Whether nats-server answered and refused the user (not: could not be reached)."""
    return isinstance(error, nats.errors.AuthorizationError) or "authorization" in str(error).lower()


async def connect_ok(url: str, user: str, password: str, inbox: str) -> bool:
    """Whether nats-server accepts these credentials right now."""
    return await connect_error(url, user, password, inbox) is None


async def connect_error(url: str, user: str, password: str, inbox: str) -> BaseException | None:
    """None if nats-server accepts these credentials right now; else why not (the server's own
    refusal where it sent one, which nats-py reports to the error callback)."""
    said: list[Exception] = []

    async def heard(exc: Exception) -> None:
        said.append(exc)

    nc = NatsClient()
    try:
        await nc.connect(
            servers=[url], user=user, password=password, inbox_prefix=inbox, allow_reconnect=False,
            connect_timeout=2, error_cb=heard, max_reconnect_attempts=1,
        )
        return None
    except Exception as exc:
        return next((e for e in said if refused_login(e)), said[0] if said else exc)  # the cause, not NoServers
    finally:
        await _close_quietly(nc)


async def delete_own_bucket(url: str, user: str, password: str, tenant: str) -> None:
    nc = await nats.connect(servers=[url], user=user, password=password, inbox_prefix=inbox_prefix(tenant),
                            allow_reconnect=False, connect_timeout=3)
    try:
        await nc.jetstream(timeout=5).delete_key_value(bucket_name(tenant))
    except (BucketNotFoundError, NotFoundError):
        pass
    finally:
        await nc.close()


async def release_consumers(creds: DatastoreCredentials, tenant: str) -> int:
    """Delete every consumer of the tenant's bucket, as the tenant; how many. Only while its kine is
    stopped: kine watches the bucket through ordered consumers that nats.go leaves to the server to
    expire after five minutes of inactivity, so each kine that was killed or put to sleep leaves its
    set behind, and two or three restarts in a row fill the account's ``max_consumers`` (the next kine
    then fails with "maximum consumers limit reached", err_code 10026, and each failed start adds
    nothing but delay)."""
    nc = await connect_tenant(creds)
    try:
        js = nc.jetstream(timeout=5)
        stream = f"KV_{bucket_name(tenant)}"
        try:
            found = await js.consumers_info(stream)
        except NotFoundError:  # no bucket yet: kine has not made it
            return 0
        for consumer in found:
            try:
                await js.delete_consumer(stream, consumer.name)
            except NotFoundError:  # (it expired meanwhile)
                pass
        return len(found)
    finally:
        await _close_quietly(nc)


async def _close_quietly(nc: NatsClient) -> None:
    # nats-py leaves the socket of a refused connection open; close the transport ourselves.
    try:
        await nc.close()
    except Exception:
        pass
    transport = getattr(nc, "_transport", None)
    if transport is not None:
        transport.close()
        await asyncio.sleep(0)


async def connect_tenant(creds: DatastoreCredentials, **options):
    """A nats-py connection as the tenant (what the tenant's control plane does); for tools and tests."""
    return await nats.connect(
        servers=[creds.endpoint], user=creds.username or None, password=creds.password or None,
        inbox_prefix=creds.inbox_prefix or "_INBOX", allow_reconnect=False, connect_timeout=3, **options,
    )
