"""The environment that libvgpu.so reads, computed from an allocation.

These names are HAMi's (so existing images and tools keep working): ``CUDA_DEVICE_MEMORY_LIMIT_<i>``
per visible device, ``CUDA_DEVICE_SM_LIMIT`` (and per device ``CUDA_DEVICE_SM_LIMIT_<i>``),
``CUDA_DEVICE_MEMORY_SHARED_CACHE``; visibility through ``CUDA_VISIBLE_DEVICES`` /
``NVIDIA_VISIBLE_DEVICES`` with the allocated UUIDs, in the order the claim's devices are numbered.
"""

from __future__ import annotations

from pathlib import Path

from tessera.shared.events import DeviceShare


def workload_env(
    shares: list[DeviceShare], cache_path: str | Path, *, libvgpu: str | Path | None = None
) -> dict[str, str]:
    env: dict[str, str] = {}
    ordered = sorted(shares, key=lambda s: s.index)
    uuids = ",".join(s.uuid for s in ordered)
    env["CUDA_VISIBLE_DEVICES"] = uuids
    env["NVIDIA_VISIBLE_DEVICES"] = uuids
    for i, share in enumerate(ordered):
        env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{share.memory_mib}m"
        if 0 < share.cores < 100:
            env[f"CUDA_DEVICE_SM_LIMIT_{i}"] = str(share.cores)
    limited = [s.cores for s in ordered if 0 < s.cores < 100]
    if limited and len(set(limited)) == 1:
        env["CUDA_DEVICE_SM_LIMIT"] = str(limited[0])
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(cache_path)
    if libvgpu:
        env["LD_PRELOAD"] = str(libvgpu)
    return env
