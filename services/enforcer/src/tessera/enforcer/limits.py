"""The environment that libvgpu.so reads, computed from an allocation.

These names are HAMi's (so existing images and tools keep working): ``CUDA_DEVICE_MEMORY_LIMIT_<i>``
per visible device, ``CUDA_DEVICE_SM_LIMIT`` (and per device ``CUDA_DEVICE_SM_LIMIT_<i>``),
``CUDA_DEVICE_MEMORY_SHARED_CACHE``; visibility through ``CUDA_VISIBLE_DEVICES`` /
``NVIDIA_VISIBLE_DEVICES`` with the allocated UUIDs, in the order the claim's devices are numbered.
The same limits are also written as a libvgpu config file (``TESSERA_VGPU_CONFIG``): libvgpu takes
the lowest limit over all its sources, so the file is the ceiling a workload cannot lift by editing
its own environment. On a simulated fleet the simulated driver is told, through its own variables,
to show exactly the allocated GPUs (it does not read CUDA_VISIBLE_DEVICES). A claim with a runtime
priority (HAMi's ``nvidia.com/priority``, ``ClaimSpec.task_priority``) has it in the file too, with
its GPUs' priority boards (``RuntimePriority``; native/vgpu/src/priority.c): only the file can say
it, so a workload cannot make itself high priority.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from tessera.shared.events import DeviceShare, GpuDevice

# Set in the prepared environment for `tessera run`, which holds that file locked while it lives.
from tessera.shared.workload import OWNER_LOCK_VAR  # noqa: F401  (re-exported for the enforcer)


def limit_vars(shares: list[DeviceShare]) -> dict[str, str]:
    """HAMi's limit variables, device i being the claim's i-th GPU in index order."""
    env: dict[str, str] = {}
    ordered = sorted(shares, key=lambda s: s.index)
    for i, share in enumerate(ordered):
        env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{share.memory_mib}m"
        if 0 < share.cores < 100:
            env[f"CUDA_DEVICE_SM_LIMIT_{i}"] = str(share.cores)
    limited = [s.cores for s in ordered if 0 < s.cores < 100]
    if limited and len(limited) == len(ordered) and len(set(limited)) == 1:
        env["CUDA_DEVICE_SM_LIMIT"] = str(limited[0])
    return env


def workload_env(
    shares: list[DeviceShare], cache_path: str | Path, *, libvgpu: str | Path | None = None
) -> dict[str, str]:
    ordered = sorted(shares, key=lambda s: s.index)
    uuids = ",".join(s.uuid for s in ordered)
    env = {"CUDA_VISIBLE_DEVICES": uuids, "NVIDIA_VISIBLE_DEVICES": uuids}
    env.update(limit_vars(shares))
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(cache_path)
    if libvgpu:
        env["LD_PRELOAD"] = str(libvgpu)
    return env


@dataclass(frozen=True)
class RuntimePriority:
    """A claim's runtime priority: ``level`` 0 (high) or 1 (low), and the priority board of each of
    its GPUs by UUID, the file where the claims of one GPU meet (high ones write it, low ones read)."""

    level: int
    boards: Mapping[str, Path]

    @property
    def writes_boards(self) -> bool:
        return self.level == 0


def vgpu_config(shares: list[DeviceShare], cache_path: str | Path, *, context_overhead_mib: int = 0,
                priority: RuntimePriority | None = None) -> str:
    """The claim's limits as a libvgpu config file: ceilings a workload's own environment cannot lift.

    It names the claim's GPUs by UUID in the order the limits are numbered, so libvgpu applies each
    limit to its GPU (and gives a GPU outside the claim no memory) whatever order the workload's own
    CUDA_VISIBLE_DEVICES puts them in, or if it unsets it. ``context_overhead_mib``: what each CUDA
    context is charged against the limits (a floor: a workload's own value can only raise it).
    ``priority``: the claim's runtime priority and its GPUs' boards, numbered as the limits are."""
    lines = ["# written by the Tessera enforcer; libvgpu applies the lowest limit of all its sources"]
    lines.append("CUDA_VISIBLE_DEVICES=" + ",".join(s.uuid for s in sorted(shares, key=lambda s: s.index)))
    lines += [f"{k}={v}" for k, v in limit_vars(shares).items()]
    if context_overhead_mib > 0:
        lines.append(f"CUDA_DEVICE_CONTEXT_OVERHEAD={context_overhead_mib}m")
    if priority is not None:
        lines.append(f"CUDA_TASK_PRIORITY={priority.level}")
        for i, share in enumerate(sorted(shares, key=lambda s: s.index)):
            lines.append(f"TESSERA_VGPU_PRIORITY_BOARD_{i}={priority.boards[share.uuid]}")
    lines.append(f"CUDA_DEVICE_MEMORY_SHARED_CACHE={cache_path}")
    return "\n".join(lines) + "\n"


def node_config(claims_dir: str | Path) -> str:
    """libvgpu's node file for host mode: enforcement is mandatory, and a claim's limits file is
    trusted only if it is root's alone and under ``claims_dir`` (native/vgpu/README.md, rule 5)."""
    return ("# written by the Tessera enforcer: a CUDA process without a trusted claim file gets no GPU memory\n"
            "TESSERA_VGPU_ENFORCE=required\n"
            f"TESSERA_VGPU_CLAIMS_DIR={claims_dir}\n")


def simulated_driver_env(shares: list[DeviceShare], devices: Mapping[str, GpuDevice], driver_dir: str) -> dict[str, str]:
    """What the simulated libcuda/libnvidia-ml need to show exactly the claim's GPUs."""
    ordered = sorted(shares, key=lambda s: s.index)
    env = {
        "LD_LIBRARY_PATH": driver_dir,
        "TESSERA_SIM_GPU_COUNT": str(len(ordered)),
        "TESSERA_SIM_GPU_UUIDS": ",".join(s.uuid for s in ordered),
    }
    known = [devices[s.uuid] for s in ordered if s.uuid in devices]
    if known:
        # The simulated driver has one memory size and model for all its GPUs: a claim's GPUs on one
        # node are normally alike; where not, the smallest is the honest answer.
        smallest = min(known, key=lambda d: d.memory_mib)
        env["TESSERA_SIM_GPU_MEMORY_MIB"] = str(smallest.memory_mib)
        env["TESSERA_SIM_GPU_SM_COUNT"] = str(smallest.sm_count)
        env["TESSERA_SIM_GPU_NAME"] = smallest.model
    return env
