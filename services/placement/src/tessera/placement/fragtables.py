"""The fragmentation model's tables for one workload mix: thresholds, kind groups, memos.

A node's fragmentation (`engine`'s fragmentation maths, and its compiled twin `_fgdcore.c`) is
computed against the workload mix: the kinds' CPU and host-memory thresholds, the kinds grouped by
their GPU part, the kinds hungriest for host memory; and it is remembered in memo tables that are
valid for that mix only. All of that is one `FragTables`, built afresh when the mix is republished
(`FragTables.of_mix`), and handed to the compiled core as one object whose fields it reads by
these names: rename a field here and in `_fgdcore.c` together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .mix import Demand

__all__ = ["FragTables"]


@dataclass(slots=True, eq=False)
class FragTables:
    # Key of a node class's own entry in its cache (CPU bucket, memory bucket, own host-memory term).
    own_key: tuple = ()
    # The mix: (kind, weight) pairs.
    kinds: list[tuple[Demand, float]] = field(default_factory=list)
    # The kinds' CPU / host-memory demands, distinct and sorted: a node's CPU or memory free enters
    # as a bucket, the number of these thresholds it reaches (bisect_right).
    cpu_steps: list[int] = field(default_factory=list)
    mem_steps: list[int] = field(default_factory=list)
    # Kinds grouped by their GPU part: (a kind of the group, [(cpu bucket index, memory bucket
    # index, weight) per member]); fit on a GPU is computed once per group.
    groups: list[tuple[Demand, list]] = field(default_factory=list)
    group_gpus: tuple = ()  # per group, the GPUs a member asks for
    group_zero: tuple = ()  # per group, 0 (the vectors of a node without GPUs)
    # Kinds by host memory per GPU unit, hungriest first: (beta, group, cpu index, memory index,
    # weight); empty unless the host-memory term (`fluid_memory`) is on.
    hungry: list[tuple] = field(default_factory=list)
    # Memos, valid for this mix only:
    capacity: dict[tuple, tuple] = field(default_factory=dict)  # GPU states -> (free U, usable per group or None)
    state_vectors: dict[int, tuple] = field(default_factory=dict)  # GPU state id -> its part of `capacity`
    group_weights: dict[tuple[int, int], tuple] = field(default_factory=dict)  # (bc, bm) -> weight per group fitting
    hungry_at: dict[tuple, list] = field(default_factory=dict)  # (bc, bm) -> the hungry kinds that fit there
    entry_memo: dict[tuple, tuple | None] = field(default_factory=dict)  # evaluation of a class's entry
    gpu_memo: dict[tuple, object] = field(default_factory=dict)  # GPU choice of a shape on GPU states

    @classmethod
    def of_mix(cls, kinds: list[tuple[Demand, float]], own_key: tuple, fluid_memory: bool) -> "FragTables":
        cpu_steps = sorted({kd.cpu for kd, _ in kinds})
        mem_steps = sorted({kd.hostmem for kd, _ in kinds})
        # Kinds grouped by their GPU part: fit is computed once per group, CPU/memory per member.
        parts: dict[tuple, tuple[Demand, list]] = {}
        for kd, p in kinds:
            gk = (kd.gpus, kd.memory_mib, kd.memory_percent, kd.cores)
            if gk not in parts:
                parts[gk] = (kd, [])
            parts[gk][1].append((cpu_steps.index(kd.cpu), mem_steps.index(kd.hostmem), p))
        groups = list(parts.values())
        # Kinds by host memory per GPU unit, hungriest first (see `Placer._fluid`).
        gidx = {gk: j for j, gk in enumerate(parts)}
        hungry = []
        for kd, p in kinds:
            if kd.gpus and kd.hostmem:
                # (a claim sized in MiB only: its share of a card is unknown here; a quarter)
                share = 1.0 if kd.exclusive else (max(kd.cores, kd.memory_percent or 0) or 25) / 100
                hungry.append((kd.hostmem / (kd.gpus * share),
                               gidx[(kd.gpus, kd.memory_mib, kd.memory_percent, kd.cores)],
                               cpu_steps.index(kd.cpu), mem_steps.index(kd.hostmem), p))
        hungry.sort(key=lambda t: -t[0])
        return cls(own_key=own_key, kinds=kinds, cpu_steps=cpu_steps, mem_steps=mem_steps, groups=groups,
                   group_gpus=tuple(kd.gpus for kd, _ in groups), group_zero=(0,) * len(groups),
                   hungry=hungry if fluid_memory else [])

    def memos(self) -> tuple[dict, ...]:
        """The memo tables (what a republished mix retires)."""
        return (self.entry_memo, self.gpu_memo, self.capacity, self.hungry_at, self.group_weights,
                self.state_vectors)
