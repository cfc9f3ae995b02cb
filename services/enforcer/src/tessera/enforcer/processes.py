"""Who is alive behind a claim, and stopping what must not outlive it.

Two facts decide whether a claim is still in use, both read from kernel locks that die with their
holder (so a SIGKILL can never leave a claim looking alive, and a reused pid can never make a dead one
look alive): the `tessera run` owner's shared flock on ``owner.lock``, and libvgpu's per-process slot
locks in the accounting file (see accounting.py). Before signalling a process listed in a slot, its
identity is checked against /proc (same start time, same pid namespace as ours), so a pid the kernel
has since handed to someone else is never killed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
from pathlib import Path

from tessera.enforcer.accounting import ProcessUsage

log = logging.getLogger("tessera.enforcer.processes")


def owner_alive(lock_path: Path) -> bool:
    """True while some process holds a lock on the claim's owner file.

    Probing takes an exclusive lock without waiting and drops it at once; the owner takes its shared
    lock blocking, so a probe can delay it by microseconds but never fail it.
    """
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _own_pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(rest[19])  # field 22 overall; fields after ")" start at 3
    except (IndexError, ValueError):
        return None


def same_process(slot: ProcessUsage) -> bool:
    """Is ``slot.pid`` in our pid namespace still the process that registered the slot?"""
    if slot.pid <= 0:
        return False
    own = _own_pidns()
    if slot.pidns and own and slot.pidns != own:
        return False  # registered in another pid namespace: its pid means nothing here
    started = _start_time(slot.pid)
    return started is not None and (not slot.start_time or started == slot.start_time)


def kill(slots, sig: int = signal.SIGKILL) -> list[int]:
    """Signal the processes of ``slots`` that are verifiably who registered; returns the pids signalled."""
    done = []
    for slot in slots:
        if not same_process(slot):
            log.warning("not signalling pid %d: it is not (or no longer) the process of slot %d", slot.pid, slot.slot)
            continue
        try:
            os.kill(slot.pid, sig)
            done.append(slot.pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.error("not allowed to signal pid %d of a leaked claim; run the enforcer as root", slot.pid)
    return done
