"""The enforcer's view of a claim's shared accounting file (the file libvgpu.so maps in every process).

The layout and the reader are ``tessera.shared.vgpu_cache``; this adapter adds what the enforcer
needs on top: the enforcer creates the file empty (so any user's workload can size it), and an empty
or absent file means "no CUDA process has started yet", not an error. Snapshots are taken under the
read lock libvgpu's writers exclude, so a slot is never seen half-registered. The file is the
workload's to write, so the read is bounded: the lock is waited for at most LOCK_WAIT seconds
(VgpuCacheLocked after: reported, never waited out, so one workload cannot stall the node's observe
loop) and the header is range-checked by the reader. Brief but blocking: call it from a worker thread.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tessera.shared.vgpu_cache import (
    DeviceUsage,
    ProcessUsage,
    VgpuCacheError,
    VgpuCacheLocked,
    VgpuSnapshot,
    read_vgpu_cache,
)

__all__ = ["EMPTY", "LOCK_WAIT", "DeviceUsage", "ProcessUsage", "VgpuCacheError", "VgpuCacheLocked", "VgpuSnapshot",
           "device", "read", "used"]

EMPTY = VgpuSnapshot(path="", version=0, devices=(), processes=())
# libvgpu holds the update lock for microseconds; a tenth of a second is a stuck or hostile holder.
LOCK_WAIT = 0.1


def read(path: str | Path) -> VgpuSnapshot:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return EMPTY
    if not stat.S_ISREG(st.st_mode):
        raise VgpuCacheError(f"{path}: not a regular file")
    if st.st_size == 0:
        return EMPTY
    return read_vgpu_cache(path, lock=True, lock_wait=LOCK_WAIT)


def device(snapshot: VgpuSnapshot, index: int) -> DeviceUsage | None:
    return next((d for d in snapshot.devices if d.index == index), None)


def used(snapshot: VgpuSnapshot, index: int) -> int:
    d = device(snapshot, index)
    return d.used_bytes if d is not None else 0
