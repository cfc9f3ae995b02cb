"""The FGD paper's placement algorithm as published: the baseline our own policy is measured against.

Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation Gradient
Descent" (USENIX ATC'23), as its open-source simulator runs it for the paper's figures. Kept apart
from the engine's own fragmentation-aware policy (which departs from the paper on purpose: other
kind weights, host memory, tie-breaks) so that every comparison is made side by side, in one run,
on the same sampled workload, and not against a number from a paper.

The published definitions, restated:

- Target workload: the task types of the workload's pod list, a type being (CPU request, GPU
  request per GPU in milli, GPU count, GPU type constraint); host memory is not part of it.
  Popularity = count / total; the most popular types are kept until they cover 95% of the pods
  (one type at a time), then renormalised. CPU-only types are included.
- A node's fragmentation for a type: with no GPU request, all the node's unallocated GPU capacity
  (the type cannot use any GPU). If the node's GPU model is excluded by the type's constraint,
  or the node cannot host the type (too few GPUs with enough left, or too little CPU left): all of
  it. Otherwise the capacity of the GPUs left with less than the type asks per GPU (for a
  whole-GPU type: every GPU not entirely free). The node's fragmentation is the popularity-weighted
  sum over the types.
- Score of a node for a task: the fragmentation before minus after placing it, in GPUs, through a
  sigmoid, times 100, truncated to an integer. A GPU-sharing task tries every GPU it fits on and
  takes the best (the first GPU on a tie); a whole-GPU task takes the node's lowest-indexed free
  GPUs; a CPU-only task only takes CPU. The scheduler takes the node with the highest score.

Equal scores are common (the integer score moves in steps of about 0.04 GPU near zero, so most
whole-GPU placements tie). Among them we take the node first by name. The Kubernetes scheduler's
own rule, a uniformly random one, does not reproduce the paper: on openb at 100% arrival random
ties leave far more GPUs unallocated than published and first-by-name lands near the published
figure (bench/placement_sim.md, "fgd-paper tie rule"), so the published runs must have broken ties
in a fixed node order.

Feasibility is the engine's own (CPU, host memory, per-GPU fit, type selectors, share limits), so
both policies face the same filters. A GPU's capacity left is its `free` (GPU units) in milli.
"""

from __future__ import annotations

from collections import Counter
from math import exp, floor
from typing import Iterable

from .mix import Demand

__all__ = ["TypicalPods", "PaperFGD", "POLICY"]

POLICY = "fgd-paper"
POPULARITY_THRESHOLD = 0.95  # the simulator's podPopularityThreshold for the paper's experiments
MILLI = 1000


def gpu_milli(d: Demand) -> int:
    """A claim's GPU request per GPU in milli (0 for a CPU-only claim)."""
    if not d.gpus:
        return 0
    if d.exclusive:
        return MILLI
    share = max(d.cores, d.memory_percent or 0)
    return 10 * share if share else MILLI // 4  # (sized in MiB only: a quarter, as the mix assumes)


class TypicalPods:
    """The paper's target workload: [(cpu, milli, gpus, representative demand, popularity)]."""

    def __init__(self, demands: Iterable[Demand | tuple[Demand, int]],
                 threshold: float = POPULARITY_THRESHOLD) -> None:
        counts: Counter[tuple] = Counter()
        rep: dict[tuple, Demand] = {}
        for item in demands:
            d, n = item if isinstance(item, tuple) else (item, 1)
            k = (d.cpu, gpu_milli(d), d.gpus, d.use_types, d.nouse_types)
            counts[k] += n
            rep.setdefault(k, d)
        total = sum(counts.values())
        if not total:
            raise ValueError("the paper's FGD needs a target workload: no claims were given")
        # Most popular first; equal counts in a fixed order (the simulator's: larger type first).
        ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0][0], kv[0][1], kv[0][2], kv[0][3]),
                        reverse=True)
        kept, acc = [], 0
        for k, n in ranked:
            kept.append((k, n))
            acc += n
            if acc >= threshold * total:
                break
        self.types = [(k[0], k[1], k[2], rep[k], n / acc) for k, n in kept]
        self.version = 0


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + exp(-x))


class PaperFGD:
    """Scores a fleet's node classes for one claim the paper's way; the caller commits."""

    def __init__(self, typical: TypicalPods, states) -> None:
        self.typical = typical
        self.states = states  # the fleet's DeviceStates
        self._frag: dict[tuple, float] = {}
        self._access: dict[str, tuple[bool, ...]] = {}
        self._memo: dict[tuple, tuple | None] = {}

    def milli_left(self, sid: int) -> int:
        return int(floor(self.states.states[sid].free * MILLI + 0.5))

    def access(self, sid: int) -> tuple[bool, ...]:
        """Per typical type, whether a node whose GPUs are like state `sid` passes its GPU type."""
        st = self.states.states[sid]
        a = self._access.get(st.model_lc)
        if a is None:
            a = self._access[st.model_lc] = tuple(t[3].type_ok(st) for t in self.typical.types)
        return a

    def fragmentation(self, lefts: tuple[int, ...], cpu_left: int, access: tuple[bool, ...]) -> float:
        """F_n(M) in milli-GPU for a node with GPUs' capacity left `lefts` and CPU left `cpu_left`."""
        key = (tuple(sorted(lefts)), cpu_left, access)
        f = self._frag.get(key)
        if f is not None:
            return f
        total = sum(lefts)
        f = 0.0
        if total:
            for (cpu, milli, gpus, _, p), ok in zip(self.typical.types, access):
                if milli == 0 or not ok:
                    f += p * total
                    continue
                enough = 0
                small = 0
                for x in lefts:
                    if x >= milli:
                        enough += 1
                    else:
                        small += x
                if enough >= gpus and cpu_left >= cpu:
                    f += p * small
                else:
                    f += p * total
        if len(self._frag) > 400_000:
            self._frag.clear()
        self._frag[key] = f
        return f

    def score(self, devs: tuple, cpu_free: int, mem_free: int, d: Demand, mask=None):
        """(integer score, candidate positions in `devs`) or None where the claim does not fit.

        For a GPU-sharing claim the positions are the GPUs that reach the best score (the caller
        takes the lowest-indexed); for a whole-GPU claim, every fitting GPU (it takes the
        `d.gpus` lowest-indexed); for a CPU-only claim, none."""
        if d.cpu > cpu_free or d.hostmem > mem_free:
            return None
        key = None
        if mask is None:
            key = (d.gshape, d.cpu, devs, cpu_free)
            r = self._memo.get(key, self)
            if r is not self:
                return r
        r = self._score(devs, cpu_free, d, mask)
        if key is not None:
            if len(self._memo) > 400_000:
                self._memo.clear()
            self._memo[key] = r
        return r

    def _score(self, devs: tuple, cpu_free: int, d: Demand, mask):
        states = self.states.states
        lefts = [self.milli_left(s) for s in devs]
        acc = self.access(devs[0]) if devs else tuple(True for _ in self.typical.types)
        before = self.fragmentation(tuple(lefts), cpu_free, acc)
        cpu_after = cpu_free - d.cpu
        if not d.gpus:
            after = self.fragmentation(tuple(lefts), cpu_after, acc)
            return (int(_sigmoid((before - after) / MILLI) * 100), ())
        fitting = [i for i, s in enumerate(devs) if d.fits(states[s]) and (mask is None or mask[i])]
        if len(fitting) < d.gpus:
            return None
        if d.gpus == 1 and not d.exclusive:
            best = -1
            pos: list[int] = []
            for i in fitting:
                trial = lefts.copy()
                trial[i] -= int(floor(d.units(states[devs[i]]) * MILLI + 0.5))
                s = int(_sigmoid((before - self.fragmentation(tuple(trial), cpu_after, acc)) / MILLI) * 100)
                if s > best:
                    best, pos = s, [i]
                elif s == best:
                    pos.append(i)
            return (best, tuple(pos))
        trial = lefts.copy()
        for i in fitting[: d.gpus]:  # (for whole GPUs, all entirely free: any k of them alike)
            trial[i] -= int(floor(d.units(states[devs[i]]) * MILLI + 0.5))
        after = self.fragmentation(tuple(trial), cpu_after, acc)
        return (int(_sigmoid((before - after) / MILLI) * 100), tuple(fitting))
