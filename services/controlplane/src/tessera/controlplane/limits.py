"""CPU and memory limits for local control-plane processes: the rendered containers' limits, applied
with the kernel's cgroups, as a kubelet would.

Each process gets a cgroup of its own under ``<mount>/<controller>/<root>/<tenant>/<container>``:
``cpu.cfs_quota_us`` over a 100 ms period for the CPU limit and ``memory.limit_in_bytes`` for
memory (cgroup v1), or ``cpu.max`` and ``memory.max`` in one unified hierarchy (cgroup v2). Where
no hierarchy is writable (an unprivileged manager), ``Limits.find`` returns None and the manager
says so once in its log: the processes then run without limits.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("tessera.controlplane.limits")

PERIOD_US = 100_000


class Limits:
    def __init__(self, mount: Path, root: str, unified: bool) -> None:
        self.mount = mount
        self.root = root
        self.unified = unified

    @classmethod
    def find(cls, root: str = "tessera-tenants", mount: Path = Path("/sys/fs/cgroup")) -> "Limits | None":
        unified = (mount / "cgroup.controllers").exists()
        probes = [mount / root] if unified else [mount / "cpu" / root, mount / "memory" / root]
        try:
            for probe in probes:
                probe.mkdir(exist_ok=True)
        except OSError as exc:
            log.warning("no writable cgroup hierarchy under %s (%s): tenant control planes run without their "
                        "CPU and memory limits", mount, exc)
            return None
        return cls(mount, root, unified)

    def dirs(self, tenant: str, container: str | None = None) -> list[Path]:
        tail = [self.root, tenant] + ([container] if container else [])
        if self.unified:
            return [self.mount.joinpath(*tail)]
        return [self.mount.joinpath("cpu", *tail), self.mount.joinpath("memory", *tail)]

    def apply(self, tenant: str, container: str, pid: int, cpu_millis: int, memory_bytes: int) -> None:
        """Put ``pid`` in its container's cgroup with these limits (0: that one unlimited)."""
        dirs = self.dirs(tenant, container)
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        quota = cpu_millis * PERIOD_US // 1000 if cpu_millis else -1
        if self.unified:
            [d] = dirs
            (d / "cpu.max").write_text(f"{quota if quota > 0 else 'max'} {PERIOD_US}")
            (d / "memory.max").write_text(str(memory_bytes) if memory_bytes else "max")
            (d / "cgroup.procs").write_text(str(pid))
            return
        cpu, memory = dirs
        (cpu / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota))
        (memory / "memory.limit_in_bytes").write_text(str(memory_bytes) if memory_bytes else "-1")
        for d in dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def read(self, tenant: str, container: str) -> tuple[int, int]:
        """(CPU quota in millicores, memory limit in bytes) as the kernel holds them."""
        if self.unified:
            [d] = self.dirs(tenant, container)
            quota, period = (d / "cpu.max").read_text().split()
            memory = (d / "memory.max").read_text().strip()
            return (int(quota) * 1000 // int(period) if quota != "max" else 0, int(memory) if memory != "max" else 0)
        cpu, memory_dir = self.dirs(tenant, container)
        cfs_quota = int((cpu / "cpu.cfs_quota_us").read_text())
        cfs_period = int((cpu / "cpu.cfs_period_us").read_text())
        return (cfs_quota * 1000 // cfs_period if cfs_quota > 0 else 0,
                int((memory_dir / "memory.limit_in_bytes").read_text()))

    def remove(self, tenant: str) -> None:
        """Remove the tenant's cgroups (their processes are gone: a cgroup with members stays)."""
        for top in self.dirs(tenant):
            if not top.exists():
                continue
            for child in sorted(top.iterdir(), reverse=True):
                if child.is_dir():
                    try:
                        child.rmdir()
                    except OSError as exc:
                        log.warning("cgroup %s stays: %s", child, exc)
            try:
                top.rmdir()
            except OSError as exc:
                log.warning("cgroup %s stays: %s", top, exc)

    def paths(self, tenant: str) -> list[Path]:
        return [d for d in self.dirs(tenant) if d.exists()]

