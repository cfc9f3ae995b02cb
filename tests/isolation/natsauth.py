"""A nats-server with the platform's generated authorization, and clients that record refusals.

The isolation tests start the server from exactly the config `tessera.shared.identities` writes
(one user per service, the operator, a tenant account per tenant) and probe it with plain nats-py
clients; a refused publish or subscribe is reported by the server as a permissions violation on
the connection's error callback, which `Probe` records.
"""

from __future__ import annotations

from pathlib import Path

import nats

from tessera.shared import identities
from tessera.shared.natsserver import NatsServer

from kit import eventually

NODES = ["gpu-0", "gpu-1"]
TENANTS = ("alpha", "beta")
# Small enough that a flood reaches it in a second; the platform account is unlimited.
FLOOD_LIMITS = identities.TenantLimits(max_file=512 * 1024, max_mem=256 * 1024, max_streams=2, max_consumers=4,
                                       max_connections=4, max_payload=64 * 1024)


def password(user: str) -> str:
    return f"pw-{user}"


def secured_server(workdir: Path) -> NatsServer:
    workdir.mkdir(parents=True, exist_ok=True)
    names = identities.platform_user_names(NODES)
    users = identities.platform_users({n: identities.hash_password(password(n)) for n in names}, NODES)
    accounts = {t: identities.tenant_account(t, identities.hash_password(password(f"tenant-{t}")), FLOOD_LIMITS)
                for t in TENANTS}
    (workdir / "tenants.conf").write_text(identities.render_tenant_accounts(accounts))
    conf = workdir / "nats.conf"
    conf.write_text(identities.server_config(users, "tenants.conf", pid_file=str(workdir / "nats.pid")))
    return NatsServer(workdir / "store", config_file=conf)


class Probe:
    """One connection as ``user``; ``violations`` are the server's refusals it was told about."""

    def __init__(self, nc, user: str) -> None:
        self.nc = nc
        self.user = user
        self.violations: list[str] = []

    @classmethod
    async def connect(cls, url: str, user: str) -> "Probe":
        probe = cls(None, user)

        async def on_error(exc: Exception) -> None:
            probe.violations.append(str(exc).lower())

        probe.nc = await nats.connect(
            servers=[url], user=user, password=password(user), inbox_prefix=identities.inbox_prefix(user),
            error_cb=on_error, allow_reconnect=False, connect_timeout=3,
        )
        return probe

    async def refused(self, subject: str, *, action: str = "publish", timeout: float = 5.0) -> None:
        """Publish to (or subscribe to, or request on) ``subject`` and wait for the server's refusal."""
        before = len(self.violations)
        if action == "publish":
            await self.nc.publish(subject, b"{}")
        elif action == "subscribe":
            await self.nc.subscribe(subject)
        else:
            try:
                await self.nc.request(subject, b"{}", timeout=1)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                pass
        await self.nc.flush()
        await eventually(lambda: any("permissions violation" in v and subject.lower() in v
                                     for v in self.violations[before:]),
                         timeout=timeout, every=0.02, what=f"{self.user} refused {action} on {subject}")

    async def close(self) -> None:
        await self.nc.close()
