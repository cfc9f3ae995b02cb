"""A node's fragmentation as placement measures it, for anyone who shows or exports it.

Placement's fragmentation-aware policy (FGD: Weng et al., USENIX ATC'23) scores a node by the free
GPU capacity that a task drawn from the workload mix could not use there. Its engine computes that
on interned device states with memo tables (tessera.placement.engine); this is the same arithmetic
written plainly over one node's inventory and ledger, so the CLI's fleet view and `tessera top`
show the number placement optimises without importing a service. A test checks the two agree
(tests/placement/test_shared_fragmentation.py).

- A GPU's free capacity (GPU units) is the smaller of its free memory and free compute share; a
  card held exclusively, or unhealthy, has none.
- For one task kind, the usable capacity of a node is the free capacity of the GPUs one more share
  of the kind fits on, if there are as many as it asks for and the node's free CPU and host memory
  fit it; else nothing (a CPU-only kind that fits strands nothing). The node's fragmentation is
  the free capacity minus the mix-weighted usable capacity, plus host memory's gradual stranding
  (a kind needing beta MiB of host memory per GPU unit can use at most mem_free / beta of it).
- The mix: kinds weighed by how often they were seen times the square root of their GPU size, or
  `DEFAULT_MIX` before anything was seen.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from tessera.shared.events import ClaimSpec, NodeInventory, NodeLedger

# A task kind: (gpus, memory_mib, memory_percent, cores, cpu_millis, host_memory_mib).
Kind = tuple

# Before anything is observed: a mix typical of shared inference/training fleets (whole GPUs
# dominate, then halves and quarters, a few multi-GPU jobs). Weights are claim counts.
DEFAULT_MIX: tuple[tuple[Kind, float], ...] = (
    ((1, None, None, 100, 0, 0), 50.0),
    ((1, None, 50, 50, 0, 0), 15.0),
    ((1, None, 25, 25, 0, 0), 10.0),
    ((1, None, 75, 75, 0, 0), 5.0),
    ((1, None, 10, 10, 0, 0), 5.0),
    ((2, None, None, 100, 0, 0), 6.0),
    ((4, None, None, 100, 0, 0), 5.0),
    ((8, None, None, 100, 0, 0), 4.0),
)
MAX_KINDS = 160


def kind_of(spec: ClaimSpec) -> Kind:
    return (spec.gpus, spec.memory_mib, spec.memory_percent, spec.cores, spec.cpu_millis, spec.host_memory_mib)


# A CPU-only kind's weight beside a GPU kind's 1: what it signals is GPUs stranded by CPU or host
# memory, not GPUs asked for.
CPU_ONLY_WEIGHT = 0.1


def size_weight(kind: Kind) -> float:
    """A kind's weight per claim in the mix: 1 for every GPU kind (popularity alone, as the FGD
    paper weighs), CPU_ONLY_WEIGHT for a CPU-only one. Until session 9 a GPU kind also weighed
    sqrt(its GPU size) and a CPU-only one sqrt(0.5): over seeds 42-51 that left more unallocated on
    the multi-GPU and CPU-only families (3.27 against 3.14 at 600 multi-GPU pods, behind the paper's
    FGD; 22.67 against 20.22 at 4,000 CPU-only pods), less with a third of the pods typed (4.50
    against 5.28). The sweep is in bench/placement_sim.md, the families in placement_families.md."""
    return 1.0 if kind[0] else CPU_ONLY_WEIGHT


def mix_of(counts: Counter | dict, max_kinds: int = MAX_KINDS) -> list[tuple[Kind, float]]:
    """Normalised weights of the most frequent kinds (counts: kind -> claims seen)."""
    top = Counter(counts).most_common(max_kinds)
    weighted = [(k, n * size_weight(k)) for k, n in top]
    z = sum(w for _, w in weighted)
    return [(k, w / z) for k, w in weighted] if z else []


def mix_from_specs(specs: Iterable[ClaimSpec], minimum: int = 16) -> list[tuple[Kind, float]]:
    """The mix of the claims seen, or the default mix while fewer than ``minimum`` were seen
    (placement checks its learned mix first after 16 claims)."""
    counts = Counter(kind_of(s) for s in specs)
    if sum(counts.values()) < minimum:
        return mix_of(dict(DEFAULT_MIX))
    return mix_of(counts)


@dataclass(frozen=True)
class GpuState:
    """One GPU as placement sees it: capacity, health and what its ledger entries hold."""

    memory_mib: int
    max_shares: int = 10
    healthy: bool = True
    mem_used: int = 0
    cores_used: int = 0
    shares: int = 0
    exclusive: bool = False

    @property
    def free(self) -> float:
        if not self.healthy or self.exclusive:
            return 0.0
        return max(0.0, min((self.memory_mib - self.mem_used) / self.memory_mib, (100 - self.cores_used) / 100))


def _mem_req(kind: Kind, card_mib: int) -> int:
    _, memory_mib, memory_percent, _, _, _ = kind
    if memory_mib is not None:
        return memory_mib
    if memory_percent is not None:
        return card_mib * memory_percent // 100
    return card_mib


def fits(kind: Kind, gpu: GpuState) -> bool:
    """Whether one more share of ``kind`` fits on ``gpu`` (placement's rule; mix kinds name no type)."""
    cores = kind[3]
    return (gpu.healthy and not gpu.exclusive and gpu.shares < gpu.max_shares
            and (cores < 100 or gpu.shares == 0)
            and gpu.memory_mib - gpu.mem_used >= _mem_req(kind, gpu.memory_mib)
            and 100 - gpu.cores_used >= cores)


def node_fragmentation(gpus: list[GpuState], cpu_free: int, mem_free: int, mix: list[tuple[Kind, float]],
                       *, fluid_memory: bool = True) -> float:
    """Expected unusable free GPU capacity of one node, in GPU units (0 .. number of GPUs)."""
    free = sum(g.free for g in gpus)
    frag = 0.0
    for kind, p in mix:
        n_gpus, _, _, cores, cpu, hostmem = kind
        if n_gpus:
            fitting = [g for g in gpus if fits(kind, g)]
            usable = sum(g.free for g in fitting) if len(fitting) >= n_gpus else 0.0
        else:
            usable = free
        if cpu > cpu_free or hostmem > mem_free:
            frag += p * free
            continue
        frag += p * (free - usable)
        if fluid_memory and n_gpus and hostmem:
            share = 1.0 if cores >= 100 else (max(cores, kind[2] or 0) or 25) / 100
            beta = hostmem / (n_gpus * share)
            if usable * beta > mem_free:
                frag += p * (usable - mem_free / beta)
    return frag


def gpu_states(inventory: NodeInventory, ledger: NodeLedger | None) -> dict[str, GpuState]:
    """Each GPU of a node (by uuid) with what the node's ledger holds on it."""
    used: dict[str, list[int]] = {}
    exclusive: set[str] = set()
    for entry in (ledger.entries.values() if ledger else ()):
        for share in entry.shares:
            u = used.setdefault(share.uuid, [0, 0, 0])
            u[0] += share.memory_mib
            u[1] += share.cores
            u[2] += 1
            if share.cores >= 100:
                exclusive.add(share.uuid)
    out = {}
    for d in inventory.devices:
        mem, cores, shares = used.get(d.uuid, (0, 0, 0))
        out[d.uuid] = GpuState(memory_mib=d.memory_mib, max_shares=d.max_shares, healthy=d.healthy,
                               mem_used=mem, cores_used=cores, shares=shares, exclusive=d.uuid in exclusive)
    return out


def host_free(inventory: NodeInventory, ledger: NodeLedger | None) -> tuple[int, int]:
    """(CPU millis, host memory MiB) the node's ledger leaves free."""
    entries = list(ledger.entries.values()) if ledger else []
    return (inventory.cpu_millis - sum(e.cpu_millis for e in entries),
            inventory.host_memory_mib - sum(e.host_memory_mib for e in entries))
