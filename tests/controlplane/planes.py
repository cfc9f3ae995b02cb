"""Real tenant control planes for the tests: a manager with ``TESSERA_CP_HOST=local`` on a real
datastore (etcd over TLS with client-certificate auth, PostgreSQL, or NATS with per-tenant
accounts), running kube-apiserver, kube-controller-manager, kube-scheduler and kine as processes.

``Planes`` is what a test holds: create a tenant and wait until it is Ready, its kubeconfig as a
file, kubectl as the tenant, and a look at what a deleted tenant left behind.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ipaddress
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kit import eventually, open_bus
from kit.kubecluster import ROOT, Pki, apply, ensure_binaries, manifests, service_identity, terminate
from tessera.controlplane import processes
from tessera.controlplane.processes import port_free
from tessera.controlplane.app import Manager
from tessera.controlplane.credentials import DatastoreCredentials, TenantSecrets
from tessera.controlplane.datastores import etcd as etcd_store
from tessera.controlplane.datastores import natskv, postgres as pg_store
from tessera.controlplane.datastores.etcd import EtcdCa, EtcdClient, tls_context
from tessera.controlplane.datastores.etcd_dedicated import DedicatedEtcdDriver
from tessera.controlplane.kube import KubeHost
from tessera.controlplane.localkubelet import LocalKubelet
from tessera.controlplane.localplanes import LocalControlPlanes
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.controlplane.spec import TenantControlPlane, parse_spec
from nats.js.api import ConsumerConfig, DeliverPolicy

from tessera.shared import api, identities, subjects
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.kubeapi import KubeApi
from tessera.shared.natsserver import NatsServer, free_port, wait_for_port
from tessera.shared.settings import BusSettings

DATASTORES = ("etcd", "postgres", "nats")
ETCD_ROOT_PASSWORD = "root-secret"
READY_TIMEOUT = 300.0  # a cold kube-apiserver on two loaded cores


def plane_binaries() -> tuple[Path, Path]:
    """(kube binaries, kine) directories: built once, cached (`make kube-binaries`, `make kine`)."""
    kube = ensure_binaries(("kube-apiserver", "kube-controller-manager", "kube-scheduler"), "v1.36")
    done = subprocess.run([str(ROOT / "tools" / "kube" / "build-kine.sh")], capture_output=True, text=True,
                          timeout=3600)
    if done.returncode:
        pytest.fail(f"kine did not build (`make kine`): {done.stderr[-2000:]}")
    return kube, Path(done.stdout.strip().splitlines()[-1])


@dataclass
class EtcdTls:
    endpoint: str
    ca_file: Path
    ca_key_file: Path

    def gateway(self) -> EtcdClient:
        """The JSON gateway, as the manager reaches it (root logs in with its password)."""
        ca = EtcdCa(str(self.ca_file), str(self.ca_key_file))
        return EtcdClient(self.endpoint, tls=tls_context(ca.cert, *ca.gateway_client()))


def start_etcd_tls(directory: Path):
    """A real etcd serving TLS with ``--client-cert-auth``: a client's certificate CN is its user."""
    pki = Pki(directory / "pki")
    crt, key = _etcd_serving(pki)
    client, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{client}"
    log = open(directory / "etcd.log", "wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "etcd"), "--name", "t", "--data-dir", str(directory / "data"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--cert-file", str(crt), "--key-file", str(key), "--client-cert-auth", "--trusted-ca-file", str(pki.ca_file),
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--unsafe-no-fsync", "--log-level", "warn"],
        stdout=log, stderr=log, start_new_session=True)
    log.close()
    wait_for_port(client, 30, proc)
    return EtcdTls(url, pki.ca_file, pki.ca_key_file), proc


def _etcd_serving(pki: Pki) -> tuple[Path, Path]:
    """etcd's certificate: it serves with it and its gateway dials etcd's own gRPC with it as a
    client, so it carries both usages (as kubeadm's etcd server certificate does)."""
    ca_key = serialization.load_pem_private_key(pki.ca_key_file.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "etcd")]))
            .issuer_name(pki.ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    crt_file, key_file = pki.dir / "etcd-server.crt", pki.dir / "etcd-server.key"
    crt_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return crt_file, key_file


async def etcdctl(creds: DatastoreCredentials, directory: Path, *args: str) -> subprocess.CompletedProcess:
    """etcd's own client, logged in as the tenant's API server is: its client certificate (the CN is
    its etcd user)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in (("ca.crt", creds.ca_cert), ("client.crt", creds.client_cert), ("client.key", creds.client_key)):
        (directory / name).write_text(text)
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "etcdctl"), f"--endpoints={creds.endpoint}",
        f"--cacert={directory / 'ca.crt'}", f"--cert={directory / 'client.crt'}", f"--key={directory / 'client.key'}",
        "--command-timeout=10s", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


PLATFORM = ("platform", "platform-secret")  # the manager's NATS user


def secured_nats_server(directory: Path) -> tuple[NatsServer, Path, Path]:
    """The manager's nats-server: an operator-only config with a users file the manager writes each
    tenant's account into; (server, users file, pid file)."""
    directory.mkdir(parents=True, exist_ok=True)
    users = directory / "users.conf"
    natskv.UsersFile(users, None).write({})
    conf = directory / "nats.conf"
    conf.write_text(identities.operator_only_config(*PLATFORM, "users.conf", pid_file=str(directory / "nats.pid")))
    return NatsServer(directory / "store", config_file=conf).start(), users, directory / "nats.pid"


class Planes:
    """A manager running tenants' control planes locally, on one datastore."""

    def __init__(self, manager: Manager, bus, driver: str, directory: Path, kube_bin: Path, etcd: EtcdTls | None,
                 postgres_admin: str) -> None:
        self.manager = manager
        self.bus = bus
        self.driver = driver
        self.directory = directory
        self.kube_bin = kube_bin
        self.etcd = etcd
        self.postgres_admin = postgres_admin

    @property
    def host(self) -> LocalControlPlanes:
        """Where the tenants' processes run (in Kubernetes mode, the part of the kubelet's the manager plays)."""
        host = self.manager.host
        if isinstance(host, LocalKubelet):
            return host.planes
        assert isinstance(host, LocalControlPlanes)
        return host

    async def record(self, name: str) -> TenantControlPlane | None:
        stored = await self.manager.store.controlplanes.get(name)
        return stored.value if stored else None

    async def create(self, name: str) -> TenantControlPlane:
        await self.manager.api.apply(name, parse_spec({"datastore": {"driver": self.driver}}))
        return await self.wait_phase(name, "Ready")

    async def wait_phase(self, name: str, phase: str, reason: str | None = None,
                         timeout: float = READY_TIMEOUT) -> TenantControlPlane:
        async def reached():
            record = await self.record(name)
            if record is not None and record.status.phase == phase and reason in (None, record.status.reason):
                return record
            return None

        try:
            return await eventually(reached, timeout=timeout, every=0.25, what=f"tenant {name} {phase} {reason or ''}")
        except AssertionError:
            record = await self.record(name)
            logs = {p: self.host.log_tail(name, p, 15) for p in self.host.pids(name)}
            raise AssertionError(f"tenant {name} not {phase}: {record.status if record else None}; logs: {logs}") from None

    async def reasons(self, name: str) -> list[str]:
        """Every reason the tenant's status has had, in order (its `updated` events on the bus)."""
        sub = await self.bus.pull_subscribe(subjects.tenant(name, "updated"), stream=subjects.STREAM_TENANTS,
                                            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        seen: list[str] = []
        try:
            while True:
                try:
                    batch = await sub.fetch(100, timeout=1)
                except TimeoutError:
                    return seen
                seen += [json.loads(m.data)["reason"] for m in batch]
        finally:
            await sub.unsubscribe()

    async def call(self, verb: str, name: str) -> api.Reply:
        handler = self.manager.api.handlers()[verb]
        return api.decode_reply(await handler(json.dumps({"name": name}).encode(), {}))

    async def credentials(self, name: str) -> DatastoreCredentials:
        stored = await self.manager.store.secrets.get(name)
        assert stored is not None and stored.value.datastore is not None
        return stored.value.datastore

    async def secrets(self, name: str) -> TenantSecrets:
        stored = await self.manager.store.secrets.get(name)
        assert stored is not None
        return stored.value

    async def pki(self, name: str) -> dict[str, str]:
        return (await self.secrets(name)).pki

    async def kubeconfig(self, name: str, directory: Path) -> Path:
        """What `tessera tenant kubeconfig <name>` prints, as a file (through the manager's API)."""
        decoded = await self.call("kubeconfig", name)
        assert decoded.ok, decoded.error
        path = directory / f"{name}.kubeconfig"
        path.write_text(decoded.result["kubeconfig"])
        return path

    async def kubectl(self, kubeconfig: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        kubectl = ensure_binaries(("kubectl",), "v1.36") / "kubectl"
        proc = await asyncio.create_subprocess_exec(
            str(kubectl), f"--kubeconfig={kubeconfig}", "--request-timeout=20s", *args,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), 60)
        return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())

    # --- what a deleted tenant leaves behind -------------------------------------------------------

    async def leftovers(self, name: str, ports: list[int], creds: DatastoreCredentials) -> dict[str, object]:
        """Everything of ``name``'s that still exists, by kind (empty lists when nothing is left)."""
        home = self.host.home(name)
        left: dict[str, object] = {
            "processes": processes_marked(f"{home}:"),
            "ports": [p for p in ports if not port_free(p)],
            "files": [str(home)] if home.exists() else [],
        }
        if self.driver == "postgres":
            conn = await psycopg.AsyncConnection.connect(self.postgres_admin, autocommit=True)
            async with conn:
                dbs = await (await conn.execute("SELECT datname FROM pg_database WHERE datname = %s",
                                                (pg_store.database_name(name),))).fetchall()
                roles = await (await conn.execute("SELECT rolname FROM pg_roles WHERE rolname = %s",
                                                  (pg_store.role_name(name),))).fetchall()
            left.update(databases=[r[0] for r in dbs], roles=[r[0] for r in roles])
        elif self.driver == "etcd" and isinstance(self.manager.drivers["etcd"], DedicatedEtcdDriver):
            server = self.manager.drivers["etcd"].directory(name)  # the tenant's own etcd: all of it goes
            left.update(etcd_processes=processes_marked(str(server / "data")),
                        etcd_files=[str(server)] if server.exists() else [])
        elif self.driver == "etcd":
            assert self.etcd is not None
            root = self.etcd.gateway()
            try:
                await root.authenticate("root", ETCD_ROOT_PASSWORD)
                keys = await root.count_prefix(etcd_store.prefix(name))
                users = (await root.call("auth/user/list", {})).get("users", [])
                roles = (await root.call("auth/role/list", {})).get("roles", [])
            finally:
                await root.close()
            user = etcd_store.user_name(name)
            left.update(prefix_keys=keys, users=[u for u in users if u == user], roles=[r for r in roles if r == user])
        else:
            accounts = self.manager.drivers["nats"].users.read()  # type: ignore[attr-defined]
            accepted = await natskv.connect_ok(creds.endpoint, creds.username, creds.password, creds.inbox_prefix)
            # The bucket's stream, on nats-server's disk (in the tenant's account, which no other
            # account can list): `<store dir>/jetstream/<account>/streams/KV_<bucket>`.
            streams = self.directory.glob(f"store/jetstream/*/streams/KV_{natskv.bucket_name(name)}")
            left.update(accounts=[a for a in accounts if a == name], user_accepted=accepted,
                        buckets=sorted(str(p) for p in streams))
        return left

    def ports(self, name: str) -> list[int]:
        """Every port the tenant's processes listen on (its datastore server's, where it has one)."""
        plane = self.host._read(name)
        assert plane is not None
        ports = [plane.apiserver_port, plane.shim_port]
        driver = self.manager.drivers.get(self.driver)
        if isinstance(driver, DedicatedEtcdDriver):
            server = driver._read(name)
            assert server is not None
            ports += [server.client_port, server.peer_port]
        return ports


def processes_marked(owner: str) -> list[int]:
    """The processes whose owner mark starts with ``owner`` (`tessera.controlplane.processes`)."""
    mark = f"{processes.MARK}={owner}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(v.startswith(mark) for v in (entry / "environ").read_bytes().split(b"\0")):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def cross_kubeconfig(path: Path, server: str, server_ca: str, client_pki: dict[str, str]) -> Path:
    """A kubeconfig that trusts one tenant's API server but presents another tenant's admin certificate."""
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "x", "cluster": {"server": server, "certificate-authority-data": b64(server_ca)}}],
        "users": [{"name": "x", "user": {"client-certificate-data": b64(client_pki["admin.crt"]),
                                         "client-key-data": b64(client_pki["admin.key"])}}],
        "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}],
    }))
    return path


@pytest.fixture(scope="session")
def binaries():
    return plane_binaries()


@pytest.fixture
async def planes(request, binaries, secured_nats, postgres, tmp_path):
    """A manager running tenants' control planes locally on the datastore ``request.param`` (or
    ``(datastore, {setting: value})``)."""
    driver, extra = request.param if isinstance(request.param, tuple) else (request.param, {})
    async for made in _planes(driver, extra, secured_nats, binaries, postgres, tmp_path):
        yield made


@pytest.fixture
async def kube_mode(request, binaries, secured_nats, postgres, kube_plane, tmp_path):
    """A manager in Kubernetes mode on the session's real control plane (v1.36) on the datastore
    ``request.param``, acting as deploy/k8s/controlplane/manager.yaml's ServiceAccount with that
    file's RBAC, the TenantControlPlane CRD installed as the operator installs it; no kubelet runs
    the tenants' pods, so the manager runs them from what the host stores (`LocalKubelet`)."""
    async for made in kube_manager(request.param, kube_plane, secured_nats, binaries, postgres, tmp_path):
        yield made


async def kube_manager(driver, plane, secured_nats, binaries, postgres, tmp_path):
    """``kube_mode``'s manager on any real control plane ``plane`` (a test that pairs it with a
    node of the session's plane of each version, say)."""
    await asyncio.to_thread(apply, plane, manifests("crds/tenantcontrolplanes.yaml"))
    identity = await asyncio.to_thread(service_identity, plane, "controlplane/manager.yaml")
    kube_bin, kine_bin = binaries
    host = LocalKubelet(KubeHost(KubeApi.for_kubeconfig(str(identity))),
                        LocalControlPlanes(tmp_path / "planes", kube_bin, kine_bin, stop_on_close=True))
    extra = {"host_mode": "kubernetes", "kube_pods": "local"}
    async for made in _planes(driver, extra, secured_nats, binaries, postgres, tmp_path, host=host):
        yield made


async def _planes(driver, extra, secured_nats, binaries, postgres, tmp_path, host=None):
    etcd = None
    etcd_proc: subprocess.Popen | None = None
    try:
        if driver == "etcd" and extra.get("etcd_mode") != "dedicated":  # (dedicated: the manager runs them)
            (tmp_path / "etcd").mkdir()
            etcd, etcd_proc = start_etcd_tls(tmp_path / "etcd")
            admin = etcd.gateway()
            try:  # the port opens a moment before the gateway serves
                await eventually(lambda: admin.call("maintenance/status", {}), timeout=20, what="etcd answers")
                await admin.enable_auth(ETCD_ROOT_PASSWORD)
            finally:
                await admin.close()
        async for made in _manager(driver, extra, secured_nats, binaries, etcd, postgres, tmp_path, host):
            yield made
    finally:
        if etcd_proc is not None:
            terminate(etcd_proc)


async def _manager(driver, extra, secured_nats, binaries, etcd, postgres, tmp_path, host):
    server, users, pid = secured_nats
    kube_bin, kine_bin = binaries
    settings = ControlPlaneSettings(**{
        "drivers": ("nats", driver) if driver != "nats" else ("nats",),
        "nats_auth_file": str(users), "nats_pid_file": str(pid), "host_mode": "local",
        "control_planes_dir": str(tmp_path / "planes"), "kube_bin_dir": str(kube_bin), "kine_bin_dir": str(kine_bin),
        "cgroup_root": "", "resync_seconds": 2.0,  # (limits: test_tenant_plane_limits.py)
        "stop_planes_on_exit": True,  # (the manager's close stops them, for sure)
        "postgres_dsn": postgres.admin_url, "postgres_tenant_host": postgres.host,
        "etcd_endpoint": etcd.endpoint if etcd else "http://127.0.0.1:1",
        "etcd_root_password": ETCD_ROOT_PASSWORD, "etcd_data_dir": str(tmp_path / "etcd-servers"),
        "etcd_ca_file": str(etcd.ca_file) if etcd else "", "etcd_ca_key_file": str(etcd.ca_key_file) if etcd else "",
        **extra,
    })
    url = f"nats://platform:platform-secret@127.0.0.1:{server.port}"
    async with open_bus(BusSettings(url=url, file_storage=False), "controlplane") as bus:
        manager = await Manager.start(bus, settings, host=host)
        tasks = [asyncio.create_task(coro, name=name) for name, coro in manager.root_tasks().items()]
        try:
            yield Planes(manager, bus, driver, tmp_path, kube_bin, etcd, postgres.admin_url)
        finally:
            await cancel_and_wait(tasks)
            await manager.close()
            dedicated = manager.drivers.get("etcd")
            if isinstance(dedicated, DedicatedEtcdDriver):  # (its servers outlive a manager, by design)
                await dedicated.stop_all()


