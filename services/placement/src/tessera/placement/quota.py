"""Tenant GPU quota: would this claim take the tenant past what the control-plane manager granted?

The quota itself is published by the control-plane manager in the ``tenants`` bucket; what the
tenant holds is the ``tenant.<name>`` record of the ledger, reserved by compare-and-set before a node
is committed, so two placement replicas cannot both squeeze a tenant past its limit.

The quota is what the tenant is guaranteed (issue 26). A tenant with a borrowing limit may go
beyond it, into idle capacity, by at most that limit: such a claim is admitted as *borrowing*
(`admit`), marked so in its ledger entry, and another tenant reclaiming its guarantee may preempt
it (`tessera.placement.fairshare`). Without a borrowing limit the quota is a hard wall, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

from tessera.shared.events import GpuQuota
from tessera.shared.ledger import ceiling


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


@dataclass(frozen=True)
class Admitted:
    """The claim may be placed; ``borrowing``: beyond its tenant's guarantee (preemptible by reclaim)."""

    borrowing: bool = False


def admit(quota: GpuQuota, limit: GpuQuota | None, held: GpuQuota, amount: GpuQuota,
          preemptible: bool = True) -> Admitted | str:
    """Whether ``amount`` may be added to ``held`` under the guarantee ``quota`` and the borrowing
    ``limit`` beyond it (None: none): admitted (borrowing or not), or a human reason why not."""
    over = over_quota(quota, held, amount)
    if over is None:
        return Admitted()
    if limit is None:
        return over
    if not preemptible:
        return (f"{over}; a non-preemptible claim may not borrow beyond its tenant's guarantee (it could "
                "not be given back): ask within the quota, or mark the claim preemptible")
    beyond = over_quota(ceiling(quota, limit), held, amount)
    if beyond is not None:
        return beyond.replace("tenant quota exceeded", "tenant quota and borrowing limit exceeded", 1)
    return Admitted(borrowing=True)


