"""Real-GPU discovery through NVML (mode 2: a GPU machine without Kubernetes).

Reads this machine's GPUs with nvidia-ml-py: UUID, model name, memory and SM count, the same fields a
simulated profile gives. On a machine without a driver it fails with a message saying so, rather
than announcing an empty node.
"""

from __future__ import annotations

import os
import socket

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


def discover_local_node(node: str | None = None) -> NodeInventory:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise RuntimeError(
            f"NVML is not available ({exc}): this machine has no NVIDIA driver; use TESSERA_DISCOVERY=profile"
        ) from None
    try:
        devices = []
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
                )
            )
    finally:
        pynvml.nvmlShutdown()
    name = node or os.environ.get("TESSERA_NODE") or socket.gethostname().lower()
    return NodeInventory(node=name, devices=devices, cpu_millis=(os.cpu_count() or 1) * 1000)
