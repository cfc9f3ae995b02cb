"""The workload mix: what a typical claim looks like, learned from the claims placement has seen.

Fragmentation only means something relative to the tasks that will come: 30% of a GPU is a fragment
for a workload of whole-GPU jobs and perfectly usable for one of 25%-slices. The FGD paper (Weng et
al., USENIX ATC'23) measures a node's fragmentation as the expected unusable GPU capacity for a task
drawn from the workload's task mix; this module keeps that mix. It counts observed claim shapes
(GPU count, memory and core share per GPU, host CPU and memory), keeps the most frequent ones, and
republishes a normalised distribution only now and then (each republish invalidates cached scores,
so it must be rare and worth it: see `WorkloadMix.observe`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tessera.shared import fragmentation
from tessera.shared.events import ClaimSpec

__all__ = ["Demand", "WorkloadMix", "demand_of", "DEFAULT_MIX"]


class Demand:
    """A claim reduced to what placement needs, with per-device-state fit answers cached.

    `gpus` may be 0 (a CPU-only task: only the simulator places those). Memory per GPU is
    `memory_mib`, else `memory_percent` of the card, else the whole card. `cores` 100 is exclusive.
    """

    __slots__ = (
        "gpus", "memory_mib", "memory_percent", "cores", "exclusive", "use_types", "nouse_types",
        "use_uuids", "nouse_uuids", "cpu", "hostmem", "node", "node_policy", "gpu_policy",
        "shape", "gshape", "kind", "_fit", "_fail", "_ckey",
    )

    def __init__(
        self, *, gpus: int = 1, memory_mib: int | None = None, memory_percent: int | None = None,
        cores: int = 0, use_types=(), nouse_types=(), use_uuids=(), nouse_uuids=(), cpu: int = 0,
        hostmem: int = 0, node: str | None = None, node_policy: str | None = None,
        gpu_policy: str | None = None,
    ) -> None:
        self.gpus = gpus
        self.memory_mib = memory_mib
        self.memory_percent = memory_percent
        self.cores = cores
        self.exclusive = cores >= 100
        self.use_types = tuple(t.lower() for t in use_types)
        self.nouse_types = tuple(t.lower() for t in nouse_types)
        self.use_uuids = frozenset(use_uuids)
        self.nouse_uuids = frozenset(nouse_uuids)
        self.cpu = cpu
        self.hostmem = hostmem
        self.node = node
        self.node_policy = node_policy
        self.gpu_policy = gpu_policy
        # What the mix counts: the resource shape, without selectors or policies.
        self.kind = (gpus, memory_mib, memory_percent, cores, cpu, hostmem)
        self.shape = (self.kind, self.use_types, self.nouse_types, node_policy, gpu_policy)
        # What decides which GPUs fit and how they change: the shape without CPU and host memory.
        self.gshape = (gpus, memory_mib, memory_percent, cores, self.use_types, self.nouse_types)
        self._fit: dict[int, bool] = {}
        self._fail: dict[int, int] = {}  # device state id -> first failing constraint (engine)
        self._ckey: tuple | None = None

    def mem_req(self, memory_mib: int) -> int:
        """MiB this claim takes on a card of `memory_mib` (HAMi: percent of total, floored)."""
        if self.memory_mib is not None:
            return self.memory_mib
        if self.memory_percent is not None:
            return memory_mib * self.memory_percent // 100
        return memory_mib

    def type_ok(self, s) -> bool:
        return self.model_ok(s.model_lc)

    def model_ok(self, model_lc: str) -> bool:
        """Whether a GPU of this (lower-cased) model may hold the claim: HAMi's type rules, by substring."""
        if self.use_types and not any(t in model_lc for t in self.use_types):
            return False
        return not any(t in model_lc for t in self.nouse_types)

    def uuid_ok(self, uuid: str) -> bool:
        """Whether the claim's UUID selectors let it use this GPU."""
        return (not self.use_uuids or uuid in self.use_uuids) and uuid not in self.nouse_uuids

    def fits(self, s) -> bool:
        """Whether one more share of this claim fits on a GPU in device state `s` (uuid aside)."""
        r = self._fit.get(s.id)
        if r is None:
            r = (
                s.healthy and not s.exclusive and s.shares < s.max_shares
                and (not self.exclusive or s.shares == 0)
                and s.memory_mib - s.mem_used >= self.mem_req(s.memory_mib)
                and 100 - s.cores_used >= self.cores
                and self.type_ok(s)
            )
            self._fit[s.id] = r
        return r

    def fitting(self, devs: tuple, states: list) -> list[int]:
        """Positions in `devs` (device state ids) where one more share of this claim fits."""
        known = self._fit
        out = []
        for i, s in enumerate(devs):
            r = known.get(s)
            if r is None:
                r = self.fits(states[s])
            if r:
                out.append(i)
        return out

    def units(self, s) -> float:
        """This claim's size on one GPU in GPU units (the larger of its memory and compute share)."""
        return max(self.mem_req(s.memory_mib) / s.memory_mib, self.cores / 100)


def demand_of(spec: ClaimSpec) -> Demand:
    return Demand(
        gpus=spec.gpus, memory_mib=spec.memory_mib, memory_percent=spec.memory_percent,
        cores=spec.cores, use_types=spec.use_types, nouse_types=spec.nouse_types,
        use_uuids=spec.use_uuids, nouse_uuids=spec.nouse_uuids, cpu=spec.cpu_millis,
        hostmem=spec.host_memory_mib, node=spec.node, node_policy=spec.node_policy,
        gpu_policy=spec.gpu_policy,
    )


# The default mix and the kinds' size weights are the shared definition of fragmentation's mix
# (tessera.shared.fragmentation), which the CLI's fleet view uses too.
DEFAULT_MIX = fragmentation.DEFAULT_MIX


def _kind_demand(kind: tuple) -> Demand:
    gpus, memory_mib, memory_percent, cores, cpu, hostmem = kind
    return Demand(gpus=gpus, memory_mib=memory_mib, memory_percent=memory_percent, cores=cores,
                  cpu=cpu, hostmem=hostmem)


_size_weight = fragmentation.size_weight


# Total variation distance between the published mix and the current counts below which the published
# mix is kept whatever else holds.
REPUBLISH_AT = 0.05
# A move counts as a shift of the workload when it is this many times what sampling alone would give.
SHIFT_OVER_NOISE = 2.0


def _moved(old: list[tuple[Demand, float]], new: list[tuple[Demand, float]]) -> float:
    """Total variation distance between two mixes (0: same, 1: disjoint)."""
    a = {d.kind: p for d, p in old}
    b = {d.kind: p for d, p in new}
    return sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in a.keys() | b.keys()) / 2


def sampling_noise(new: list[tuple[Demand, float]], published_at: int, seen: int) -> float:
    """The total variation distance expected between a mix built from `published_at` claims and one
    built from `seen` claims (the first ones and more) when both are samples of one unchanging
    workload. The later mix is the earlier one moved by the newer claims' share toward their own
    sample, so each kind differs by about (n/seen) x |q - p| with q from n = seen - published_at
    claims: E|q - p| ~ sqrt(2/pi) sqrt(p(1-p)(1/n + 1/published_at)) (normal approximation).
    """
    n = seen - published_at
    if n <= 0 or published_at <= 0:
        return 0.0
    spread = sum((p * (1.0 - p)) ** 0.5 for _, p in new)
    return (n / seen) * 0.5 * (2 / 3.141592653589793) ** 0.5 * (1 / n + 1 / published_at) ** 0.5 * spread


class WorkloadMix:
    """A distribution over claim kinds. Feed it with `observe`; read `kinds()` and `version`."""

    def __init__(self, max_kinds: int = 160, coverage: float = 1.0, cpu_only: bool = True) -> None:
        self.max_kinds = max_kinds
        self.cpu_only = cpu_only
        self.coverage = coverage
        self._counts: Counter[tuple] = Counter()
        self._seen = 0
        self._seen_at_build = 0  # claims seen at the last check
        self._published_at = 0  # claims the published mix was built from (0: the default mix)
        self.version = 0
        self._kinds: list[tuple[Demand, float]] = self._build(Counter(dict(DEFAULT_MIX)))

    def observe(self, what: ClaimSpec | Demand, weight: int = 1) -> None:
        d = what if isinstance(what, Demand) else demand_of(what)
        if d.gpus == 0 and not self.cpu_only:
            return  # (cpu_only: CPU-only claims count; they are what tells stranded GPUs apart)
        self._counts[d.kind] += weight
        self._seen += weight
        grown = self._seen - self._seen_at_build
        if grown >= max(16, min(self._seen_at_build // 4, 5000)):
            self._check()

    def _check(self) -> None:
        """Republish the mix if that is worth invalidating every cached score for.

        Checked after 16 claims, then whenever the count grew by a quarter (at most every 5,000).
        Worth it when the distribution moved by `REPUBLISH_AT` or more in total variation and either
        the evidence behind it at least doubled since the published mix (the estimate's error falls
        by a factor of 1.4 or more) or the move is well beyond what sampling an unchanged workload
        gives (the workload shifted). Moves within sampling noise alone are common while a mix of a
        hundred kinds is learned: on openb's claims every republish of the old rule was one
        (bench/placement_sim.md), each costing a full re-scoring of the fleet for every claim shape.
        """
        kinds = self._build(self._counts)
        self._seen_at_build = seen = self._seen
        moved = _moved(self._kinds, kinds)
        if moved < REPUBLISH_AT:
            return
        published_at = self._published_at
        if (seen >= 2 * published_at
                or moved >= SHIFT_OVER_NOISE * sampling_noise(kinds, published_at, seen)):
            self._kinds = kinds
            self._published_at = seen
            self.version += 1

    def observe_all(self, items) -> None:
        """Feed many claims at once and publish the mix once (history replay, benchmarks)."""
        for it in items:
            d = it if isinstance(it, Demand) else demand_of(it)
            if d.gpus or self.cpu_only:
                self._counts[d.kind] += 1
                self._seen += 1
        self._kinds = self._build(self._counts)
        self._seen_at_build = self._published_at = self._seen
        self.version += 1

    def kinds(self) -> list[tuple[Demand, float]]:
        return self._kinds

    def counts(self) -> dict[tuple, int]:
        """Claims seen per kind (what the paper's FGD builds its target workload from)."""
        return dict(self._counts)

    def _build(self, counts: Counter) -> list[tuple[Demand, float]]:
        # (weights are counts of claims seen, or the default mix's fractions)
        total: Any = sum(counts.values())
        if not total:
            return []
        top: list[tuple[tuple, float]] = []
        acc = 0.0
        ranked: list[tuple[tuple, Any]] = counts.most_common(self.max_kinds)
        for kind, n in ranked:
            top.append((kind, n))
            acc += n
            if acc >= self.coverage * total:
                break
        # Weight = popularity, as the paper weighs (a CPU-only kind at a fraction: `size_weight`).
        weighted = [(_kind_demand(k), n * _size_weight(k)) for k, n in top]
        z = sum(w for _, w in weighted)
        return [(d, w / z) for d, w in weighted]
