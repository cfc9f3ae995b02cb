"""What the isolation tests share: writing an accounting file as a hostile tenant would (any header,
any slot), holding its locks, and starting the hostile workload program. Named apart from conftest so
importing it never picks up another directory's fixtures."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
from pathlib import Path

from tessera.shared import vgpu_cache as vc

HERE = Path(__file__).resolve().parent
_FLOCK = struct.Struct("@hhqqi0q")
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
# layout version 1 (ledger_layout.h), spelled out here so the attacks do not depend on the reader
MAX_DEVICES, MAX_PROCS, PROC_SIZE = 16, 1024, 160
DEVICES_OFFSET = 128
PROCS_OFFSET = DEVICES_OFFSET + MAX_DEVICES * 128
FILE_SIZE = PROCS_OFFSET + MAX_PROCS * PROC_SIZE


def forge(path: Path, slots: list[tuple[int, int, int]], *, max_procs: int = MAX_PROCS,
          proc_hwm: int | None = None, size: int | None = None) -> None:
    """Write an accounting file whose header says ``max_procs`` and whose first slots are ``slots``
    ((pid, start_time, pidns), each marked live), sized ``size`` (sparse) or as the header says."""
    procs_offset = PROCS_OFFSET
    file_size = procs_offset + max_procs * PROC_SIZE
    header = vc.HEADER.pack(vc.MAGIC, vc.VERSION, vc.HEADER.size, MAX_DEVICES, max_procs, 1, vc.DEVICE.size,
                            PROC_SIZE, 0, DEVICES_OFFSET, procs_offset, file_size,
                            len(slots) if proc_hwm is None else proc_hwm, 0)
    with open(path, "wb") as f:
        f.truncate(size if size is not None else file_size)
        f.write(header)
        f.seek(DEVICES_OFFSET)
        f.write(vc.DEVICE.pack(64 << 20, 0, 0, b"", 0))
        for k, (pid, start, pidns) in enumerate(slots):
            f.seek(procs_offset + k * PROC_SIZE)
            f.write(vc.PROC_HEAD.pack(pid, vc.PROC_LIVE, start, pidns, 0) + struct.pack("<16Q", 1 << 20, *[0] * 15))


def hold_slots(path: Path, n: int) -> int:
    """Read-lock the first bytes of slots 0..n-1 as their live owners would; the fd keeps them."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, PROCS_OFFSET, n * PROC_SIZE, 0))
    return fd


def start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def pidns(pid: int | str = "self") -> int:
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


class Hostile:
    """hostile.py running as the tenant's workload (see its docstring for the modes)."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "hostile.py"), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("ready"), line

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()
