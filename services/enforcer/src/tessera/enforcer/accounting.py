"""Reading a workload's shared accounting file (the file libvgpu.so maps in every process).

The layout is native/vgpu/src/ledger_layout.h, version 1: a header, 16 device records (limit, SM
share, UUID) and 1024 process slots (pid, start time, pid-namespace inode, bytes used per device). A
slot counts only while its owner holds the read lock on the slot's first byte: the kernel drops that
lock when the process dies however it dies, so this needs no /proc scan and is immune to pid reuse.
A snapshot is taken under a read lock on byte 0, the lock libvgpu writes under.

This reader is the enforcer's until ``tessera.shared.vgpu_cache`` (the shared reader the native/vgpu
contract names) exists; it reads only, never writes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"TESSVGPU"
VERSION = 1
HEADER = struct.Struct("<8sIIIIIIII QQQ II")  # up to proc_hwm / reserved0
DEVICE = struct.Struct("<QII48sq")  # mem_limit, sm_limit, flags, uuid, sm_tat_ns
PROC = struct.Struct("<iIQQQ")  # pid, state, start_time, pidns, reserved (then used[max_devices])
PROC_LIVE = 1
UUID_SET = 1

# struct flock on Linux (x86_64 and aarch64): short type, short whence, off_t start, off_t len, pid_t pid
_FLOCK = "@hhqqi4x"
F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)


class AccountingError(Exception):
    """The file exists but is not an accounting file this reader understands."""


@dataclass(frozen=True)
class DeviceRecord:
    index: int
    uuid: str
    limit_bytes: int  # 0 = no limit recorded
    sm_limit: int  # percent, 0 = none


@dataclass(frozen=True)
class ProcessSlot:
    slot: int
    pid: int
    start_time: int  # clock ticks after boot (field 22 of /proc/<pid>/stat)
    pidns: int  # inode of /proc/<pid>/ns/pid
    used: tuple[int, ...]  # bytes per device


@dataclass(frozen=True)
class Snapshot:
    devices: list[DeviceRecord] = field(default_factory=list)
    processes: list[ProcessSlot] = field(default_factory=list)  # live ones only

    def used(self, device: int) -> int:
        return sum(p.used[device] for p in self.processes if device < len(p.used))

    def device(self, index: int) -> DeviceRecord | None:
        return next((d for d in self.devices if d.index == index), None)


EMPTY = Snapshot()


def _lock(fd: int, cmd: int, kind: int, start: int) -> bytes:
    return fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, start, 1, 0))


def _held(fd: int, start: int) -> bool:
    """Is any other open file description holding a lock on byte ``start``?"""
    try:
        result = _lock(fd, F_OFD_GETLK, fcntl.F_WRLCK, start)
    except OSError:
        return True  # cannot tell: count it as live (never release what may be in use)
    return struct.unpack(_FLOCK, result)[0] != fcntl.F_UNLCK


def read(path: str | Path) -> Snapshot:
    """A consistent snapshot of the file; EMPTY if no process has created it yet. Blocking (brief)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return EMPTY
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return EMPTY  # created by the enforcer, not yet sized by libvgpu
        try:
            _lock(fd, F_OFD_SETLKW, fcntl.F_RDLCK, 0)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOLCK):
                raise
        try:
            head = os.pread(fd, HEADER.size, 0)
            if len(head) < HEADER.size:
                return EMPTY
            (magic, version, _hsize, max_devices, max_procs, device_count, dev_size, proc_size, _flags,
             dev_off, proc_off, file_size, proc_hwm, _r0) = HEADER.unpack(head)
            if magic == b"\0" * 8:
                return EMPTY
            if magic != MAGIC or version != VERSION:
                raise AccountingError(f"{path}: not a version-{VERSION} accounting file (magic {magic!r}, version {version})")
            if size < file_size or max_devices > 64 or max_procs > 65536:
                raise AccountingError(f"{path}: truncated or implausible header")
            devices_raw = os.pread(fd, max_devices * dev_size, dev_off)
            hwm = min(proc_hwm, max_procs)
            procs_raw = os.pread(fd, hwm * proc_size, proc_off)
            devices = []
            for d in range(min(max(device_count, 0), max_devices)):
                limit, sm, flags, uuid, _tat = DEVICE.unpack_from(devices_raw, d * dev_size)
                text = uuid.split(b"\0", 1)[0].decode("ascii", "replace") if flags & UUID_SET else ""
                devices.append(DeviceRecord(index=d, uuid=text, limit_bytes=limit, sm_limit=sm))
            processes = []
            used_fmt = struct.Struct(f"<{max_devices}Q")
            for k in range(hwm):
                base = k * proc_size
                pid, state, start_time, pidns, _res = PROC.unpack_from(procs_raw, base)
                if state != PROC_LIVE or not _held(fd, proc_off + k * proc_size):
                    continue  # free, or its process died (libvgpu reclaims the slot lazily)
                used = used_fmt.unpack_from(procs_raw, base + PROC.size)
                processes.append(ProcessSlot(slot=k, pid=pid, start_time=start_time, pidns=pidns, used=used))
            return Snapshot(devices=devices, processes=processes)
        finally:
            try:
                _lock(fd, F_OFD_SETLK, fcntl.F_UNLCK, 0)
            except OSError:
                pass
    finally:
        os.close(fd)
