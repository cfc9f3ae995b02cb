"""Which claims, on one node, a claim that fits nowhere may take the place of: the victim choice.

Pure and synchronous, like the engine: the node's GPUs and its ledger entries in, the victims (or
why there are none) out. The service releases the victims the way any release travels and places
the claim only once their ledger entries are gone, so the choice itself never over-commits.

Who may be a victim: a ledger entry marked preemptible whose priority is strictly lower than the
claim's; never one of equal or higher priority, never a non-preemptible one, never one already
preempted for another claim (``spared``: its room is that claim's). Besides, whatever their
priority, the ``reclaimable`` ones: other tenants' borrowing claims that a claim within its own
tenant's guarantee may reclaim, in sets its ``admissible`` allows (`tessera.placement.fairshare`).

Among the victim sets that make the claim fit, the one chosen is, in this order:

1. the fewest victims;
2. the lowest priorities (the highest priority in the set compared first, then the next);
3. the least memory left stranded: what the victims free beyond what the claim takes;
4. the youngest victims (their ledger entries' ``ts``, the youngest compared first): the least
   work lost;
5. then the claim ids, so that two replicas deciding alike choose alike.

The search is per GPU, then over the GPUs the claim needs: on each GPU the fewest-victim sets
that make it fit (from its `MAX_PER_GPU` lowest-priority candidates), the best few kept; then each
choice of GPUs with their sets, checked whole (at most `MAX_VICTIMS` victims). Exact in the order
above for victims that hold one GPU each; a victim across several GPUs is counted once where it
frees more than one, but sets built around such victims are not searched exhaustively.
Host CPU and memory are not freed here; a claim short of those is not helped by preemption.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations, product

from tessera.shared.events import GpuDevice, LedgerEntry

MAX_VICTIMS = 8
MAX_PER_GPU = 12
_KEEP = 4
EXCLUSIVE = 100


@dataclass(frozen=True)
class Need:
    """What the claim asks of each of ``gpus`` GPUs (``memory_mib`` None: the whole card)."""

    gpus: int = 1
    memory_mib: int | None = None
    cores: int = 0


@dataclass(frozen=True)
class Victims:
    """The claims to preempt, in a stable order (empty: the claim fits without preempting)."""

    claims: list[str] = field(default_factory=list)
    freed_mib: int = 0
    order: tuple = ()  # its place in the stated order, to compare the choices of several nodes


@dataclass(frozen=True)
class NoVictims:
    reason: str


Admissible = Callable[[Sequence[LedgerEntry]], bool]


def choose_victims(need: Need, devices: Sequence[GpuDevice], entries: Mapping[str, LedgerEntry],
                   priority: int, eligible: Collection[int] | None = None,
                   spared: Collection[str] = (), reclaimable: Collection[str] = (),
                   admissible: Admissible | None = None) -> Victims | NoVictims:
    """The victims on this node that let a claim of ``priority`` needing ``need`` fit on the GPUs
    in ``eligible`` (indexes; None: every healthy GPU), chosen in the module's stated order; none
    of ``spared`` (claims that count where they are but may not be chosen); also any of
    ``reclaimable``, whatever its priority, in a set ``admissible`` allows (None: any set)."""
    usable = {d.index: d for d in devices if d.healthy and (eligible is None or d.index in eligible)}
    touching = [e for e in entries.values() if any(s.index in usable for s in e.shares)]
    allowed = [e for e in touching if e.claim not in spared
               and (e.preemptible and e.priority < priority or e.claim in reclaimable)]
    ok = admissible or (lambda group: True)
    if _fits(need, usable, entries, set()):
        return Victims(order=_order(need, ()))
    per_gpu = {i: _gpu_choices(need, device, entries, allowed, ok) for i, device in usable.items()}
    best: tuple | None = None
    for gpus in combinations(sorted(i for i, sets in per_gpu.items() if sets), need.gpus):
        # Each GPU's best few sets where two GPUs are wanted, its best one beyond (a bounded search).
        depth = _KEEP if need.gpus <= 2 else 1
        for pick in product(*(per_gpu[i][:depth] for i in gpus)):
            group = tuple({e.claim: e for g in pick for e in g}.values())
            if len(group) > MAX_VICTIMS or not ok(group) or not _fits(need, usable, entries, {e.claim for e in group}):
                continue
            key = _order(need, group)
            if best is None or key < best[0]:
                best = (key, group)
    if best is None:
        return NoVictims(reason=_why_not(need, priority, touching, allowed, bool(reclaimable)))
    key, group = best
    return Victims(claims=[e.claim for e in sorted(group, key=lambda e: e.claim)], freed_mib=_memory(group),
                   order=key)


def _gpu_choices(need: Need, device: GpuDevice, entries: Mapping[str, LedgerEntry],
                 allowed: Sequence[LedgerEntry], ok: Admissible) -> list[tuple[LedgerEntry, ...]]:
    """The fewest-victim sets that make this one GPU fit, best first (at most `_KEEP`); ``[()]``
    where it fits as it is, ``[]`` where no set of at most `MAX_VICTIMS` does."""
    on = {device.index: device}
    entries = {c: e for c, e in entries.items() if any(s.index == device.index for s in e.shares)}
    if _fits(Need(1, need.memory_mib, need.cores), on, entries, set()):
        return [()]
    here = sorted((e for e in allowed if any(s.index == device.index for s in e.shares)),
                  key=lambda e: (e.priority, -e.ts, e.claim))[:MAX_PER_GPU]
    for size in range(1, min(MAX_VICTIMS, len(here)) + 1):
        found = [group for group in combinations(here, size)
                 if ok(group) and _fits(Need(1, need.memory_mib, need.cores), on, entries, {e.claim for e in group})]
        if found:
            return sorted(found, key=lambda g: _order(need, g))[:_KEEP]
    return []


def _fits(need: Need, usable: Mapping[int, GpuDevice], entries: Mapping[str, LedgerEntry],
          gone: set[str]) -> bool:
    memory = {i: 0 for i in usable}
    cores = {i: 0 for i in usable}
    shares = {i: 0 for i in usable}
    exclusive: set[int] = set()
    for entry in entries.values():
        if entry.claim in gone:
            continue
        for s in entry.shares:
            if s.index not in usable:
                continue
            memory[s.index] += s.memory_mib
            cores[s.index] += s.cores
            shares[s.index] += 1
            if s.cores >= EXCLUSIVE:
                exclusive.add(s.index)
    fitting = 0
    for i, device in usable.items():
        want = device.memory_mib if need.memory_mib is None else need.memory_mib
        if i in exclusive or shares[i] >= device.max_shares:
            continue
        if need.cores >= EXCLUSIVE and shares[i]:
            continue
        if device.memory_mib - memory[i] < want or EXCLUSIVE - cores[i] < need.cores:
            continue
        fitting += 1
    return fitting >= need.gpus


def _memory(group: Sequence[LedgerEntry]) -> int:
    return sum(s.memory_mib for e in group for s in e.shares)


def _order(need: Need, group: Sequence[LedgerEntry]) -> tuple:
    taken = (need.memory_mib or 0) * need.gpus
    stranded = max(0, _memory(group) - taken) if group else 0
    return (len(group),
            tuple(sorted((e.priority for e in group), reverse=True)),
            stranded,
            tuple(sorted(-e.ts for e in group)),
            tuple(sorted(e.claim for e in group)))


def _describe(entry: LedgerEntry, priority: int) -> str:
    if not entry.preemptible:
        return f"{entry.claim} (non-preemptible)"
    if entry.priority < priority:
        return f"{entry.claim} (already preempted for another claim)"
    return f"{entry.claim} (priority {entry.priority}{', borrowing' if entry.borrowing else ''})"


def _why_not(need: Need, priority: int, touching: Sequence[LedgerEntry], allowed: Sequence[LedgerEntry],
             reclaiming: bool = False) -> str:
    memory = "whole GPUs" if need.memory_mib is None else f"{need.memory_mib} MiB"
    wanted = f"{need.gpus} x {memory}" + (f", {need.cores}% cores" if need.cores else "")
    kept = [e for e in touching if e not in allowed]
    whom = f"claims of priority below {priority}" + (
        " and other tenants' borrowing beyond their guarantee" if reclaiming else "")
    parts = [f"preempting {whom} frees no room for {wanted} here"]
    if allowed:
        parts.append(f"(at most {MAX_VICTIMS} victims, {MAX_PER_GPU} lowest-priority candidates per GPU, tried)")
    if kept:
        parts.append("; it would also need " + ", ".join(_describe(e, priority) for e in sorted(kept, key=lambda e: e.claim)))
    return " ".join(parts)
