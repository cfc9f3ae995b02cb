"""NATS JetStream KV datastore: one bucket per tenant, and a NATS user confined to it.

This is the one module of the manager that talks to nats-py directly (beyond the shared Bus): it
deletes tenant buckets, and it checks the tenant's own connection after each change of credentials.
The bucket itself is created by the tenant's kine, as the tenant, with kine's own bucket
configuration: kine refuses a bucket that exists with any other configuration, so the manager
does not create it first (it may create and update that one stream and no other).

Tenant users are written to a users file that nats-server includes inside its ``authorization``
block (config-file authorization); after each change the server is told to reload (SIGHUP to the
pid in its pid file) and the manager waits until the server really accepts (or refuses) the user.
Each tenant user may touch only:
- its bucket: ``$KV.tenant-<t>.>`` and the JetStream API calls scoped to stream ``KV_tenant-<t>``
  (creating and updating that stream included);
- its claim subjects (publish ``requested`` / ``release``, subscribe to all of them) and its tenant
  events (subscribe only: those are the manager's to publish);
- replies under its own inbox prefix ``_INBOX_<t>``, so it cannot snoop on other clients' replies.
The file itself is the durable record of which users exist (reconcile reads it back); the platform
user is the one the manager itself connects as, with full permissions.
Without an auth file (the embedded development server has no authorization), tenants get a bucket
but no credentials of their own, and the driver says so in the credentials it returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import nats
from nats.aio.client import Client as NatsClient
from nats.js.errors import BucketNotFoundError, NotFoundError

from tessera.controlplane.credentials import DatastoreCredentials
from tessera.controlplane.datastores import DatastoreUnavailable
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared import subjects
from tessera.shared.bus import Bus

log = logging.getLogger("tessera.controlplane.natskv")

RELOAD_TIMEOUT = 10.0


def bucket_name(tenant: str) -> str:
    return f"tenant-{tenant}"


def inbox_prefix(tenant: str) -> str:
    return f"_INBOX_{tenant}"


def tenant_permissions(tenant: str) -> dict:
    """What nats-server lets tenant ``tenant`` publish and subscribe to; nothing else."""
    stream = f"KV_{bucket_name(tenant)}"
    js = "$JS.API"
    claims = f"{subjects.CLAIMS}.{tenant}"
    return {
        "publish": {
            "allow": [
                f"$KV.{bucket_name(tenant)}.>",
                f"{js}.STREAM.CREATE.{stream}",
                f"{js}.STREAM.UPDATE.{stream}",
                f"{js}.STREAM.INFO.{stream}",
                f"{js}.STREAM.MSG.GET.{stream}",
                f"{js}.DIRECT.GET.{stream}",
                f"{js}.DIRECT.GET.{stream}.>",
                f"{js}.CONSUMER.CREATE.{stream}",
                f"{js}.CONSUMER.CREATE.{stream}.>",
                f"{js}.CONSUMER.DELETE.{stream}.>",
                f"{js}.CONSUMER.INFO.{stream}.>",
                f"{js}.CONSUMER.MSG.NEXT.{stream}.>",
                f"$JS.ACK.{stream}.>",
                f"$JS.FC.{stream}.>",
                # (claims it publishes name no node: placement decides one and passes releases on)
                f"{claims}.*.requested.{subjects.NO_NODE}",
                f"{claims}.*.release.{subjects.NO_NODE}",
            ]
        },
        "subscribe": {
            "allow": [
                f"{inbox_prefix(tenant)}.>",
                f"{claims}.>",
                f"{subjects.TENANTS}.{tenant}.>",
            ]
        },
    }


class UsersFile:
    """The users file nats-server includes: read back, rewritten atomically, reload signalled.

    ``load``/``store`` are what the driver calls; a users list kept elsewhere (on Kubernetes, a
    Secret the NATS pods mount: `tessera.controlplane.kube.UsersSecret`) offers the same two, with
    the same text."""

    HEADER = "# Written by tessera-controlplane: tenant users. Do not edit; changes are overwritten.\n"
    # Whether ``store`` returns only once the server has loaded the new list (the driver then
    # checks the user is accepted or refused before going on).
    confirm = True

    def __init__(self, path: Path, pid_file: Path | None, platform_user: str, platform_password: str) -> None:
        self.path = path
        self.pid_file = pid_file
        self.platform_user = platform_user
        self.platform_password = platform_password
        self.lock = asyncio.Lock()

    def parse(self, text: str) -> dict[str, dict]:
        """user -> entry for the tenant users in ``text`` (the platform user is not listed)."""
        start = text.find("[")
        if start < 0:
            return {}
        users = json.loads(text[start:])
        return {u["user"]: u for u in users if u.get("user") != self.platform_user}

    def render(self, tenants: dict[str, dict]) -> str:
        users = [{"user": self.platform_user, "password": self.platform_password}]
        users += [tenants[k] for k in sorted(tenants)]
        return self.HEADER + "users: " + json.dumps(users, indent=1) + "\n"

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


class NatsKvDriver:
    name = "nats"

    def __init__(self, bus: Bus, tenant_url: str, users: UsersFile | None) -> None:
        self.bus = bus
        self.tenant_url = tenant_url
        self.users = users

    @classmethod
    def from_settings(cls, bus: Bus, settings: ControlPlaneSettings) -> "NatsKvDriver":
        parts = urlsplit(bus.settings.url)
        bare = urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))
        users = None
        if settings.nats_auth_file or settings.nats_users_secret:
            if not parts.username:
                raise ValueError(
                    "TESSERA_CP_NATS_AUTH_FILE or TESSERA_CP_NATS_USERS_SECRET is set but TESSERA_NATS_URL"
                    " carries no user: the platform user (nats://user:password@host:port) is written to the"
                    " users list too"
                )
        if settings.nats_users_secret:
            from tessera.controlplane.kube import UsersSecret

            users = UsersSecret(settings.nats_users_secret, parts.username, parts.password or "")
        elif settings.nats_auth_file:
            users = UsersFile(
                Path(settings.nats_auth_file),
                Path(settings.nats_pid_file) if settings.nats_pid_file else None,
                parts.username,
                parts.password or "",
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
        user = f"tenant-{tenant}"
        password = current.password if current and current.driver == self.name and current.username == user else ""
        async with self.users.lock:
            users = await self.users.load()
            entry = users.get(user)
            wanted = {"user": user, "password": password or (entry or {}).get("password") or secrets.token_urlsafe(24),
                      "permissions": tenant_permissions(tenant)}
            if entry != wanted:
                users[user] = wanted
                await self.users.store(users)
                if self.users.confirm:
                    await self._wait_for(user, wanted["password"], tenant, accepted=True)
        return DatastoreCredentials(
            driver=self.name, endpoint=self.tenant_url, username=user, password=wanted["password"],
            scope=bucket, inbox_prefix=inbox_prefix(tenant), replicas=replicas,
        )

    async def remove(self, tenant: str) -> None:
        if self.users is not None:
            user = f"tenant-{tenant}"
            async with self.users.lock:
                users = await self.users.load()
                entry = users.pop(user, None)
                if entry is not None:
                    await self.users.store(users)
                    if self.users.confirm:
                        await self._wait_for(user, entry["password"], tenant, accepted=False)
        try:
            await self.bus.js.delete_key_value(bucket_name(tenant))
        except (BucketNotFoundError, NotFoundError):
            pass

    async def close(self) -> None:
        if self.users is not None:
            await self.users.close()

    async def _wait_for(self, user: str, password: str, tenant: str, *, accepted: bool) -> None:
        """Poll until nats-server has reloaded: the user connects (accepted) or is refused."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RELOAD_TIMEOUT
        while True:
            ok = await connect_ok(self.tenant_url, user, password, inbox_prefix(tenant))
            if ok == accepted:
                return
            if loop.time() > deadline:
                state = "accept" if accepted else "refuse"
                raise DatastoreUnavailable(f"nats-server did not {state} user {user} after reload")
            await asyncio.sleep(0.01)


async def connect_ok(url: str, user: str, password: str, inbox: str) -> bool:
    """Whether nats-server accepts these credentials right now."""
    async def quiet(_: Exception) -> None:
        return None

    nc = NatsClient()
    try:
        await nc.connect(
            servers=[url], user=user, password=password, inbox_prefix=inbox, allow_reconnect=False,
            connect_timeout=2, error_cb=quiet, max_reconnect_attempts=1,
        )
        return True
    except Exception:
        return False
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
