"""A real Kubernetes node for the tests: containerd 2.x (built from its Go module by
tools/kube/build-containerd.sh, Debian's runc, the CNI plugins' bridge) and the real kubelet (built
with the control plane by tools/kube/build.sh), joined to the session's control plane
(tests/kit/kubecluster.py) with a node client certificate from its CA, as kubeadm's TLS bootstrap
would end up: CN=system:node:<name>, O=system:nodes, so the Node authorizer and NodeRestriction
judge it as they judge any node.

Nothing comes from a registry: the sandbox (pause) image and a busybox image are built here
(tools/kube/images.py) and imported into containerd's ``k8s.io`` namespace before the kubelet
starts; the sandbox image is containerd's pinned ``sandbox`` image, so the kubelet never collects it.

Everything the node owns lives under one temporary directory (containerd's root and state, the
kubelet's root dir, pod logs, CDI specs, CNI configuration and IPAM), plus what a node cannot keep
inside a directory, each named after the node so that two sessions on one machine do not meet:
its cgroup parent ``/<name>`` in each cgroup hierarchy, its bridge ``tsr<hex>``, its pods' subnet
(one not routed on the machine), the network namespaces the CNI plugins make, and the
sysctls the kubelet writes (put back on stop). `stop()` deletes its pods through the kubelet first,
so the runtime tears down sandboxes and networks itself, then removes what is left.

One node serves a whole test session (``kube_node``); a test takes a namespace (``kube_namespace``)
and schedules onto it with ``nodeName`` or a ``nodeSelector`` on ``kubernetes.io/hostname``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from kit import processes
from kit.kubecluster import ROOT, KubeControlPlane, delete_driver_slices, ensure_binaries, terminate
from tessera.shared.natsserver import free_port

BUILD_CONTAINERD = ROOT / "tools" / "kube" / "build-containerd.sh"
IMAGES = ROOT / "tools" / "kube" / "images.py"
INSTALL = ROOT / "tests" / "kubernetes" / "install-node.sh"
CONTAINERD_MODULE = "github.com/containerd/containerd/v2"
RUNTIME = ("containerd", "containerd-shim-runc-v2", "ctr")
# Debian's runc; TESSERA_NODE_RUNC names another (a wrapper that logs runc's --debug output, say)
RUNC = Path(os.environ.get("TESSERA_NODE_RUNC", "/usr/sbin/runc"))
CNI_BIN = Path("/usr/lib/cni")
# What the kubelet's container manager writes on start (KernelTunableModify), put back on stop.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
CGROUP_V1 = Path("/sys/fs/cgroup")


def containerd_version() -> str:
    for line in (ROOT / "tools" / "kube" / "containerd" / "go.mod").read_text().splitlines():
        parts = line.split()
        if parts[:1] == [CONTAINERD_MODULE] and parts[1].startswith("v"):
            return parts[1]
    raise RuntimeError(f"tools/kube/containerd/go.mod pins no {CONTAINERD_MODULE}")


def containerd_bin() -> Path:
    cache = Path(os.environ.get("TESSERA_CACHE", Path.home() / ".cache" / "tessera"))
    return cache / "containerd" / containerd_version() / "bin"


def ensure_runtime() -> Path:
    """containerd's cached binaries' directory; builds what is missing (minutes when cold: `make
    kube-node-binaries` builds them first, so a test only finds them)."""
    bindir = containerd_bin()
    missing = [c for c in RUNTIME if not (bindir / c).exists()]
    if missing:
        subprocess.run([str(BUILD_CONTAINERD), *missing], check=True)
    lacking = [str(p) for p in (RUNC, CNI_BIN / "bridge", CNI_BIN / "host-local", CNI_BIN / "loopback",
                                Path("/bin/busybox")) if not p.exists()]
    if lacking:
        raise RuntimeError(f"missing {', '.join(lacking)}: tests/kubernetes/install-node.sh installs them "
                           "(make kube-node-binaries)")
    return bindir


def build_images() -> dict[str, tuple[str, Path]]:
    """name -> (image reference, OCI archive) of tools/kube/images.py (cached per machine)."""
    done = subprocess.run([sys.executable, str(IMAGES)], check=True, capture_output=True, text=True)
    images = {}
    for line in done.stdout.splitlines():
        name, ref, path = line.split()
        images[name] = (ref, Path(path))
    return images


def _routed_networks() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(["ip", "-4", "-j", "route", "show", "table", "all"], capture_output=True, text=True,
                         check=True).stdout
    nets = []
    for route in json.loads(out or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default" and ":" not in dst:
            try:
                nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
            except ValueError:
                continue
    return nets


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 for the node's pods that nothing on this machine routes now (another session's node
    included)."""
    routed = _routed_networks()
    for third in uuid.uuid4().bytes * 4:
        for second in (244, 245, 246, 247):
            net = ipaddress.ip_network(f"10.{second}.{third}.0/24")
            if not any(net.overlaps(r) for r in routed):
                return net
    raise RuntimeError("no free /24 under 10.244.0.0/14 for the node's pods")


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` (deepest first)."""
    prefix = str(path).rstrip("/") + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith(prefix) or point == str(path):
            found.append(point)
    return sorted(set(found), key=len, reverse=True)


def _cgroup_hierarchies() -> list[Path]:
    """The cgroup hierarchies the kubelet's cgroupfs driver (libcontainer) makes groups in: each
    cgroup v1 hierarchy and, on a hybrid machine like this kind, the unified one beside them; or the
    unified one where it is all there is."""
    if (CGROUP_V1 / "cgroup.controllers").exists():  # cgroup v2 alone
        return [CGROUP_V1]
    return sorted(p for p in CGROUP_V1.iterdir() if p.is_dir() and not p.is_symlink()
                  and (p / "cgroup.procs").exists())


@dataclass
class KubeNode:
    """containerd + the real kubelet, registered with ``plane`` as Node ``name``."""

    plane: KubeControlPlane
    workdir: Path
    name: str = field(default_factory=lambda: f"tessera-node-{uuid.uuid4().hex[:8]}")
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    images: dict[str, tuple[str, Path]] = field(default_factory=dict)
    _sysctls: dict[str, str] = field(default_factory=dict)
    _netns_before: set[str] = field(default_factory=set)
    _cgroups: list[Path] = field(default_factory=list)
    _bridge_made: bool = False
    ip: str = ""  # the node's address: its bridge's gateway (InternalIP, where the kubelet serves)
    subnet: ipaddress.IPv4Network | None = None  # its pods' addresses

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.workdir / "kubelet"

    @property
    def cdi_dir(self) -> Path:
        """Where containerd reads CDI specs (``cdi_spec_dirs``): a DRA plugin writes them here."""
        return self.workdir / "cdi"

    @property
    def plugins_registry(self) -> Path:
        """The kubelet's plugin registration directory (a DRA plugin's registration socket goes here)."""
        return self.kubelet_root / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        return self.kubelet_root / "plugins"

    @property
    def bridge(self) -> str:
        return "tsr" + self.name.rsplit("-", 1)[-1][:8]

    def image(self, name: str) -> str:
        return self.images[name][0]

    def prepared_claims(self) -> dict[str, dict]:
        """The claims the kubelet's DRA manager holds prepared (ResourceClaim uid -> its
        ClaimInfoState: ``DriverState[driver].Devices``, each device as the plugin described it to
        the kubelet: PoolName, DeviceName, ShareID, RequestNames, CDIDeviceIDs), from its checkpoint
        ``<root-dir>/dra_manager_state`` (a JSON ``Data`` string under a checksum)."""
        path = self.kubelet_root / "dra_manager_state"
        if not path.exists():
            return {}
        data = json.loads(json.loads(path.read_text())["Data"])
        return {c["ClaimUID"]: c for c in data.get("ClaimInfoStateList") or []}

    # --- start ---------------------------------------------------------------------------------

    def start(self, ready_timeout: float = 120) -> "KubeNode":
        begin = time.monotonic()
        kube = ensure_binaries(("kubelet", "kubectl"), self.plane.minor)
        runtime = ensure_runtime()
        self.images = build_images()
        self.workdir.mkdir(parents=True, exist_ok=True)
        for d in (self.cdi_dir, self.workdir / "cni" / "net.d", self.kubelet_root, self.workdir / "pod-logs"):
            d.mkdir(parents=True, exist_ok=True)
        self._netns_before = set(os.listdir("/var/run/netns")) if Path("/var/run/netns").is_dir() else set()
        self._make_network()
        self._start_containerd(runtime)
        self.timings["containerd"] = time.monotonic() - begin
        self._import_images()
        self.timings["images"] = time.monotonic() - begin
        self._make_cgroup_parent()
        self._save_sysctls()
        self._start_kubelet(kube)
        self.wait_ready(ready_timeout)
        self.timings["ready"] = time.monotonic() - begin
        return self

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.procs[name] = processes.spawn(argv, self.workdir / f"{name}.log", env=env)

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _make_network(self) -> None:
        """The pods' bridge, made here rather than by the CNI bridge plugin at the first pod, so
        that its gateway address is the node's address from the start: the kubelet serves on it
        and reports it as the node's InternalIP (the kubelet refuses a loopback node IP), and the
        API server reaches the kubelet there for logs and exec. Nothing outside the machine routes
        to it."""
        self.subnet = _free_subnet()
        self.ip = str(next(self.subnet.hosts()))
        for argv in (["ip", "link", "add", "name", self.bridge, "type", "bridge"],
                     ["ip", "addr", "add", f"{self.ip}/{self.subnet.prefixlen}", "dev", self.bridge],
                     ["ip", "link", "set", self.bridge, "up"]):
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        self._bridge_made = True
        self._write_cni()

    def _write_cni(self) -> None:
        gateway = self.ip
        conf = {
            "cniVersion": "1.0.0", "name": f"tessera-{self.name}",
            "plugins": [{"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
                         "hairpinMode": True,
                         "ipam": {"type": "host-local", "ranges": [[{"subnet": str(self.subnet), "gateway": gateway}]],
                                  "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(self.workdir / "cni" / "ipam")}}],
        }
        (self.workdir / "cni" / "net.d" / "10-tessera.conflist").write_text(json.dumps(conf, indent=2))

    def _containerd_config(self) -> str:
        d = self.workdir
        return f"""\
version = 4
root = "{d}/containerd/root"
state = "{d}/containerd/state"
imports = []

[plugins.'io.containerd.server.v1.grpc']
  address = "{self.socket}"

[plugins.'io.containerd.server.v1.ttrpc']
  address = "{self.socket}.ttrpc"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{self.image('pause')}"

# CDI is always on in containerd 2.x (the 1.x key `enable_cdi` is gone): only where specs are read.
[plugins.'io.containerd.cri.v1.runtime']
  cdi_spec_dirs = ["{self.cdi_dir}"]
  # This kind of machine runs root without CAP_SYS_RESOURCE: no process may lower its
  # oom_score_adj, and runc fails a sandbox the kubelet asks to be -998 ("failed to update
  # /proc/self/oom_score_adj: Permission denied"). Scores are raised to containerd's own instead.
  restrict_oom_score_adj = {str(self._restrict_oom()).lower()}
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        Root = "{d}/runc"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{d}/cni/net.d"

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""

    @staticmethod
    def _restrict_oom() -> bool:
        """Whether this process lacks CAP_SYS_RESOURCE (24) in its bounding set, as here."""
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapBnd:"):
                return not (int(line.split()[1], 16) >> 24) & 1
        return True

    def _start_containerd(self, runtime: Path) -> None:
        config = self.workdir / "containerd.toml"
        config.write_text(self._containerd_config())
        env = {**os.environ, "PATH": f"{runtime}:/usr/sbin:/usr/bin:/sbin:/bin"}  # the shim is found on PATH
        self._spawn("containerd", [str(runtime / "containerd"), "--config", str(config)], env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            proc = self.procs["containerd"]
            if proc.poll() is not None:
                raise RuntimeError(f"containerd exited {proc.returncode}:\n{self.log('containerd')[-4000:]}")
            if self.socket.exists() and self.ctr("version", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"containerd not serving on {self.socket} in 30 s:\n{self.log('containerd')[-4000:]}")

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([str(containerd_bin() / "ctr"), "--address", str(self.socket), "--namespace", "k8s.io",
                               *args], capture_output=True, text=True, timeout=60)
        if check and done.returncode:
            raise RuntimeError(f"ctr {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def _import_images(self) -> None:
        for _name, (_ref, archive) in self.images.items():
            self.ctr("images", "import", "--platform", "linux/amd64", str(archive))
        listed = self.ctr("images", "list", "--quiet").stdout.split()
        missing = [ref for ref, _ in self.images.values() if ref not in listed]
        if missing:
            raise RuntimeError(f"ctr images import left out {missing}: {listed}")

    def _make_cgroup_parent(self) -> None:
        """``/<name>`` in each hierarchy: the kubelet's ``cgroupRoot`` (it must exist), so this node's
        kubepods tree is its own, next to any other node's on the machine."""
        for hierarchy in _cgroup_hierarchies():
            group = hierarchy / self.name
            group.mkdir(exist_ok=True)
            self._cgroups.append(group)
            for knob in ("cpuset.cpus", "cpuset.mems"):  # a new cpuset is empty: take the parent's
                if (hierarchy / knob).exists():
                    (group / knob).write_text((hierarchy / knob).read_text())

    def _save_sysctls(self) -> None:
        for name in KUBELET_SYSCTLS:
            path = Path("/proc/sys") / name
            if path.exists():
                self._sysctls[name] = path.read_text().strip()

    def _kubelet_config(self, port: int, healthz: int, serving: tuple[Path, Path]) -> dict:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": self.ip, "port": port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": healthz,
            "tlsCertFile": str(serving[0]), "tlsPrivateKeyFile": str(serving[1]),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.plane.pki.ca_file)}},
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{self.name}", "cgroupsPerQOS": True,
            "enforceNodeAllocatable": ["pods"],
            "failSwapOn": False,
            # the kubelet's own -999 needs CAP_SYS_RESOURCE too (see restrict_oom_score_adj)
            "oomScoreAdj": 0 if self._restrict_oom() else -999,
            # cgroup v1 (this kind of machine mounts v1 hierarchies beside an empty unified one):
            # refused by default since 1.35 unless said so
            "failCgroupV1": False,
            "podLogsDir": str(self.workdir / "pod-logs"),
            "staticPodPath": "",
            "clusterDomain": "cluster.local", "clusterDNS": [],
            "resolvConf": "/etc/resolv.conf",
            # a shared disk fills with other work: the node is not evicted for it
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%", "imagefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "nodeStatusReportFrequency": "10s", "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "5s", "fileCheckFrequency": "5s",
            "serializeImagePulls": False,
            "shutdownGracePeriod": "0s",
        }

    def _start_kubelet(self, kube: Path) -> None:
        pki = self.plane.pki
        crt, key = pki.issue(f"node-{self.name}", f"system:node:{self.name}", ("system:nodes",))
        kubeconfig = self.workdir / "kubelet.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "node",
            "clusters": [{"name": "test", "cluster": {"server": self.plane.url,
                                                      "certificate-authority": str(pki.ca_file)}}],
            "users": [{"name": "node", "user": {"client-certificate": str(crt), "client-key": str(key)}}],
            "contexts": [{"name": "node", "context": {"cluster": "test", "user": "node"}}],
        }))
        self.kubeconfig = kubeconfig
        serving = pki.issue(f"kubelet-{self.name}", self.name, server=True, dns=(self.name,),
                            ips=(self.ip,))
        self.port, healthz = free_port(), free_port()
        self.healthz = healthz
        config = self.workdir / "kubelet.yaml"
        config.write_text(yaml.safe_dump(self._kubelet_config(self.port, healthz, serving)))
        self._spawn("kubelet", [
            str(kube / "kubelet"), f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={self.kubelet_root}", f"--cert-dir={self.workdir / 'kubelet-pki'}",
            f"--hostname-override={self.name}", f"--node-ip={self.ip}", "--v=2",
        ])

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.log(name)[-6000:]}")
            done = self.plane.kubectl("get", "node", self.name, "-o",
                                      'jsonpath={.status.conditions[?(@.type=="Ready")].status}', check=False)
            last = done.stdout.strip() or done.stderr.strip()
            if last == "True":
                return
            time.sleep(0.5)
        raise RuntimeError(f"node {self.name} not Ready in {timeout:.0f} s ({last}):\n{self.log('kubelet')[-6000:]}")

    # --- stop ----------------------------------------------------------------------------------

    def _pods(self) -> list[dict]:
        done = self.plane.kubectl("get", "pods", "--all-namespaces", "--field-selector", f"spec.nodeName={self.name}",
                                  "-o", "json", check=False)
        return json.loads(done.stdout)["items"] if done.returncode == 0 else []

    def _drain(self, timeout: float = 30) -> None:
        """Delete this node's pods and wait for the kubelet to stop their sandboxes: the runtime
        then takes down their networks (CNI DEL) and namespaces itself."""
        if "kubelet" not in self.procs or self.procs["kubelet"].poll() is not None:
            return
        for pod in self._pods():
            meta = pod["metadata"]
            self.plane.kubectl("delete", "pod", "-n", meta["namespace"], meta["name"], "--grace-period=1",
                               "--wait=false", check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # the kubelet leaves exited containers for its garbage collector: what counts is that
            # no task runs and every pod address is given back (the sandboxes' CNI DEL is done)
            if not self._pods() and not self._running_tasks() and not self._leased_addresses():
                return
            time.sleep(0.25)

    def _running_tasks(self) -> list[str]:
        lines = self.ctr("tasks", "list", check=False).stdout.splitlines()[1:]
        return [line.split()[0] for line in lines if line.split()[-1:] == ["RUNNING"]]

    def _leased_addresses(self) -> list[str]:
        """host-local's reservations (a file per address in use) on this node's network."""
        network = self.workdir / "cni" / "ipam" / f"tessera-{self.name}"
        if not network.is_dir():
            return []
        return [p.name for p in network.iterdir() if p.name[:1].isdigit() and not p.name.startswith("last_")]

    def _stop_proc(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            terminate(proc)

    def _kill_leftover_tasks(self) -> None:
        if "containerd" not in self.procs:
            return
        for cid in self.ctr("containers", "list", "--quiet", check=False).stdout.split():
            self.ctr("tasks", "kill", "--signal", "SIGKILL", cid, check=False)
            self.ctr("tasks", "delete", "--force", cid, check=False)
            self.ctr("containers", "delete", cid, check=False)

    def _kill_shims(self) -> None:
        """Shims that outlived containerd (they are daemons of their own): only those started for
        this node's socket."""
        mine = str(self.socket).encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and mine in argv:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        self._drain()
        self._stop_proc("kubelet")
        self._kill_leftover_tasks()
        self._stop_proc("containerd")
        self._kill_shims()
        for point in _mounts_under(self.workdir):
            subprocess.run(["umount", "-l", point], capture_output=True)
        netns = Path("/var/run/netns")
        if netns.is_dir():
            for name in set(os.listdir(netns)) - self._netns_before:
                if name.startswith("cni-"):
                    subprocess.run(["umount", "-l", str(netns / name)], capture_output=True)
                    (netns / name).unlink(missing_ok=True)
        if self._bridge_made:
            subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
            self._bridge_made = False
        for group in self._cgroups:
            for sub in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                try:
                    sub.rmdir()
                except OSError:
                    pass
            try:
                group.rmdir()
            except OSError:
                pass
        self._cgroups.clear()
        for name, value in self._sysctls.items():
            try:
                (Path("/proc/sys") / name).write_text(value)
            except OSError:
                pass
        self._sysctls.clear()


def start_node(plane: KubeControlPlane, **kw) -> KubeNode:
    # short: the kubelet's plugin registry is under it, and a DRA plugin's registration socket with its pod
    # uid (gpu.tessera.dev-<uid>-reg.sock, 61 bytes) must fit a unix socket's 107-byte path
    workdir = Path(tempfile.mkdtemp(prefix="tn-"))
    node = KubeNode(plane, workdir, **kw)
    try:
        return node.start()
    except BaseException:
        node.stop()
        raise


def remove(node: KubeNode) -> None:
    node.stop()
    shutil.rmtree(node.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def kube_session_node(kube_cluster):
    """One real node (containerd + kubelet) joined to the session's control plane."""
    try:
        node = start_node(kube_cluster)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:  # never a skip
        pytest.fail(f"the real Kubernetes node did not start ({exc}); `make kube-node-binaries` builds and "
                    "installs what it needs (tools/kube/build-containerd.sh, tests/kubernetes/install-node.sh)")
    try:
        yield node
    finally:
        remove(node)


@pytest.fixture
def kube_node(kube_session_node, kube_cluster):
    """The session's node as a test should find it: no slice an earlier test left on it."""
    delete_driver_slices(kube_cluster, kube_session_node.name)
    return kube_session_node
