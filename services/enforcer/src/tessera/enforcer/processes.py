"""Who is alive behind a claim, and stopping what must not outlive it.

Two facts decide whether a claim is still in use, both read from kernel locks that die with their
holder (so a SIGKILL can never leave a claim looking alive, and a reused pid can never make a dead one
look alive): the `tessera run` owner's shared flock on ``owner.lock``, and libvgpu's per-process slot
locks in the accounting file (see accounting.py). A slot is written by the workload, so before a
process it names is signalled, every fact is checked against the kernel through a pidfd: start time,
pid namespace (ours: a container's pids mean nothing here, its runtime stops those), and that the
process holds the claim's accounting file open. That last check is what binds a process to the
claim; a cgroup would not in host mode, where `tessera run` shares the user's session cgroup.
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


class Unverified(Exception):
    """Why a process named in a slot is not provably the claim's: it is not signalled."""


def holds_file(pid: int, cache: str) -> bool:
    """Does ``pid`` have ``cache`` open? libvgpu keeps its accounting file open for its whole life."""
    want = os.stat(cache)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            return True
    return False


def verified_pidfd(slot: ProcessUsage) -> int:
    """A pidfd of the process the slot names, once every fact the slot claims is checked against the
    kernel; raises Unverified otherwise. The slot is written by the workload, so nothing in it is
    believed: zero fields are refusals, not wildcards. Opening the pidfd first and checking after
    means the pid cannot be handed to another process between the check and the signal."""
    if slot.pid <= 0:
        raise Unverified(f"slot {slot.slot} names pid {slot.pid}")
    if not slot.start_time:
        raise Unverified(f"slot {slot.slot} records start time 0")
    if not slot.pidns:
        raise Unverified(f"slot {slot.slot} records pid namespace 0")
    own = _own_pidns()
    if slot.pidns != own:
        raise Unverified(f"slot {slot.slot} was registered in pid namespace {slot.pidns}, not ours ({own}): "
                         "its pid means nothing here")
    if not slot.cache:
        raise Unverified(f"slot {slot.slot} comes from no known accounting file")
    try:
        pidfd = os.pidfd_open(slot.pid)
    except ProcessLookupError as e:
        raise Unverified(f"no process {slot.pid} any more") from e
    try:
        if _start_time(slot.pid) != slot.start_time:
            raise Unverified(f"process {slot.pid} started at another time than slot {slot.slot} records (pid reused or forged)")
        try:
            ns = os.stat(f"/proc/{slot.pid}/ns/pid").st_ino
        except OSError as e:
            raise Unverified(f"cannot read the pid namespace of process {slot.pid}: {e.strerror}") from e
        if ns != slot.pidns:
            raise Unverified(f"process {slot.pid} is in pid namespace {ns}, slot {slot.slot} records {slot.pidns}")
        if not holds_file(slot.pid, slot.cache):
            raise Unverified(f"process {slot.pid} does not hold the claim's accounting file {slot.cache} open, "
                             "as every libvgpu process of the claim does")
    except BaseException:
        os.close(pidfd)
        raise
    return pidfd


def kill(slots, sig: int = signal.SIGKILL) -> list[int]:
    """Signal the processes of ``slots`` that are verifiably the claim's; returns the pids signalled."""
    done = []
    for slot in slots:
        try:
            pidfd = verified_pidfd(slot)
        except Unverified as why:
            log.warning("not signalling pid %d of slot %d: %s", slot.pid, slot.slot, why)
            continue
        except OSError as exc:
            log.warning("not signalling pid %d of slot %d: cannot verify it: %s", slot.pid, slot.slot, exc)
            continue
        try:
            signal.pidfd_send_signal(pidfd, sig)
            done.append(slot.pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.error("not allowed to signal pid %d of a leaked claim: signalling another uid's process takes "
                      "root with CAP_KILL (deploy/k8s/enforcer.yaml adds it)", slot.pid)
        finally:
            os.close(pidfd)
    return done
