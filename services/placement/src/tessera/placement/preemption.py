"""Which claims, on one node, a claim that fits nowhere may take the place of: the victim choice.

Pure and synchronous, like the engine: the node's GPUs and its ledger entries in, the victims (or
why there are none) out. The service releases the victims the way any release travels and places
the claim only once their ledger entries are gone, so the choice itself never over-commits.

Who may be a victim: a ledger entry marked preemptible whose priority is strictly lower than the
claim's; never one of equal or higher priority, never a non-preemptible one.

Among the victim sets that make the claim fit, the one chosen is, in this order:

1. the fewest victims;
2. the lowest priorities (the highest priority in the set compared first, then the next);
3. the least memory left stranded: what the victims free beyond what the claim takes;
4. the youngest victims (their ledger entries' ``ts``, the youngest compared first): the least
   work lost;
5. then the claim ids, so that two replicas deciding alike choose alike.

Sets are tried smallest first, at most `MAX_VICTIMS` claims, from the `MAX_CANDIDATES` lowest
-priority candidates on the GPUs the claim may use: a bounded search, not an exhaustive one.
Host CPU and memory are not freed here; a claim short of those is not helped by preemption.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

from tessera.shared.events import GpuDevice, LedgerEntry

MAX_VICTIMS = 4
MAX_CANDIDATES = 24
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


def choose_victims(need: Need, devices: Sequence[GpuDevice], entries: Mapping[str, LedgerEntry],
                   priority: int, eligible: Collection[int] | None = None) -> Victims | NoVictims:
    """The victims on this node that let a claim of ``priority`` needing ``need`` fit on the GPUs
    in ``eligible`` (indexes; None: every healthy GPU), chosen in the module's stated order."""
    usable = {d.index: d for d in devices if d.healthy and (eligible is None or d.index in eligible)}
    touching = [e for e in entries.values() if any(s.index in usable for s in e.shares)]
    allowed = [e for e in touching if e.preemptible and e.priority < priority]
    allowed.sort(key=lambda e: (e.priority, -e.ts, e.claim))
    candidates = allowed[:MAX_CANDIDATES]
    best: tuple | None = None
    for size in range(0, min(MAX_VICTIMS, len(candidates)) + 1):
        for group in combinations(candidates, size):
            if not _fits(need, usable, entries, {e.claim for e in group}):
                continue
            key = _order(need, group)
            if best is None or key < best[0]:
                best = (key, group)
        if best is not None:
            key, group = best
            return Victims(claims=[e.claim for e in group], freed_mib=_memory(group), order=key)
    return NoVictims(reason=_why_not(need, priority, touching, allowed, candidates))


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


def _describe(entry: LedgerEntry) -> str:
    return f"{entry.claim} (non-preemptible)" if not entry.preemptible else f"{entry.claim} (priority {entry.priority})"


def _why_not(need: Need, priority: int, touching: Sequence[LedgerEntry], allowed: Sequence[LedgerEntry],
             candidates: Sequence[LedgerEntry]) -> str:
    memory = "whole GPUs" if need.memory_mib is None else f"{need.memory_mib} MiB"
    wanted = f"{need.gpus} x {memory}" + (f", {need.cores}% cores" if need.cores else "")
    kept = [e for e in touching if e not in allowed]
    parts = [f"preempting claims of priority below {priority} frees no room for {wanted} here"]
    if len(allowed) > len(candidates) or len(candidates) > MAX_VICTIMS:
        parts.append(f"(at most {MAX_VICTIMS} victims among the {MAX_CANDIDATES} lowest-priority claims are tried)")
    if kept:
        parts.append("; it would also need " + ", ".join(_describe(e) for e in sorted(kept, key=lambda e: e.claim)))
    return " ".join(parts)
