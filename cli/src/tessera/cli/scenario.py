"""The demo scenario `make up` and `tessera demo` run: two tenants and a mixed GPU workload.

The workload mixes what HAMi users ask for: small slices by MiB with a core share, slices by percent
of the card, whole exclusive GPUs, multi-GPU claims, a GPU-type selector, and one request that the
tenant's quota refuses, so the table shows packing, isolation and a clear "unschedulable" reason.
"""

from __future__ import annotations

from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota

from tessera.cli.client import Client, CliError

TENANTS = {
    "vision": GpuQuota(gpus=24, memory_mib=900_000, cores=1500),
    "nlp": GpuQuota(gpus=16, memory_mib=600_000, cores=1200),
}

# (tenant, resources, annotations, how many)
WORKLOAD: list[tuple[str, dict, dict, int]] = [
    ("vision", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 10000, "nvidia.com/gpucores": 25}, {}, 8),
    ("vision", {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 50, "nvidia.com/gpucores": 50}, {}, 4),
    ("vision", {"nvidia.com/gpu": 2, "nvidia.com/gpucores": 100}, {"nvidia.com/use-gputype": "H100"}, 2),
    ("nlp", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 20000, "nvidia.com/gpucores": 30}, {}, 6),
    ("nlp", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 16000}, {"nvidia.com/use-gputype": "A100"}, 4),
    ("nlp", {"nvidia.com/gpu": 4, "nvidia.com/gpumem": 40000, "nvidia.com/gpucores": 50},
     {"hami.io/gpu-scheduler-policy": "spread"}, 1),
    # More than nlp's quota allows: stays unschedulable with the reason.
    ("nlp", {"nvidia.com/gpu": 8, "nvidia.com/gpucores": 100}, {}, 1),
]


async def create_tenants(client: Client) -> None:
    for name, quota in TENANTS.items():
        await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name=name, quota=quota), timeout=30)


async def submit_workload(client: Client) -> list[str]:
    claims: list[str] = []
    for tenant, resources, notes, count in WORKLOAD:
        for _ in range(count):
            try:
                result = await client.submit(
                    api.SubmitRequest(tenant=tenant, resources=resources, annotations=notes)
                )
            except CliError as exc:
                raise CliError(f"demo submit failed for {tenant} {resources}: {exc}") from None
            claims.append(result["claim"])
    return claims
