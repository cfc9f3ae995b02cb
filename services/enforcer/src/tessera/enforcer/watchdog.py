"""The watchdog: a claim's processes that have the GPU open without libvgpu in force are killed.

libvgpu cannot limit what never loads it: a static binary, a library loaded with ``dlmopen`` into a
fresh link-map namespace (with a libcuda of its own that libvgpu's interposition never reaches), a
loader that ignores ``/etc/ld.so.preload``. The node sees them all. One sweep, for every claim
directory on the node:

1. the claim's processes: in a container, every process whose mount namespace has the claim's
   directory mounted (the CDI spec mounts the claim's limits from it) and every process of such a
   process's cgroup; under `tessera run`, the process holding the claim's owner lock and all its
   descendants;
2. of those, the ones with the GPU open: a ``/dev/nvidia*`` descriptor, or the CUDA driver library
   (``libcuda.so*``) mapped, which is how a simulated fleet's processes reach their GPU;
3. and libvgpu not in force: not mapped at all, or mapped fewer times than libcuda (a second libcuda
   in another link-map namespace is out of libvgpu's reach), or libcuda mapped in a process with more
   link-map namespaces (libc loads) than libvgpu loads that does not hold the claim's accounting file
   (libvgpu in force opens it at its first call): that one only when seen on two sweeps running, so
   a process between loading libcuda and its first CUDA call is never mistaken for one.

Each is killed through a pidfd, opened before its start time is checked again, so a pid reused since
the look is never signalled; nothing outside a claim's processes is signalled. The caller reports
each kill (a log line naming the pid and the reason, a metric, a ``violation`` claim event). An
escapee is killed within one sweep period (``TESSERA_WATCHDOG_SECONDS``) of opening the GPU, plus the
time a sweep takes.

Not seen: a library loaded with ``RTLD_DEEPBIND`` that binds to libcuda past libvgpu inside the same
namespace, and, under `tessera run`, a process that left the owner's tree (double fork, reparented).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tessera.enforcer.claimdir import ClaimDir
from tessera.enforcer.processes import holds_file

log = logging.getLogger("tessera.enforcer.watchdog")

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")

NO_LIBVGPU = "no-libvgpu"
SECOND_NAMESPACE = "second-namespace"


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    start_time: int  # /proc/<pid>/stat field 22: with the pid, names one process for good


@dataclass(frozen=True)
class Escapee:
    claim: str
    pid: int
    start_time: int
    kind: str    # NO_LIBVGPU or SECOND_NAMESPACE (the metric's label)
    reason: str  # what was seen, for the log and the event


def _stat(pid: int) -> Proc | None:
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    rest = text[text.rfind(")") + 2:].split()
    try:
        return Proc(pid, int(rest[1]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def processes() -> dict[int, Proc]:
    """Every process of the node (of our pid namespace) now."""
    found = {}
    for entry in os.scandir(PROC):
        if entry.name.isdigit():
            p = _stat(int(entry.name))
            if p is not None:
                found[p.pid] = p
    return found


def lock_holders(path: Path) -> set[int]:
    """The pids holding a lock on ``path`` (from /proc/locks; pids of our namespace)."""
    try:
        st = os.stat(path)
    except OSError:
        return set()
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    holders: set[int] = set()
    try:
        lines = (PROC / "locks").read_text().splitlines()
    except OSError:
        return holders
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":  # "->": waiting for the lock, not holding it
            continue
        try:
            major, minor, ino = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) == want and int(fields[4]) > 0:
                holders.add(int(fields[4]))
        except ValueError:
            continue
    return holders


def descendants(roots: Iterable[int], procs: dict[int, Proc]) -> set[int]:
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found, todo = set(), [r for r in roots if r in procs]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def _mountinfo(pid: int | str) -> list[list[str]]:
    try:
        return [line.split() for line in (PROC / str(pid) / "mountinfo").read_text().splitlines()]
    except OSError:
        return []


def mount_source(path: Path) -> tuple[str, str] | None:
    """(device "major:minor", path within that filesystem) of ``path``: how a bind mount of it shows
    in another mount namespace's mountinfo, whatever that namespace calls it."""
    real = os.path.realpath(path)
    best = None
    for f in _mountinfo("self"):
        if len(f) < 5:
            continue
        point = f[4]
        if (real == point or real.startswith(point.rstrip("/") + "/")) and (best is None or len(point) > len(best[4])):
            best = f
    if best is None:
        return None
    rel = real[len(best[4].rstrip("/")):]
    return best[2], os.path.normpath(best[3].rstrip("/") + rel)


def _ns(pid: int, kind: str) -> int | None:
    try:
        return os.stat(PROC / str(pid) / "ns" / kind).st_ino
    except OSError:
        return None


def _cgroup_procs(pid: int) -> set[int]:
    """The processes of ``pid``'s cgroup (v2, else v1's pids hierarchy); empty for the root cgroup."""
    try:
        lines = (PROC / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if path in ("/", ""):
            continue
        if hier == "0" and controllers == "":
            file = CGROUP_ROOT / path.lstrip("/") / "cgroup.procs"
        elif "pids" in controllers.split(","):
            file = CGROUP_ROOT / "pids" / path.lstrip("/") / "cgroup.procs"
        else:
            continue
        try:
            return {int(x) for x in file.read_text().split()}
        except (OSError, ValueError):
            return set()
    return set()


def container_members(directory: Path, procs: dict[int, Proc]) -> set[int]:
    """Processes in a mount namespace where ``directory`` (or a file in it) is mounted, and the
    processes of their cgroups. Our own mount namespace (the host's) is never one of them."""
    source = mount_source(directory)
    if source is None:
        return set()
    dev, root = source
    own = _ns(os.getpid(), "mnt")
    by_ns: dict[int, list[int]] = {}
    for pid in procs:
        ns = _ns(pid, "mnt")
        if ns is not None and ns != own:
            by_ns.setdefault(ns, []).append(pid)
    members: set[int] = set()
    for pids in by_ns.values():
        info = _mountinfo(pids[0])
        if any(len(f) > 3 and f[2] == dev and (f[3] == root or f[3].startswith(root + "/")) for f in info):
            members.update(pids)
    own_cgroup = _cgroup_procs(os.getpid())
    for pid in list(members):
        group = _cgroup_procs(pid)
        if group and not (group & own_cgroup) and os.getpid() not in group:
            members |= group & set(procs)
    return members


def claim_members(cd: ClaimDir, procs: dict[int, Proc]) -> set[int]:
    """Every process of the claim: its containers' and its `tessera run` owner's tree."""
    owners = lock_holders(cd.owner_lock)
    return descendants(owners, procs) | container_members(cd.path, procs)


def _maps(pid: int) -> list[tuple[str, str, str]]:
    """(start address, offset, path) of each file mapping of ``pid``."""
    out = []
    try:
        with open(PROC / str(pid) / "maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    out.append((fields[0].split("-")[0], fields[2], fields[5].rstrip("\n")))
    except OSError:
        pass
    return out


def _loads(maps: list[tuple[str, str, str]], prefix: str) -> set[str]:
    """Load addresses of the libraries named ``prefix*`` (each load maps its first segment at offset 0)."""
    return {start for start, offset, path in maps
            if int(offset, 16) == 0 and os.path.basename(path.removesuffix(" (deleted)")).startswith(prefix)}


def _gpu_device_open(pid: int) -> bool:
    try:
        fds = os.listdir(PROC / str(pid) / "fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(PROC / str(pid) / "fd" / fd).startswith("/dev/nvidia"):
                return True
        except OSError:
            continue
    return False


@dataclass(frozen=True)
class Seen:
    kind: str
    reason: str
    certain: bool  # False: killed only when seen again on the next sweep


def escape(pid: int, cache: Path) -> Seen | None:
    """What makes ``pid`` an escapee (the GPU open, libvgpu not in force), or None."""
    maps = _maps(pid)
    cuda = _loads(maps, "libcuda.so")
    if not cuda and not _gpu_device_open(pid):
        return None
    vgpu = _loads(maps, "libvgpu.so")
    if not vgpu:
        how = f"the CUDA driver library is mapped ({len(cuda)}x)" if cuda else "a /dev/nvidia* device is open"
        return Seen(NO_LIBVGPU, f"{how} and libvgpu is not loaded", True)
    if len(cuda) > len(vgpu):
        return Seen(SECOND_NAMESPACE, f"the CUDA driver library is loaded {len(cuda)} times and libvgpu "
                    f"{len(vgpu)}: a copy in another link-map namespace (dlmopen) is out of libvgpu's reach", True)
    namespaces = len(_loads(maps, "libc.so"))
    if cuda and namespaces > len(vgpu) and not _holds(pid, cache):
        return Seen(SECOND_NAMESPACE, f"{namespaces} link-map namespaces, libvgpu in {len(vgpu)}, and libvgpu "
                    "never opened the claim's accounting file: the CUDA driver is used from a namespace "
                    "libvgpu is not in (dlmopen)", False)
    return None


def _holds(pid: int, cache: Path) -> bool:
    try:
        return holds_file(pid, str(cache))
    except OSError:
        return False


def kill(e: Escapee) -> bool:
    """SIGKILL the escapee if it is still the process that was seen; True if signalled."""
    try:
        pidfd = os.pidfd_open(e.pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        now = _stat(e.pid)
        if now is None or now.start_time != e.start_time:
            return False  # gone, and the pid is someone else's now
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # not the sweep's end: the other claims' escapees are still killed
        log.error("claim %s: not allowed to kill pid %d (%s): signalling another uid's process takes CAP_KILL "
                  "(deploy/k8s/enforcer.yaml adds it)", e.claim, e.pid, e.reason)
        return False
    finally:
        os.close(pidfd)


class Watchdog:
    """Sweeps the node's claim directories; remembers the uncertain sightings of one sweep for the next."""

    def __init__(self) -> None:
        self.suspects: set[tuple[int, int]] = set()  # (pid, start time) seen uncertain last sweep

    def sweep(self, dirs: Iterable[ClaimDir]) -> list[Escapee]:
        """Find and kill the escapees of every claim directory; returns those killed."""
        dirs = list(dirs)
        suspects: set[tuple[int, int]] = set()
        killed = []
        if dirs:
            procs = processes()
            me = os.getpid()
            for cd in dirs:
                for pid in sorted(claim_members(cd, procs) - {me}):
                    seen = escape(pid, cd.cache)
                    if seen is None:
                        continue
                    who = (pid, procs[pid].start_time)
                    if not seen.certain and who not in self.suspects:
                        suspects.add(who)
                        continue
                    e = Escapee(cd.claim, pid, who[1], seen.kind, seen.reason)
                    if kill(e):
                        killed.append(e)
        self.suspects = suspects
        return killed
