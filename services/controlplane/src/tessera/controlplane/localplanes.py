"""Tenant control planes run by the manager as local processes (``TESSERA_CP_HOST=local``).

A HostCluster like the others: the reconciler renders and validates the tenant's objects, and this
host runs their pod (`tessera.controlplane.localpod`): kube-apiserver, kube-controller-manager,
kube-scheduler and, for PostgreSQL and NATS, kine, on the tenant's own datastore scope with the
tenant's PKI. Each tenant has a directory (``<dir>/<tenant>/``: ``plane.json`` with its ports and
pids, the Secret volumes as files, one log per process).

``ready`` is the truth: the API server answers ``/readyz`` over TLS verified with the tenant's CA,
as the tenant's admin, and a read of a namespace goes through to the datastore and back. A process
that died is started again on the next apply (the watch loop notices within a second and asks for
one); what stops answering is NotReady with the reason. The processes outlive the manager, like
dedicated etcd servers: a restarted manager finds them from ``plane.json`` (`processes.running`).

An API server that answers with a certificate the tenant's CA does not verify (its serving
certificate or key replaced underneath it) is ``ServingCertificateMismatch``, not "not answering":
the pass that finds it says so, and the next apply writes the tenant's own certificates back and
restarts the processes (a fresh start reads its files, whatever the API server's reload did). An
apply that finds the files changed asks the API server first, with the CA still on disk: a rotation
of the manager's is still verified by it, a certificate written over the tenant's is not.

Sleeping (scale to zero) is the rendered Deployment's zero replicas: ``apply`` then stops the
processes and keeps the directory, the ports and the datastore; replicas again start them. Whether a
tenant sleeps is the tenant's record (the reconciler's to render), so the watch loop only reports an
idle tenant (no request through its API server for the idle timeout, read from the API server's own
request counter) to ``on_idle``, which puts it to sleep the way `tessera tenant sleep` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import ssl
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
from cryptography import x509

from tessera.controlplane import manifests, processes
from tessera.controlplane.host import HostFault
from tessera.controlplane.limits import Limits
from tessera.controlplane.localpod import LocalPod, PodError, Ports, translate
from tessera.controlplane.pki import load_cert
from tessera.controlplane.spec import TenantControlPlane
from tessera.shared.natsserver import free_port

log = logging.getLogger("tessera.controlplane.localplanes")

SHIM_START_TIMEOUT = 20.0
RESTART_BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0)  # seconds before restarting a process that died again
PROBE_TIMEOUT = 3.0
SERVING_MISMATCH = "ServingCertificateMismatch"  # not the datastore's CertificateMismatch: this one the manager mends
# The datastore round trip of a readiness probe: a list, which the API server serves from storage.
PROBE_PATH = "/api/v1/namespaces/kube-system/resourcequotas"
_BACKGROUND = {"", "leases", "resourcequotas"}  # what an idle control plane asks for by itself
# ...and what its nodes report by themselves (a kubelet's, or the manager's own virtual node's, status
# once a minute: counted, it would keep a tenant with a GPU pod syncer awake for ever)
_BACKGROUND_SUBRESOURCES = {("nodes", "status")}


@dataclass
class PlaneRecord:
    """``plane.json``: the tenant's ports and the pids of its running processes."""

    apiserver_port: int
    shim_port: int
    pids: dict[str, int] = field(default_factory=dict)
    asleep: bool = False
    started_as: dict[str, str] = field(default_factory=dict)  # a digest of each one's command line


@dataclass
class _Seen:
    """What this manager observed of one tenant (memory only: ``plane.json`` is the record)."""

    answered: bool = False  # its API server has answered since it was last started
    deaths: dict[str, int] = field(default_factory=dict)  # restarts in a row, per process
    started: dict[str, float] = field(default_factory=dict)
    fault: HostFault | None = None
    exited: dict[str, str] = field(default_factory=dict)  # what died and was started again, with its log
    mismatch: str = ""  # the last probe's: the certificate it was served, which the tenant's CA does not verify
    requests: float = -1.0  # the API server's request count at the last look (idle timeout)
    busy_at: float = field(default_factory=time.monotonic)
    counted_at: float = 0.0


class LocalControlPlanes:
    def __init__(self, directory: str | os.PathLike, kube_bin: str | os.PathLike, kine_bin: str | os.PathLike,
                 *, idle_seconds: float = 0.0, limits: Limits | None = None, watch_every: float = 1.0,
                 stop_on_close: bool = False) -> None:
        self.stop_on_close = stop_on_close
        self.directory = Path(directory)
        self.kube_bin = Path(kube_bin)
        self.kine_bin = Path(kine_bin)
        self.idle_seconds = idle_seconds
        self.limits = limits
        self.watch_every = watch_every
        self._seen: dict[str, _Seen] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._session: aiohttp.ClientSession | None = None
        # Told of a tenant idle for ``idle_seconds`` (the manager puts it to sleep); unset: none is.
        self.on_idle: Callable[[str], Awaitable[None]] | None = None
        # Told before one of a tenant's processes is started (tenant, process name): the manager frees
        # what the datastore still holds for a shim that died or slept.
        self.before_start: Callable[[str, str], Awaitable[None]] | None = None

    # --- where things are --------------------------------------------------------------------

    def home(self, tenant: str) -> Path:
        return self.directory / tenant

    def owner(self, tenant: str, process: str) -> str:
        return f"{self.home(tenant)}:{process}"

    def binary(self, executable: str) -> Path:
        return (self.kine_bin if executable == "kine" else self.kube_bin) / executable

    def _read(self, tenant: str) -> PlaneRecord | None:
        try:
            return PlaneRecord(**json.loads((self.home(tenant) / "plane.json").read_text()))
        except FileNotFoundError:
            return None

    def _write(self, tenant: str, record: PlaneRecord) -> None:
        path = self.home(tenant) / "plane.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, path)

    def _record(self, tenant: str) -> PlaneRecord:
        record = self._read(tenant)
        if record is None:
            self.home(tenant).mkdir(parents=True, exist_ok=True, mode=0o700)
            record = PlaneRecord(apiserver_port=free_port(), shim_port=free_port())
            self._write(tenant, record)
        return record

    def endpoint(self, record: TenantControlPlane) -> str:
        """The tenant's API server on loopback (its kubeconfig, its controllers' kubeconfig)."""
        return f"https://127.0.0.1:{self._record(record.name).apiserver_port}"

    def tenants(self) -> list[str]:
        if not self.directory.exists():
            return []
        return sorted(p.name for p in self.directory.iterdir() if (p / "plane.json").exists())

    # --- HostCluster -------------------------------------------------------------------------

    async def apply(self, tenant: str, objects: list[dict[str, Any]]) -> None:
        async with self._locks.setdefault(tenant, asyncio.Lock()):
            record = self._record(tenant)
            try:
                pod = translate(objects, self.home(tenant), Ports(record.apiserver_port, record.shim_port))
            except PodError as exc:
                raise HostFault("InvalidPod", str(exc)) from None
            if pod.replicas == 0:  # scaled to zero: asleep
                if record.pids or not record.asleep:
                    await self._sleep(tenant, record)
                return
            if record.asleep:
                record.asleep = False
                self._write(tenant, record)
                self._seen.pop(tenant, None)
            seen = self._seen.setdefault(tenant, _Seen())
            stale = self._stale_files(pod)
            if stale and record.pids:  # rotated by the manager, or replaced underneath: the API server's answer says
                await self.probe(tenant, record, round_trip=False)
            mismatch, seen.mismatch = seen.mismatch, ""
            self._write_files(stale)
            await self._run(tenant, record, pod, restart=bool(stale or mismatch))
            if mismatch:  # repaired, as far as this host can: said until the next pass finds it serving
                seen.fault = HostFault(SERVING_MISMATCH, f"{mismatch}; the manager wrote the tenant's own "
                                       "certificates back and restarted its control plane")

    async def ready(self, tenant: str) -> tuple[bool, str]:
        record = self._read(tenant)
        if record is None:
            return False, "control plane not started yet"
        if record.asleep:
            raise HostFault("Sleeping", "the control plane sleeps, scaled to zero (`tessera tenant wake` starts it)")
        seen = self._seen.setdefault(tenant, _Seen())
        if seen.fault is not None:
            raise seen.fault
        for name, pid in record.pids.items():
            if not processes.running(pid, self.owner(tenant, name)):
                raise HostFault("ProcessExited", f"{name} exited; restarting it: {self.log_tail(tenant, name)}")
        problem = await self.probe(tenant, record)
        if problem is None:
            seen.answered = True
            seen.deaths.clear()
            seen.exited.clear()
            return True, ""
        if seen.mismatch:  # (the next apply restarts it)
            raise HostFault(SERVING_MISMATCH, f"{seen.mismatch}; the manager writes the tenant's own certificates "
                                              "back and restarts its control plane on the next resync")
        if seen.exited:
            said = "; ".join(f"{name} exited ({tail})" for name, tail in seen.exited.items())
            raise HostFault("ProcessExited", f"{said}; started again, waiting for the API server: {problem}")
        if seen.answered:
            raise HostFault("ApiServerNotAnswering", problem)
        return False, f"kube-apiserver starting: {problem}"

    async def remove(self, tenant: str) -> None:
        async with self._locks.setdefault(tenant, asyncio.Lock()):
            record = self._read(tenant)
            if record is not None:
                await self._stop_all(tenant, record)
            if self.limits is not None:
                self.limits.remove(tenant)
            shutil.rmtree(self.home(tenant), ignore_errors=True)
            self._seen.pop(tenant, None)

    async def close(self) -> None:
        """The control planes go on running (they are the tenants'), unless ``stop_on_close``."""
        if self.stop_on_close:  # all at once, and killed for sure even if this close is cancelled
            owned = [(pid, self.owner(tenant, name)) for tenant in self.tenants()
                     for name, pid in self.pids(tenant).items()]
            try:
                await processes.stop_together(owned)
            finally:
                for tenant in self.tenants() if self.limits is not None else []:
                    self.limits.remove(tenant)  # type: ignore[union-attr]
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def stop_all(self) -> None:
        """Stop every tenant's processes, all tenants at once (``stop_on_close``, tools and tests)."""
        async def one(tenant: str) -> None:
            record = self._read(tenant)
            if record is not None:
                await self._stop_all(tenant, record)

        await asyncio.gather(*(one(t) for t in self.tenants()))

    # --- sleeping ------------------------------------------------------------------------------

    async def _sleep(self, tenant: str, record: PlaneRecord) -> None:
        await self._stop_all(tenant, record)
        record.asleep = True
        self._write(tenant, record)
        self._seen.pop(tenant, None)

    def asleep(self, tenant: str) -> bool:
        record = self._read(tenant)
        return record is not None and record.asleep

    # --- the watch loop ------------------------------------------------------------------------

    async def watch(self, on_change: Callable[[str], Awaitable[None]]) -> None:
        """Every ``watch_every`` seconds: a tenant whose processes died, whose API server started or
        stopped answering, is reconciled (``on_change``); an idle one is put to sleep."""
        last: dict[str, tuple] = {}
        while True:
            for tenant in self.tenants():
                try:
                    state = await self._look(tenant)
                except Exception as exc:  # one tenant's trouble must not stop the loop
                    log.warning("watching %s: %s", tenant, exc)
                    continue
                if state != last.get(tenant):
                    last[tenant] = state
                    await on_change(tenant)
            await asyncio.sleep(self.watch_every)

    async def _look(self, tenant: str) -> tuple:
        record = self._read(tenant)
        if record is None or record.asleep:
            return ("asleep",)
        alive = tuple(sorted(n for n, p in record.pids.items() if processes.running(p, self.owner(tenant, n))))
        answers = await self.probe(tenant, record, round_trip=False) is None
        if answers and self.idle_seconds > 0 and self.on_idle is not None and await self._idle(tenant, record):
            log.info("tenant %s: idle for %.0f s, putting its control plane to sleep", tenant, self.idle_seconds)
            await self.on_idle(tenant)
            self._seen.pop(tenant, None)  # (counted afresh once it is awake again)
            return ("idle",)
        return (alive, answers)

    async def _idle(self, tenant: str, record: PlaneRecord) -> bool:
        """Whether no request but the manager's own probes reached the API server for the idle timeout."""
        seen = self._seen.setdefault(tenant, _Seen())
        now = time.monotonic()
        if now - seen.counted_at < min(10.0, self.idle_seconds / 3):  # /metrics is long: not every second
            return now - seen.busy_at >= self.idle_seconds
        seen.counted_at = now
        count = await self._requests(tenant, record)
        if count != seen.requests:
            seen.requests, seen.busy_at = count, now
        return now - seen.busy_at >= self.idle_seconds

    async def _requests(self, tenant: str, record: PlaneRecord) -> float:
        """Requests the API server served for its users: the sum of ``apiserver_request_total`` less
        what runs by itself in an idle control plane (leader-election leases, discovery, watches
        re-established, nodes' heartbeats and status reports) and the manager's own probes
        (``PROBE_PATH``'s resource)."""
        try:
            text = await self._get(tenant, record, "/metrics")
        except Exception:
            return -1.0
        total = 0.0
        for line in text.splitlines():
            if not line.startswith("apiserver_request_total{") or 'verb="WATCH"' in line:
                continue
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.rindex("}")].split(","))
            resource = labels.get("resource", '""').strip('"')
            if resource in _BACKGROUND or (resource, labels.get("subresource", '""').strip('"')) in \
                    _BACKGROUND_SUBRESOURCES:
                continue
            total += float(line.rsplit(" ", 1)[1])
        return total

    # --- the processes -------------------------------------------------------------------------

    @staticmethod
    def _stale_files(pod: LocalPod) -> dict[Path, bytes]:
        """The pod's files not on disk as rendered (new certificates, or someone else's written over them)."""
        stale = {}
        for path, data in pod.files.items():
            try:
                if path.read_bytes() == data:
                    continue
            except FileNotFoundError:
                pass
            stale[path] = data
        return stale

    @staticmethod
    def _write_files(files: dict[Path, bytes]) -> None:
        for path, data in files.items():
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_name(f".{path.name}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private keys among them
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)

    async def _run(self, tenant: str, record: PlaneRecord, pod: LocalPod, *, restart: bool) -> None:
        """Start what is not running (all of it again when its files changed: new certificates)."""
        seen = self._seen.setdefault(tenant, _Seen())
        seen.fault = None
        wanted = {p.name for p in pod.processes}
        for name in [n for n in record.pids if n not in wanted]:
            await processes.stop(record.pids.pop(name), self.owner(tenant, name))
        for process in pod.processes:
            owner = self.owner(tenant, process.name)
            pid = record.pids.get(process.name, 0)
            alive = processes.running(pid, owner)
            command = hashlib.sha256(json.dumps([process.argv, process.env]).encode()).hexdigest()
            if alive and not restart and record.started_as.get(process.name) == command:
                continue
            if alive:
                await processes.stop(pid, owner)
            elif pid:  # it died: not again at once if it keeps dying
                deaths = seen.deaths.get(process.name, 0)
                wait = RESTART_BACKOFF[min(deaths, len(RESTART_BACKOFF) - 1)]
                if time.monotonic() - seen.started.get(process.name, 0.0) < wait:
                    continue
                seen.deaths[process.name] = deaths + 1
                seen.exited[process.name] = self.log_tail(tenant, process.name, 1)
                log.warning("tenant %s: %s exited, starting it again: %s", tenant, process.name,
                            self.log_tail(tenant, process.name))
            binary = self.binary(process.executable)
            if not binary.exists():
                seen.fault = HostFault("BinaryMissing", f"{process.executable} is not at {binary}: run `make "
                                       f"kube-binaries` (kube-*) or `make kine` (kine), or set the manager's "
                                       f"TESSERA_CP_KUBE_BIN_DIR / TESSERA_CP_KINE_BIN_DIR")
                raise seen.fault
            if process.listens and not processes.port_free(process.listens):
                seen.fault = HostFault("PortInUse", f"{process.name}: port {process.listens} on 127.0.0.1 is "
                                       "taken by another process; the tenant gets a new port on the next resync")
                self._move_port(tenant, record, process.listens)
                raise seen.fault
            if self.before_start is not None:
                await self.before_start(tenant, process.name)
            env = {**os.environ, **process.env}
            record.pids[process.name] = processes.spawn(
                [str(binary), *process.argv], self.home(tenant) / f"{process.name}.log", owner, env)
            record.started_as[process.name] = command
            seen.started[process.name] = time.monotonic()
            seen.answered = False
            self._write(tenant, record)
            if self.limits is not None:
                self.limits.apply(tenant, process.name, record.pids[process.name], process.cpu_millis,
                                  process.memory_bytes)
            if process.listens == record.shim_port:
                await self._wait_listening(tenant, process.name, record)

    def _move_port(self, tenant: str, record: PlaneRecord, taken: int) -> None:
        """A port of the tenant's was taken while it was down: a new one (its kubeconfig follows)."""
        if taken == record.apiserver_port:
            record.apiserver_port = free_port()
        else:
            record.shim_port = free_port()
        self._write(tenant, record)

    async def _wait_listening(self, tenant: str, name: str, record: PlaneRecord) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHIM_START_TIMEOUT
        owner = self.owner(tenant, name)
        while processes.port_free(record.shim_port):
            if not processes.running(record.pids[name], owner):
                raise HostFault("DatastoreRefused", f"{name} exited: {self.log_tail(tenant, name)}")
            if loop.time() > deadline:
                raise HostFault("DatastoreRefused", f"{name} is not listening after {SHIM_START_TIMEOUT:.0f}s: "
                                                    f"{self.log_tail(tenant, name)}")
            await asyncio.sleep(0.1)

    async def _stop_all(self, tenant: str, record: PlaneRecord) -> None:
        # the API server's clients first, its storage last
        for name in sorted(record.pids, key=lambda n: n == manifests.DATASTORE_SHIM):
            await processes.stop(record.pids[name], self.owner(tenant, name))
        record.pids.clear()
        self._write(tenant, record)

    def log_tail(self, tenant: str, name: str, lines: int = 3) -> str:
        try:
            text = (self.home(tenant) / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def pids(self, tenant: str) -> dict[str, int]:
        record = self._read(tenant)
        return dict(record.pids) if record else {}

    # --- probing the API server ----------------------------------------------------------------

    def _tls(self, tenant: str) -> ssl.SSLContext:
        pki = self.home(tenant) / "volumes" / "pki"
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return ctx

    async def _get(self, tenant: str, record: PlaneRecord, path: str) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT))
        url = f"https://127.0.0.1:{record.apiserver_port}{path}"
        async with self._session.get(url, ssl=self._tls(tenant)) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: {resp.status} {body.strip()[-300:]}")
            return body

    async def probe(self, tenant: str, record: PlaneRecord | None = None, *, round_trip: bool = True) -> str | None:
        """None when the API server answers ``/readyz`` with the tenant's CA (and, with
        ``round_trip``, a namespace read through to the datastore); else what went wrong."""
        record = record or self._read(tenant)
        if record is None:
            return "not started"
        seen = self._seen.setdefault(tenant, _Seen())
        try:
            await self._get(tenant, record, "/readyz")
            if round_trip:
                await self._get(tenant, record, PROBE_PATH)
        except (aiohttp.ClientConnectorCertificateError, ssl.SSLCertVerificationError) as exc:
            seen.mismatch = await self._mismatch(tenant, record, exc)
            return seen.mismatch
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ssl.SSLError, OSError) as exc:
            seen.mismatch = ""
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        seen.mismatch = ""
        return None

    async def _mismatch(self, tenant: str, record: PlaneRecord, exc: Exception) -> str:
        """What the API server presented instead of a certificate from the tenant's CA, and where that
        CA and the API server's own certificate are (the files the rendered pod mounts)."""
        pki = self.home(tenant) / "volumes" / "pki"
        ours = "the tenant's CA"
        try:
            ours = f"the tenant's CA ({load_cert((pki / 'ca.crt').read_text()).subject.rfc4514_string()})"
            presented = await served_certificate(record.apiserver_port)
            served = (f"a certificate for {presented.subject.rfc4514_string()} issued by "
                      f"{presented.issuer.rfc4514_string()}")
        except (OSError, ValueError, ssl.SSLError):
            served = "a certificate"
        cause = getattr(exc, "certificate_error", exc)
        return (f"the API server at https://127.0.0.1:{record.apiserver_port} presents {served}, which {ours} does "
                f"not verify ({cause}): its serving certificate or key ({pki}/apiserver.crt, apiserver.key) or the "
                "CA was replaced underneath it")


async def served_certificate(port: int) -> x509.Certificate:
    """The certificate a server on a loopback port presents, unverified (to say what it is)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=ctx), PROBE_TIMEOUT)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), PROBE_TIMEOUT)
    return x509.load_der_x509_certificate(der)


SUPPORTED_MINOR = "v1.36"  # the Kubernetes release Tessera supports (tools/kube/v1.36)


def _cache() -> Path:
    return Path(os.environ.get("TESSERA_CACHE", Path.home() / ".cache" / "tessera"))


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(p) for p in path.name.lstrip("v").split(".") if p.isdigit())


def default_bin_dirs() -> tuple[Path, Path]:
    """(kube binaries, kine) in the build cache of `make kube-binaries` and `make kine`: the supported
    Kubernetes release where built, else the newest built; the newest kine."""
    kube = sorted((p for p in (_cache() / "kubernetes").glob("v*") if (p / "bin" / "kube-apiserver").exists()),
                  key=_version_key)
    supported = [p for p in kube if p.name.startswith(SUPPORTED_MINOR + ".")]
    kine = sorted((p for p in (_cache() / "kine").glob("v*") if (p / "bin" / "kine").exists()), key=_version_key)
    fallback = _cache() / "kubernetes" / "missing"
    return ((supported or kube or [fallback])[-1] / "bin", (kine or [_cache() / "kine" / "missing"])[-1] / "bin")

