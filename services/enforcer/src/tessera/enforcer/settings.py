"""The enforcer's one frozen settings object, declared field by field (`tessera.shared.settings`).

Everything an operator may tune about a node agent lives here with its variable name, so a bad value
fails start-up with that name instead of surfacing later as odd behaviour: where claim state lives,
which libvgpu.so and (on a simulated fleet) which driver directory a workload gets, how often usage is
sampled and published, the bounded times after which leaked claims are released, and, in
Kubernetes mode, where the kubelet meets its DRA plugin and the container runtime its CDI specs.
"""

from __future__ import annotations

import re

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tessera.shared.kubeclaims import DRIVER
from tessera.shared.settings import FromEnv, node_name, setting

from tessera.enforcer.kubelet.sockets import MAX_PATH_BYTES, socket_names, too_long


def _in_tree(*parts: str) -> Path | None:
    """A path under this checkout's native/vgpu/build, if the enforcer runs from a checkout."""
    for parent in Path(__file__).resolve().parents:
        candidate = parent.joinpath("native", "vgpu", "build", *parts)
        if candidate.exists():
            return candidate
    return None


def _default_libvgpu() -> str:
    found = _in_tree("libvgpu.so")
    return str(found) if found else "/usr/local/lib/tessera/libvgpu.so"


def _default_cdi_hook() -> str:
    found = _in_tree("tessera-cdi-hook")
    return str(found) if found else "/usr/local/lib/tessera/tessera-cdi-hook"


def _has_nvidia_driver() -> bool:
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/version").exists()


def _sim_driver_dir(raw: str) -> str:
    """TESSERA_SIM_DRIVER_DIR: a directory with the simulated libcuda.so.1 (simulated fleet), or
    "none" (also blank, "off", "real") for the real driver."""
    if raw.strip().lower() in ("", "none", "off", "real"):
        return ""
    path = Path(raw)
    if not (path / "libcuda.so.1").exists():
        raise ValueError("has no libcuda.so.1; build it with 'make -C native/vgpu'")
    return str(path.resolve())


def _found_sim_driver_dir() -> str:
    """Unset: the in-tree simulated driver on a machine without an NVIDIA driver, the real driver
    otherwise."""
    if _has_nvidia_driver():
        return ""
    found = _in_tree("sim", "libcuda.so.1")
    return str(found.parent) if found else ""


def _host_path(raw: str) -> Path:
    """A path of the node's (the host's, or the host's as the enforcer sees it): absolute."""
    path = Path(raw)
    if not path.is_absolute():
        raise ValueError("must be an absolute path")
    return path


def _absolute(raw: str) -> Path:
    """A directory the kubelet shares: an absolute path, since the kubelet resolves it, not us."""
    path = Path(raw)
    if not path.is_absolute():
        raise ValueError("must be an absolute path (the kubelet's directory on the node)")
    return path


def _pod_uid(raw: str) -> str:
    """A pod uid as the API server assigns it (it becomes part of two socket file names)."""
    value = raw.strip().lower()
    if value and not re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", value):
        raise ValueError("must be the pod's metadata.uid (a UUID such as 3f1c...-...), as the downward API gives it")
    return value


@dataclass(frozen=True, kw_only=True)
class EnforcerSettings(FromEnv):
    node: str = setting("TESSERA_NODE", "the node this enforcer serves", parse=node_name,
                        required="name the node this enforcer runs on")
    # Kubernetes mode: the enforcer is the kubelet's DRA plugin of driver gpu.tessera.dev; claims
    # that stand for a ResourceClaim are prepared when the kubelet asks, not on ``allocated``.
    kubernetes: bool = setting(
        "TESSERA_KUBERNETES", "`true`: serve the kubelet plugin (registration and DRA v1/v1beta1 gRPC on unix "
        "sockets); claims that stand for a ResourceClaim are prepared when the kubelet asks, not on `allocated`. "
        "The API server is reached in-cluster or through `KUBECONFIG`", False, group="kubernetes")
    state_dir: Path = setting(
        "TESSERA_STATE_DIR", "claim directories (accounting files, limits, owner locks)",
        parse=lambda raw: Path(raw).resolve(), unset=lambda read: f"var/enforcer/{read['node']}",
        shown="`var/enforcer/<node>`")
    # A container runtime reads CDI specs from /var/run/cdi; a local fleet keeps its own.
    cdi_dir: Path = setting(
        "TESSERA_CDI_DIR", "where the CDI specs of prepared claims are written (`/etc/cdi` or `/var/run/cdi` for "
        "a container runtime)",
        unset=lambda read: "/var/run/cdi" if read["kubernetes"] else str(read["state_dir"] / "cdi"),
        shown="`<state>/cdi`; `/var/run/cdi` in Kubernetes mode")
    libvgpu: str = setting("TESSERA_LIBVGPU", "path of `libvgpu.so`, preloaded into workloads",
                           unset=lambda read: _default_libvgpu(), shown="the in-tree build")
    # The CDI specs' createContainer hook: it makes the driver's mounted libraries loadable in the
    # container (ldconfig there). A host path, since the container runtime runs it.
    cdi_hook: Path = setting(
        "TESSERA_CDI_HOOK", "path of `tessera-cdi-hook` (native/vgpu) on the host, the createContainer hook of "
        "every claim's CDI spec that makes the driver's libraries loadable in the container (absolute path)",
        default_factory=lambda: Path(_default_cdi_hook()), parse=_host_path, shown="the in-tree build")
    # The real driver: its files are found under the driver root as the enforcer sees it, and
    # mounted into containers from the same directory as the host sees it.
    driver_root: Path = setting(
        "TESSERA_DRIVER_ROOT", "where the enforcer sees the root of the NVIDIA driver's installation (the host's "
        "`/` mounted at `/driver-root` in the DaemonSet); its `etc/ld.so.cache` finds the driver's libraries for "
        "the CDI specs", Path("/"), parse=_host_path)
    host_driver_root: Path | None = setting(
        "TESSERA_HOST_DRIVER_ROOT", "the same directory as the host (the container runtime) sees it: `/`, or "
        "`/run/nvidia/driver` for a driver the GPU operator installs", None, parse=_host_path,
        shown="`TESSERA_DRIVER_ROOT`")
    dev_root: Path = setting(
        "TESSERA_DEV_ROOT", "the host's `/dev` as the enforcer sees it: the GPUs' and the driver's device nodes "
        "are read there for the CDI specs", Path("/dev"), parse=_host_path)
    # Host mode: where to install libvgpu's node file making enforcement mandatory (None: not
    # installed; /etc/tessera/vgpu.conf on a node whose host processes use the GPUs). See
    # docs/isolation-host-mode.md.
    vgpu_node_config: Path | None = setting(
        "TESSERA_VGPU_NODE_CONFIG", "host mode: where the enforcer (as root) installs libvgpu's node file, "
        "normally `/etc/tessera/vgpu.conf`; it makes enforcement mandatory for every CUDA process of the host "
        "(see `docs/isolation-host-mode.md`)", None, parse=_absolute, shown="unset (not installed)")
    # Directory of the simulated driver; "" = the real driver (its env gets no LD_LIBRARY_PATH).
    sim_driver_dir: str = setting(
        "TESSERA_SIM_DRIVER_DIR", "directory with the simulated `libcuda.so.1`; `none` for the real driver", "",
        parse=_sim_driver_dir, unset=lambda read: _found_sim_driver_dir(),
        shown="in-tree simulated driver where no NVIDIA driver is found")
    # How often accounting files are read; a ClaimUsage/NodeUsage is published when it changed ...
    usage_seconds: float = setting(
        "TESSERA_USAGE_SECONDS", "how often accounting files are read and changed usage is published", 2.0, above=0)
    # ... or when this long passed since the last one (NodeUsage doubles as the enforcer's heartbeat).
    usage_heartbeat_seconds: float = setting(
        "TESSERA_USAGE_HEARTBEAT_SECONDS", "unchanged usage is published again this often", 30.0, above=0)
    # A workload claim without a live owner (and, for other launchers, without a live process) for
    # this long is released; its leftover processes are killed first.
    reclaim_seconds: float = setting(
        "TESSERA_RECLAIM_SECONDS", "a claim whose workload is gone is released after this grace period", 30.0,
        above=0)
    # A claim whose release is asked for (tessera release, a deleted tenant, preemption) keeps its
    # ledger entry until its processes are gone: SIGTERM, this long to stop, then SIGKILL.
    release_grace_seconds: float = setting(
        "TESSERA_RELEASE_GRACE_SECONDS", "how long a released claim's processes get between SIGTERM and SIGKILL; "
        "the claim's GPUs stay in the ledger until they are gone (0: SIGKILL at once)", 30.0, minimum=0)
    # Claims on a node marked lost (inventory label tessera.dev/lost=true) are released this long
    # after the mark by the designated enforcer, twice this long by any other.
    lost_reclaim_seconds: float = setting(
        "TESSERA_LOST_RECLAIM_SECONDS", "a lost node's claims are released by a peer enforcer after this long",
        60.0, above=0)
    # libvgpu charges each CUDA context this much (CUDA_DEVICE_CONTEXT_OVERHEAD in the claim's limits
    # file): the driver tells no process what its context took, so the node declares it for its GPUs.
    vgpu_context_overhead_mib: int = setting(
        "TESSERA_VGPU_CONTEXT_OVERHEAD_MIB", "device memory (MiB) each CUDA context of a claim is charged against "
        "the claim's limit (what a context takes on this node's GPUs: ~300-500 on an H100/H200; "
        "native/vgpu/tests/gpu/run.sh measures it); 0: contexts are not charged", 0, minimum=0)
    # The watchdog (watchdog.py) sweeps the claims' processes this often: an escapee (the GPU open
    # without libvgpu in force) is killed within one period of opening the GPU, plus one sweep.
    watchdog_seconds: float = setting(
        "TESSERA_WATCHDOG_SECONDS", "how often the enforcer looks for a claim's processes that use the GPU "
        "without libvgpu in force (and kills them)", 2.0, above=0)
    # The reconcile pass of start-up (prepared records whose event is missing, allocated claims not
    # prepared, releases left half done) runs again this often.
    reconcile_seconds: float = setting(
        "TESSERA_ENFORCER_RECONCILE_SECONDS", "how often the enforcer re-runs its start-up reconcile (unpublished "
        "`prepared`, unprepared allocations, half-done releases)", 30.0, above=0)
    # Where the kubelet's plugin watcher looks for registration sockets ...
    kubelet_registry_dir: Path = setting(
        "TESSERA_KUBELET_REGISTRY_DIR", "the kubelet's plugin registry directory: the registration socket "
        "`gpu.tessera.dev-reg.sock` goes here (absolute path)", Path("/var/lib/kubelet/plugins_registry"),
        parse=_absolute, group="kubernetes")
    # ... and the plugin's own directory: the DRA socket and the checkpoint of prepared claims.
    kubelet_plugin_dir: Path = setting(
        "TESSERA_KUBELET_PLUGIN_DIR", "the plugin's directory: the DRA socket `dra.sock`, the checkpoint of "
        "prepared claims `checkpoint.json` and its lock (absolute path)", Path(f"/var/lib/kubelet/plugins/{DRIVER}"),
        parse=_absolute, group="kubernetes")
    # The enforcer pod's uid (the downward API's metadata.uid): in the sockets' names, so that two
    # instances can serve side by side during a rolling update with a surge.
    pod_uid: str = setting(
        "TESSERA_POD_UID", "the enforcer pod's uid, put in the plugin's socket names (`gpu.tessera.dev-<uid>-reg.sock`, "
        "`dra-<uid>.sock`) so that a rolling update can start the new pod before the old one stops; empty: the "
        "fixed names", "", parse=_pod_uid, group="kubernetes")
    ready_when_registered: bool = setting(
        "TESSERA_KUBELET_READY_WHEN_REGISTERED", "`true`: ready (`/readyz`) only once the kubelet has registered the "
        "plugin, so that a rolling update stops the old instance only when the kubelet has the new one (deploy/k8s "
        "sets it); `false`: ready once the plugin's sockets listen (where no kubelet runs, or a test plays it)",
        False, group="kubernetes")
    # The kernel's id of this boot: a checkpoint written in another boot describes nothing that exists.
    boot_id_file: Path = setting(
        "TESSERA_BOOT_ID_FILE", "where the node's boot id is read; a checkpoint from another boot is dropped with "
        "what it names", Path("/proc/sys/kernel/random/boot_id"), group="kubernetes")

    def check(self) -> Iterable[str]:
        if not self.kubernetes:
            return
        registration, dra = socket_names(self.pod_uid)
        for variable, directory, name in (("TESSERA_KUBELET_REGISTRY_DIR", self.kubelet_registry_dir, registration),
                                          ("TESSERA_KUBELET_PLUGIN_DIR", self.kubelet_plugin_dir, dra)):
            over = too_long(directory / name)
            if over:
                # (the kubelet dials these paths as the plugin names them: a shorter mount would not do)
                fix = ("leave TESSERA_POD_UID empty for the fixed, shorter socket names (and update the DaemonSet "
                       "with maxSurge: 0, maxUnavailable: 1)") if self.pod_uid else "shorten the kubelet's --root-dir"
                yield (f"{variable}={directory}: the socket {directory / name} is {over} bytes too long for a unix "
                       f"socket's path ({MAX_PATH_BYTES} at most, for the kubelet as for the plugin); {fix}")

    @property
    def simulated(self) -> bool:
        return bool(self.sim_driver_dir)

    @property
    def driver_root_on_host(self) -> Path:
        """The driver root as the container runtime sees it (what a spec's mounts name)."""
        return self.host_driver_root or self.driver_root

    @property
    def tick_seconds(self) -> float:
        """How often the reclaim loop looks: often enough that the bound is grace + one tick."""
        return max(0.1, min(self.reclaim_seconds / 4, 2.0))
