"""Host-capacity admission: a tenant whose control plane the host cluster cannot fit is refused.

Accepting it anyway is how Kamaji hosts end up overcommitted. The check sums the requests of every
tenant already admitted (from the controlplanes bucket, never from memory) and refuses a new or
grown tenant with a reason that says how much is missing. Capacity comes from the settings (a
fixed host budget) or, in Kubernetes mode, from the nodes' allocatable resources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tessera.controlplane.sizes import total_requests
from tessera.controlplane.spec import TenantControlPlane, TenantControlPlaneSpec


@dataclass(frozen=True)
class HostCapacity:
    cpu_millis: int  # 0: unbounded
    memory_mib: int  # 0: unbounded


class InsufficientCapacity(Exception):
    pass


def check_fits(
    capacity: HostCapacity,
    admitted: Iterable[TenantControlPlane],
    name: str,
    spec: TenantControlPlaneSpec,
) -> None:
    """Raise InsufficientCapacity (with the shortfall) if ``spec`` does not fit beside the others."""
    used_cpu = used_mem = 0
    for record in admitted:
        if record.name == name:
            continue  # a resize replaces the tenant's own reservation
        req = total_requests(record.spec)
        used_cpu += req.cpu_millis
        used_mem += req.memory_mib
    want = total_requests(spec)
    problems = []
    if capacity.cpu_millis and used_cpu + want.cpu_millis > capacity.cpu_millis:
        problems.append(
            f"cpu: needs {want.cpu_millis}m, {max(capacity.cpu_millis - used_cpu, 0)}m free of"
            f" {capacity.cpu_millis}m"
        )
    if capacity.memory_mib and used_mem + want.memory_mib > capacity.memory_mib:
        problems.append(
            f"memory: needs {want.memory_mib}Mi, {max(capacity.memory_mib - used_mem, 0)}Mi free of"
            f" {capacity.memory_mib}Mi"
        )
    if problems:
        raise InsufficientCapacity(
            f"host cluster cannot fit tenant {name!r} ({spec.kubernetes.replicas} replicas,"
            f" size {spec.size}): " + "; ".join(problems)
        )
