"""Size classes: how a one-word choice becomes explicit requests and limits for every component.

Kamaji leaves its control-plane pods without requests or limits, so they fight over the host and get
OOM-killed. Here every container always gets both: from the spec when the tenant set them, otherwise
from its size class. Figures are per replica, sized from kube-apiserver's observed footprint for
small clusters (tens of nodes) and scaled by two per class.
"""

from __future__ import annotations

from typing import Mapping

from tessera.controlplane.spec import Amount, Resources, SizeClass, TenantControlPlaneSpec

COMPONENTS = ("api_server", "controller_manager", "scheduler", "datastore_shim")

# (request cpu m, request MiB, limit cpu m, limit MiB) for the "small" class.
_SMALL: Mapping[str, tuple[int, int, int, int]] = {
    "api_server": (250, 512, 1000, 1024),
    "controller_manager": (100, 128, 500, 256),
    "scheduler": (50, 64, 250, 128),
    "datastore_shim": (50, 64, 250, 128),
}
_FACTOR: Mapping[str, int] = {"small": 1, "medium": 2, "large": 4}


def class_resources(size: SizeClass, component: str) -> Resources:
    rc, rm, lc, lm = _SMALL[component]
    f = _FACTOR[size]
    return Resources(
        requests=Amount(cpu_millis=rc * f, memory_mib=rm * f),
        limits=Amount(cpu_millis=lc * f, memory_mib=lm * f),
    )


def effective_resources(spec: TenantControlPlaneSpec) -> dict[str, Resources]:
    """Resources per component: the spec's explicit values win, the size class fills the rest."""
    return {
        c: getattr(spec.resources, c) or class_resources(spec.size, c) for c in COMPONENTS
    }


def total_requests(spec: TenantControlPlaneSpec) -> Amount:
    """What the host must reserve for this tenant: all replicas, all components."""
    res = effective_resources(spec).values()
    n = spec.kubernetes.replicas
    return Amount(
        cpu_millis=n * sum(r.requests.cpu_millis for r in res),
        memory_mib=n * sum(r.requests.memory_mib for r in res),
    )
