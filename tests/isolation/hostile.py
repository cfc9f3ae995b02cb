"""A hostile workload for the isolation tests: what a tenant's process can do to its own claim's
accounting file, which it must be able to write (libvgpu in every process of the workload does).

  hostile.py hold-lock <cache>   take the file's update lock (byte 0, the lock libvgpu's writers and
                                 the enforcer's reader use), print "ready", keep it until stdin closes
"""

from __future__ import annotations

import fcntl
import os
import struct
import sys

_FLOCK = struct.Struct("@hhqqi0q")
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)


def hold_lock(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    fcntl.fcntl(fd, _F_OFD_SETLKW, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
    print("ready", os.getpid(), flush=True)
    sys.stdin.read()  # until the test closes our stdin (or dies)
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "hold-lock":
        return hold_lock(sys.argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
