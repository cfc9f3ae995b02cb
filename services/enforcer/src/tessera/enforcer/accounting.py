"""The enforcer's view of a claim's shared accounting file (the file libvgpu.so maps in every process).

The layout and the reader are ``tessera.shared.vgpu_cache``; this adapter adds what the enforcer
needs on top: the enforcer creates the file empty (so any user's workload can size it), and an empty
or absent file means "no CUDA process has started yet", not an error. Snapshots are taken under the
read lock libvgpu's writers exclude, so a slot is never seen half-registered. Blocking but brief:
call it from a worker thread.
"""

from __future__ import annotations

import os
from pathlib import Path

from tessera.shared.vgpu_cache import DeviceUsage, ProcessUsage, VgpuCacheError, VgpuSnapshot, read_vgpu_cache

__all__ = ["EMPTY", "DeviceUsage", "ProcessUsage", "VgpuCacheError", "VgpuSnapshot", "device", "read", "used"]

EMPTY = VgpuSnapshot(path="", version=0, devices=(), processes=())


def read(path: str | Path) -> VgpuSnapshot:
    try:
        if os.stat(path).st_size == 0:
            return EMPTY
    except FileNotFoundError:
        return EMPTY
    return read_vgpu_cache(path, lock=True)


def device(snapshot: VgpuSnapshot, index: int) -> DeviceUsage | None:
    return next((d for d in snapshot.devices if d.index == index), None)


def used(snapshot: VgpuSnapshot, index: int) -> int:
    d = device(snapshot, index)
    return d.used_bytes if d is not None else 0
