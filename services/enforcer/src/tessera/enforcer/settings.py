"""The enforcer's one frozen settings object, read from the environment once at start-up.

Everything an operator may tune about a node agent lives here with its variable name, so a bad value
fails start-up with that name instead of surfacing later as odd behaviour: where claim state lives,
which libvgpu.so and (on a simulated fleet) which driver directory a workload gets, how often usage is
sampled and published, the bounded times after which leaked claims are released, and, in
Kubernetes mode, where the kubelet meets its DRA plugin and the container runtime its CDI specs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from tessera.shared.errors import ConfigError
from tessera.shared.kubeclaims import DRIVER
from tessera.shared.settings import env_bool, env_float, env_int, env_str


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


def _has_nvidia_driver() -> bool:
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/version").exists()


def _sim_driver_dir(env: Mapping[str, str]) -> str:
    """TESSERA_SIM_DRIVER_DIR: a directory with the simulated libcuda.so.1 (simulated fleet), or
    "none" for the real driver. Unset: the in-tree simulated driver on a machine without an NVIDIA
    driver, the real driver otherwise."""
    raw = env.get("TESSERA_SIM_DRIVER_DIR")
    if raw is not None and raw.strip().lower() in ("", "none", "off", "real"):
        return ""
    if raw:
        path = Path(raw)
        if not (path / "libcuda.so.1").exists():
            raise ConfigError(f"TESSERA_SIM_DRIVER_DIR={raw!r} has no libcuda.so.1; build it with 'make -C native/vgpu'")
        return str(path.resolve())
    if _has_nvidia_driver():
        return ""
    found = _in_tree("sim", "libcuda.so.1")
    return str(found.parent) if found else ""


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    value = env_float(env, name, default)
    if value <= 0:
        raise ConfigError(f"{name}={value} must be a positive number of seconds")
    return value


def _absolute(name: str, raw: str) -> Path:
    """A directory the kubelet shares: an absolute path, since the kubelet resolves it, not us."""
    path = Path(raw)
    if not path.is_absolute():
        raise ConfigError(f"{name}={str(path)!r} must be an absolute path (the kubelet's directory on the node)")
    return path


@dataclass(frozen=True)
class EnforcerSettings:
    node: str
    state_dir: Path
    cdi_dir: Path
    libvgpu: str
    # Directory of the simulated driver; "" = the real driver (its env gets no LD_LIBRARY_PATH).
    sim_driver_dir: str = ""
    # How often accounting files are read; a ClaimUsage/NodeUsage is published when it changed ...
    usage_seconds: float = 2.0
    # ... or when this long passed since the last one (NodeUsage doubles as the enforcer's heartbeat).
    usage_heartbeat_seconds: float = 30.0
    # A workload claim without a live owner (and, for other launchers, without a live process) for
    # this long is released; its leftover processes are killed first.
    reclaim_seconds: float = 30.0
    # Claims on a node marked lost (inventory label tessera.dev/lost=true) are released this long
    # after the mark by the designated enforcer, twice this long by any other.
    lost_reclaim_seconds: float = 60.0
    # The reconcile pass of start-up (prepared records whose event is missing, allocated claims not
    # prepared, releases left half done) runs again this often.
    reconcile_seconds: float = 30.0
    # Kubernetes mode: the enforcer is the kubelet's DRA plugin of driver gpu.tessera.dev; claims
    # that stand for a ResourceClaim are prepared when the kubelet asks, not on ``allocated``.
    kubernetes: bool = False
    # Where the kubelet's plugin watcher looks for registration sockets ...
    kubelet_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    # ... and the plugin's own directory: the DRA socket and the checkpoint of prepared claims.
    kubelet_plugin_dir: Path = Path(f"/var/lib/kubelet/plugins/{DRIVER}")
    # The kernel's id of this boot: a checkpoint written in another boot describes nothing that exists.
    boot_id_file: Path = Path("/proc/sys/kernel/random/boot_id")
    # Host mode: where to install libvgpu's node file making enforcement mandatory (None: not
    # installed; /etc/tessera/vgpu.conf on a node whose host processes use the GPUs). See
    # docs/isolation-host-mode.md.
    vgpu_node_config: Path | None = None

    @property
    def simulated(self) -> bool:
        return bool(self.sim_driver_dir)

    @property
    def tick_seconds(self) -> float:
        """How often the reclaim loop looks: often enough that the bound is grace + one tick."""
        return max(0.1, min(self.reclaim_seconds / 4, 2.0))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "EnforcerSettings":
        env = os.environ if env is None else env
        node = env.get("TESSERA_NODE", "")
        if not node:
            raise ConfigError("TESSERA_NODE is not set: name the node this enforcer runs on")
        state = Path(env_str(env, "TESSERA_STATE_DIR", f"var/enforcer/{node}")).resolve()
        kubernetes = env_bool(env, "TESSERA_KUBERNETES", cls.kubernetes)
        # A container runtime reads CDI specs from /var/run/cdi; a local fleet keeps its own.
        cdi_default = "/var/run/cdi" if kubernetes else str(state / "cdi")
        return cls(
            node=node,
            state_dir=state,
            cdi_dir=Path(env_str(env, "TESSERA_CDI_DIR", cdi_default)),
            libvgpu=env_str(env, "TESSERA_LIBVGPU", _default_libvgpu()),
            sim_driver_dir=_sim_driver_dir(env),
            usage_seconds=_positive(env, "TESSERA_USAGE_SECONDS", cls.usage_seconds),
            usage_heartbeat_seconds=_positive(env, "TESSERA_USAGE_HEARTBEAT_SECONDS", cls.usage_heartbeat_seconds),
            reclaim_seconds=_positive(env, "TESSERA_RECLAIM_SECONDS", cls.reclaim_seconds),
            lost_reclaim_seconds=_positive(env, "TESSERA_LOST_RECLAIM_SECONDS", cls.lost_reclaim_seconds),
            reconcile_seconds=_positive(env, "TESSERA_ENFORCER_RECONCILE_SECONDS", cls.reconcile_seconds),
            kubernetes=kubernetes,
            kubelet_registry_dir=_absolute("TESSERA_KUBELET_REGISTRY_DIR", env_str(
                env, "TESSERA_KUBELET_REGISTRY_DIR", str(cls.kubelet_registry_dir))),
            kubelet_plugin_dir=_absolute("TESSERA_KUBELET_PLUGIN_DIR", env_str(
                env, "TESSERA_KUBELET_PLUGIN_DIR", str(cls.kubelet_plugin_dir))),
            boot_id_file=Path(env_str(env, "TESSERA_BOOT_ID_FILE", str(cls.boot_id_file))),
            vgpu_node_config=_absolute("TESSERA_VGPU_NODE_CONFIG", env_str(env, "TESSERA_VGPU_NODE_CONFIG", ""))
            if env_str(env, "TESSERA_VGPU_NODE_CONFIG", "") else None,
        )
