"""Real-GPU discovery through NVML (mode 2: a GPU machine without Kubernetes).

Reads this machine's GPUs with nvidia-ml-py: UUID, model name, memory and SM count, the same fields a
simulated profile gives, and what DRA users select on (architecture, CUDA compute capability, the
driver's version, PCI bus id). A fact this driver's NVML cannot give is left empty (and so out of
the ResourceSlice) rather than failing discovery. On a machine without a driver it fails with a
message saying so, rather than announcing an empty node.
"""

from __future__ import annotations

import os
import socket
from typing import Any, TypedDict

import pynvml

from tessera.shared.events import GpuDevice, NodeInventory

# SM counts by model, for drivers whose NVML lacks nvmlDeviceGetNumGpuCores-style queries.
_SMS = {"H200": 132, "H100": 132, "A100": 108, "A10": 72, "L40": 142, "L4": 58, "T4": 40, "V100": 80}


def _sm_count(name: str) -> int:
    for key, sms in _SMS.items():
        if key in name:
            return sms
    return 100


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# nvmlDeviceGetArchitecture's enum, named as NVIDIA names the architectures.
_ARCHITECTURES = {
    "KEPLER": "Kepler", "MAXWELL": "Maxwell", "PASCAL": "Pascal", "VOLTA": "Volta", "TURING": "Turing",
    "AMPERE": "Ampere", "ADA": "Ada Lovelace", "HOPPER": "Hopper", "BLACKWELL": "Blackwell", "RUBIN": "Rubin",
}
_ARCH_BY_CODE = {getattr(pynvml, f"NVML_DEVICE_ARCH_{k}"): v for k, v in _ARCHITECTURES.items()
                 if hasattr(pynvml, f"NVML_DEVICE_ARCH_{k}")}


def _optional(query, *args) -> Any | None:  # (pynvml has no types: its answers are Any)
    """An NVML query an older driver (or a GPU model) may not support: None instead of an error."""
    try:
        return query(*args)
    except (pynvml.NVMLError, AttributeError):
        return None


class _Facts(TypedDict):
    """`GpuDevice`'s descriptive fields, as keyword arguments."""
    architecture: str
    compute_capability: str
    driver_version: str
    pci_bus_id: str


def _facts(handle, driver_version: str) -> _Facts:
    arch = _optional(pynvml.nvmlDeviceGetArchitecture, handle)
    capability = _optional(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    pci = _optional(pynvml.nvmlDeviceGetPciInfo, handle)
    return {
        "architecture": _ARCH_BY_CODE.get(arch, "") if arch is not None else "",
        "compute_capability": f"{capability[0]}.{capability[1]}" if capability else "",
        "driver_version": driver_version,
        "pci_bus_id": _text(pci.busId) if pci is not None else "",
    }


def discover_local_node(node: str | None = None) -> NodeInventory:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise RuntimeError(
            f"NVML is not available ({exc}): this machine has no NVIDIA driver; use TESSERA_DISCOVERY=profile"
        ) from None
    try:
        devices = []
        driver_version = _text(_optional(pynvml.nvmlSystemGetDriverVersion) or "")
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(pynvml.nvmlDeviceGetName(handle))
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(
                GpuDevice(
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    index=i,
                    model=name,
                    memory_mib=int(memory.total // (1024 * 1024)),
                    sm_count=_sm_count(name),
                    **_facts(handle, driver_version),
                )
            )
    finally:
        pynvml.nvmlShutdown()
    name = node or socket.gethostname().lower()
    return NodeInventory(node=name, devices=devices, cpu_millis=(os.cpu_count() or 1) * 1000)


def device_health(uuids: list[str]) -> dict[str, bool]:
    """uuid -> whether NVML can still query the GPU (a GPU fallen off the bus, or one NVML reports
    lost, cannot be)."""
    health = {u: False for u in uuids}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return health  # the driver itself is gone: so are its GPUs
    try:
        for u in uuids:
            try:
                pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(u.encode()))
                health[u] = True
            except pynvml.NVMLError:
                pass
    finally:
        pynvml.nvmlShutdown()
    return health
