"""The demo scenario `make up` and `tessera demo` run: two tenants and a mixed GPU workload.

The workload mixes what HAMi users ask for: small slices by MiB with a core share, slices by percent
of the card, whole exclusive GPUs, multi-GPU claims, a GPU-type selector, and one request that the
tenant's quota refuses, so the table shows packing, isolation and a clear "unschedulable" reason.
"""

from __future__ import annotations

from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota
from tessera.shared.hami_names import GPU, GPU_POLICY, GPUCORES, GPUMEM, GPUMEM_PERCENTAGE, USE_GPUTYPE

from tessera.cli.client import Client
from tessera.cli.errors import CliError

TENANTS = {
    "vision": GpuQuota(gpus=24, memory_mib=900_000, cores=1500),
    "nlp": GpuQuota(gpus=16, memory_mib=600_000, cores=1200),
}

# (tenant, resources, annotations, how many)
WORKLOAD: list[tuple[str, dict, dict, int]] = [
    ("vision", {GPU: 1, GPUMEM: 10000, GPUCORES: 25}, {}, 8),
    ("vision", {GPU: 1, GPUMEM_PERCENTAGE: 50, GPUCORES: 50}, {}, 4),
    ("vision", {GPU: 2, GPUCORES: 100}, {USE_GPUTYPE: "H100"}, 2),
    ("nlp", {GPU: 1, GPUMEM: 20000, GPUCORES: 30}, {}, 6),
    ("nlp", {GPU: 1, GPUMEM: 16000}, {USE_GPUTYPE: "A100"}, 4),
    ("nlp", {GPU: 4, GPUMEM: 40000, GPUCORES: 50},
     {GPU_POLICY: "spread"}, 1),
    # More than nlp's quota allows: stays unschedulable with the reason.
    ("nlp", {GPU: 8, GPUCORES: 100}, {}, 1),
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
