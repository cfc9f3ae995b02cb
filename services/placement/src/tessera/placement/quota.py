"""Tenant GPU quota: would this claim take the tenant past what the control-plane manager granted?

The quota itself is published by the control-plane manager in the ``tenants`` bucket; what the
tenant holds is the ``tenant.<name>`` record of the ledger, reserved by compare-and-set before a node
is committed, so two placement replicas cannot both squeeze a tenant past its limit.
"""

from __future__ import annotations

from typing import TypeGuard

from tessera.shared.events import GpuQuota


def over_quota(quota: GpuQuota, held: GpuQuota, amount: GpuQuota) -> str | None:
    """A human reason when ``held + amount`` exceeds ``quota`` in any dimension, else None."""
    problems = []
    for name, unit in (("gpus", "GPUs"), ("memory_mib", "MiB"), ("cores", "% cores")):
        limit = getattr(quota, name)
        if limit is None:
            continue
        want = (getattr(held, name) or 0) + (getattr(amount, name) or 0)
        if want > limit:
            problems.append(f"{name} {want} > {limit} {unit}")
    if not problems:
        return None
    return "tenant quota exceeded: " + ", ".join(problems)


def has_limits(quota: GpuQuota | None) -> TypeGuard[GpuQuota]:
    return quota is not None and any(
        v is not None for v in (quota.gpus, quota.memory_mib, quota.cores)
    )
