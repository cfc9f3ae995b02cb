"""Reader of libvgpu's shared accounting file (the "Ledger").

Why this exists: every CUDA process of a workload runs ``libvgpu.so``, which charges its GPU memory
to a memory-mapped file named by ``CUDA_DEVICE_MEMORY_SHARED_CACHE``. That file is the only place
where a workload's real usage per device is known, so the node enforcer reads it for usage reports
and to check that limits hold. This module is the one Python definition of its layout (version 1,
defined in ``native/vgpu/src/ledger_layout.h``; keep the two in step).

Reading needs no lock for a snapshot that is consistent enough for reports (each field is written
atomically); ``lock=True`` takes the same fcntl read lock libvgpu's writers exclude, for an exact
snapshot. The file is written by the workload, so the reader treats it as hostile input: it never
waits on the lock (a lock held past ``lock_wait`` seconds raises ``VgpuCacheLocked``), reads a fixed
number of bytes with ``pread`` (no mapping a workload could truncate under it), and refuses any header
field that differs from layout version 1, so the slot count is bounded by the library's maximum. Liveness of a process slot is read the way libvgpu reads it: the owner holds a read lock
on the first byte of its slot, which the kernel drops when it dies, so a slot whose byte nobody
locks belongs to a dead process (its usage is not counted in ``DeviceUsage.used_bytes``).
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"TESSVGPU"
VERSION = 1
HEADER = struct.Struct("<8s8I3Q2I56x")  # 128 bytes
DEVICE = struct.Struct("<QII48sq56x")  # 128 bytes
PROC_HEAD = struct.Struct("<iIQQQ")  # 32 bytes, then max_devices x u64 used
PROC_LIVE = 1
DEVICE_UUID_SET = 1
# struct flock on Linux x86_64/aarch64: short l_type, short l_whence, off_t l_start, off_t l_len,
# pid_t l_pid (+ padding to 32 bytes)
_FLOCK = struct.Struct("@hhqqi0q")
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
# Layout version 1, exactly as ledger_layout.h defines it: anything else in a header is refused.
MAX_DEVICES = 16
MAX_PROCS = 1024
DEVICES_OFFSET = HEADER.size
PROCS_OFFSET = DEVICES_OFFSET + MAX_DEVICES * DEVICE.size
PROC_SIZE = PROC_HEAD.size + 8 * MAX_DEVICES
FILE_SIZE = PROCS_OFFSET + MAX_PROCS * PROC_SIZE
_LOCK_POLL = 0.002  # seconds between tries of a lock libvgpu holds for microseconds per update


class VgpuCacheError(Exception):
    """The file is missing, too short, or not a libvgpu accounting file of a known version."""


class VgpuCacheLocked(VgpuCacheError):
    """Someone held the file's update lock longer than the reader waits: a stuck or hostile workload."""


@dataclass(frozen=True)
class DeviceUsage:
    index: int
    uuid: str | None
    limit_bytes: int | None  # None: no memory limit
    sm_limit_percent: int | None  # None: no SM limit
    used_bytes: int  # summed over live processes


@dataclass(frozen=True)
class ProcessUsage:
    slot: int
    pid: int  # in the process's own pid namespace
    start_time: int  # clock ticks after boot (/proc/<pid>/stat field 22)
    pidns: int  # inode of /proc/<pid>/ns/pid
    alive: bool
    used_bytes: tuple[int, ...]  # per device index
    cache: str = ""  # the accounting file the slot was read from (its process holds it open)


@dataclass(frozen=True)
class VgpuSnapshot:
    path: str
    version: int
    devices: tuple[DeviceUsage, ...]  # indices 0 .. device_count-1 and any with a limit
    processes: tuple[ProcessUsage, ...]  # live slots, and dead ones not yet reclaimed

    @property
    def live_processes(self) -> tuple[ProcessUsage, ...]:
        return tuple(p for p in self.processes if p.alive)

    def device(self, index: int) -> DeviceUsage:
        for d in self.devices:
            if d.index == index:
                return d
        raise KeyError(index)


def _slot_locked(fd: int, offset: int) -> bool | None:
    probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    try:
        got = fcntl.fcntl(fd, _F_OFD_GETLK, probe)
    except OSError:
        return None
    return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK


def _alive_by_proc(pid: int, start_time: int, pidns: int) -> bool:
    """Fallback when locks cannot be probed: /proc, valid only in the same pid namespace."""
    try:
        if pidns and os.stat("/proc/self/ns/pid").st_ino != pidns:
            return True  # cannot tell from here; do not drop its usage
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] not in ("Z", "X") and int(fields[19]) == start_time


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, 0, 1, 0))
    except (BlockingIOError, PermissionError):
        return False
    except OSError as e:
        if e.errno in (11, 13):  # EAGAIN, EACCES: held by someone else
            return False
        raise
    return True


def _lock_within(fd: int, path: str, wait: float) -> None:
    deadline = time.monotonic() + wait
    while not _try_lock(fd, fcntl.F_RDLCK):
        if time.monotonic() >= deadline:
            raise VgpuCacheLocked(
                f"{path}: the update lock has been held for more than {wait:g} s by a process of the "
                "workload; not waiting for it (a libvgpu update holds it for microseconds)"
            )
        time.sleep(_LOCK_POLL)


def read_vgpu_cache(path: str | os.PathLike[str], *, lock: bool = False, lock_wait: float = 0.1) -> VgpuSnapshot:
    """Read the accounting file at ``path``; raise VgpuCacheError if it is not a valid one.

    With ``lock``, wait at most ``lock_wait`` seconds for the update lock (VgpuCacheLocked after)."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError as e:
        raise VgpuCacheError(f"{path}: no such accounting file") from e
    except OSError as e:
        raise VgpuCacheError(f"{path}: cannot open: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise VgpuCacheError(f"{path}: not a regular file")
        if st.st_size < HEADER.size:
            raise VgpuCacheError(f"{path}: {st.st_size} bytes, too short for a libvgpu accounting file")
        if lock:
            _lock_within(fd, path, lock_wait)
        try:
            data = os.pread(fd, FILE_SIZE, 0)
            return _parse(path, fd, data)
        finally:
            if lock:
                fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0))
    finally:
        os.close(fd)


def _check_header(path: str, fields: tuple, size: int) -> int:
    """Every header field against layout version 1; returns the number of process slots to read."""
    (magic, version, header_size, max_devices, max_procs, device_count, device_size, proc_size, _flags,
     devices_offset, procs_offset, file_size, proc_hwm, _r0) = fields
    if magic != MAGIC:
        raise VgpuCacheError(f"{path}: wrong magic {magic!r}, not a libvgpu accounting file")
    if version != VERSION:
        raise VgpuCacheError(f"{path}: layout version {version}, this reader knows {VERSION}")
    want = {"header_size": (header_size, HEADER.size), "max_devices": (max_devices, MAX_DEVICES),
            "max_procs": (max_procs, MAX_PROCS), "device_record_size": (device_size, DEVICE.size),
            "proc_record_size": (proc_size, PROC_SIZE), "devices_offset": (devices_offset, DEVICES_OFFSET),
            "procs_offset": (procs_offset, PROCS_OFFSET), "file_size": (file_size, FILE_SIZE)}
    for name, (got, expected) in want.items():
        if got != expected:
            raise VgpuCacheError(f"{path}: header field {name} is {got}, layout version {VERSION} has {expected}")
    if device_count > MAX_DEVICES or proc_hwm > MAX_PROCS:
        raise VgpuCacheError(f"{path}: header counts out of range (device_count {device_count}, proc_hwm "
                             f"{proc_hwm}; at most {MAX_DEVICES} and {MAX_PROCS})")
    if size < FILE_SIZE:
        raise VgpuCacheError(f"{path}: {size} bytes, the header says {file_size}")
    return proc_hwm


def _parse(path: str, fd: int, m: bytes) -> VgpuSnapshot:
    fields = HEADER.unpack_from(m, 0)
    proc_hwm = _check_header(path, fields, len(m))
    version, device_count = fields[1], fields[5]
    used_fmt = struct.Struct(f"<{MAX_DEVICES}Q")
    processes = []
    for k in range(proc_hwm):
        off = PROCS_OFFSET + k * PROC_SIZE
        pid, state, start_time, pidns, _res = PROC_HEAD.unpack_from(m, off)
        if state != PROC_LIVE:
            continue
        used = used_fmt.unpack_from(m, off + PROC_HEAD.size)
        alive = _slot_locked(fd, off)
        if alive is None:
            alive = _alive_by_proc(pid, start_time, pidns)
        processes.append(ProcessUsage(k, pid, start_time, pidns, alive, tuple(used), path))
    devices = []
    for i in range(MAX_DEVICES):
        mem_limit, sm_limit, dflags, uuid, _tat = DEVICE.unpack_from(m, DEVICES_OFFSET + i * DEVICE.size)
        if i >= device_count and not mem_limit and not sm_limit:
            continue
        device_used = sum(p.used_bytes[i] for p in processes if p.alive)
        devices.append(DeviceUsage(
            index=i,
            uuid=uuid.split(b"\0", 1)[0].decode("ascii", "replace") if dflags & DEVICE_UUID_SET else None,
            limit_bytes=mem_limit or None,
            sm_limit_percent=sm_limit or None,
            used_bytes=device_used,
        ))
    return VgpuSnapshot(path=path, version=version, devices=tuple(devices), processes=tuple(processes))
