"""The placement decision: which node and which GPUs a claim gets, or why none fits.

Pure and synchronous: no I/O, no clock, no mutation of the fleet (the service commits through a
compare-and-set on the ledger and then feeds the result back with `Fleet.apply_ledger`). The same
code runs in the service and in the packing benchmark, so the benchmark measures what ships.

Work per claim is kept proportional to what changed: the fleet groups identical nodes into classes
and a commit creates at most one new class; each claim shape keeps a heap of the classes it fits,
brought up to date from the fleet's class log, so a class is scored once per shape (`shapeindex`).
Scores are memoised on what they depend on (the claim's GPU part, the GPU states, CPU/memory only as
kind thresholds), so classes and shapes alike in that share one evaluation. Why a claim fits nowhere
(the rejection's reason and per-constraint counts) is `explain`'s job.

The fragmentation-aware scoring of a class (`_fgd_entry` and what it calls) also exists compiled, in
`_fgdcore.c`: the same arithmetic in the same order on the same memo tables, bit-identical
(tests/placement/test_compiled_core.py), reading the mix's tables from one object (`fragtables`).
This Python is the reference and runs where the core was not built or `compiled=False` asks for it;
what the core buys through NATS on openb, against this engine, is measured in bench/placement_sim.md.

Policies (the registry, with the baseline scorers themselves, is `policies`):

- ``binpack`` / ``spread``: HAMi's scores. A node scores used/total of shares + cores + memory over
  its GPUs; binpack takes the most used node, spread the least. Same per GPU within the node.
- ``best-fit``: the node (and GPU) with the least normalised capacity left after placement.
- ``dot-product``: Tetris-style alignment of the claim's demand with the node's free vector.
- ``fragmentation-aware``: from the FGD paper's description (Weng et al., ATC'23). A node's
  fragmentation for a task kind is the free GPU capacity that kind cannot use (all of it if the node
  cannot host the kind at all, counting CPU and host memory; otherwise the GPUs too small for it);
  the node's fragmentation is the expectation over the workload mix. We choose the node and GPUs
  that minimise the increase, then prefer the tighter fit.
- ``random``: a uniformly random feasible node (benchmark baseline).
- ``fgd-paper``: the FGD paper's algorithm as published (`paperfgd`), the baseline the
  fragmentation-aware policy is measured against; same filters, its own scores and tie-breaks.
"""

from __future__ import annotations

import random as _random
from collections import deque
from bisect import bisect_right
from heapq import heappop, heappush
from dataclasses import dataclass
from functools import partial
from itertools import count
from math import floor
from operator import attrgetter
from types import ModuleType
from typing import Any

from tessera.shared.events import ClaimSpec, DeviceShare, LedgerEntry, request_specs

from .explain import CONSTRAINTS, UNEXPLAINED, Explainer, Rejection
from .fleet import Fleet, Node, NodeClass
from .fragtables import FragTables
from .shapeindex import HEAPS_CAP, ShapeIndex
from .mix import Demand, WorkloadMix, _kind_demand, demand_of
from .paperfgd import PaperFGD, TypicalPods
from .policies import FRAGMENTATION_AWARE, PAPER_FGD, POLICY, RANDOM, policy

__all__ = ["Placement", "Rejection", "Placer", "CONSTRAINTS", "ledger_entry", "COMPILED_CORE"]

_MISS = object()
_NO_FIT = object()
_BY_BUCKET = object()
_tokens = count()
_CACHE_CAP = 64  # cached claim shapes per node class
_FCACHE_CAP = 120_000
_node_name = attrgetter("name")
# Retired memo entries (or index entries) freed per step, in a decision or between them: 2,048 at
# once took 1-3 ms inside decisions on the 5,000-node fleet, 256 up to 7 ms (an index entry can
# hold the last reference to a dead node class and its caches; bench/placement_sim.md).
_SWEEP = 32
_WARM_SHAPES = HEAPS_CAP  # shapes indexed again ahead after a republish: all with a live index
_WARM_STEP = 8  # class evaluations per `warm` call: a short step even on a cold memo (bench/placement_sim.md)
# Class evaluations each decision spends on the next mix's indexes while they are staged
# (`staged_mix`): under a stream with no idle moment the next mix is still taken up, in
# (indexed shapes x classes) / _STAGE_STEP decisions. Few: on a cold memo one evaluation can take
# a fraction of a millisecond; idle steps do the bulk.
_STAGE_STEP = 2

# The fragmentation-aware index entries compiled (_fgdcore.c: same arithmetic, same memo tables,
# bit-identical entries); None where it was not built, and the Python below runs instead.
_core: ModuleType | None
try:
    from . import _fgdcore
except ImportError:  # pragma: no cover - depends on the build machine
    _core = None
else:
    _fgdcore.configure(_BY_BUCKET, _NO_FIT, _FCACHE_CAP, _CACHE_CAP)
    _core = _fgdcore
COMPILED_CORE = _core is not None


@dataclass(frozen=True, slots=True)
class Placement:
    node: str
    shares: list[DeviceShare]
    score: float = 0.0


def ledger_entry(claim_id: str, tenant: str, spec: ClaimSpec, placement: Placement, pod_uid: str = "") -> LedgerEntry:
    """The ledger entry that records `placement` for this claim (``pod_uid``: Kubernetes mode, the
    claim's pod)."""
    return LedgerEntry(claim=claim_id, tenant=tenant, shares=placement.shares,
                       cpu_millis=spec.cpu_millis, host_memory_mib=spec.host_memory_mib, pod_uid=pod_uid,
                       priority=spec.priority, preemptible=spec.preemptible)


def _q9(x: float) -> float:
    """`x` to the nearest 1e-9, so that deltas equal up to float noise tie (plain IEEE arithmetic,
    which the compiled core repeats exactly; round() would cost a decimal conversion)."""
    return floor(x * 1e9 + 0.5) / 1e9


# The fragmentation-aware score's resolution, in GPUs: changes in expected unusable capacity nearer
# than this are the same score, and the tie goes to the tighter fit (less GPU left, then less CPU).
# The expectation is over a sampled mix, and the host-memory term makes it continuous: without a
# band, differences of a few thousandths of a GPU outranked a fit that leaves a whole GPU free, and
# every GPU pod sharing a GPU (the gpu-share family at 100%) fell behind the paper's FGD, whose
# integer scores tie far more. 1/40 is half the smallest share openb's claims ask (0.05 GPU); the
# bands tried are in bench/placement_families.md.
TIE_STEPS = 40.0


def _made_ahead(ck: tuple) -> bool:
    """Whether a shape's index is built ahead of its claims after a republish (random choices are
    not made ahead)."""
    return RANDOM not in (ck[3], ck[4])


def _tied(x: float) -> float:
    """`x` to the nearest 1/TIE_STEPS of a GPU (the compiled core repeats it exactly)."""
    return floor(x * TIE_STEPS + 0.5) / TIE_STEPS


class Placer:
    """Chooses node and GPUs for claims against one `Fleet`.

    `mix` is the workload mix the fragmentation-aware policy measures against; with `learn` (the
    default) every new claim id seen by `place` is fed to it. `typical` is the paper FGD's target
    workload (`fgd-paper`); without it, one is built from the mix's counts when first needed.
    """

    def __init__(
        self, fleet: Fleet, default_node_policy: str = FRAGMENTATION_AWARE,
        default_gpu_policy: str | None = None, mix: WorkloadMix | None = None, *,
        learn: bool = True, seed: int = 0, fluid_memory: bool = False, compiled: bool | None = None,
        typical: TypicalPods | None = None, paper_ties: str = "name", staged_mix: bool = False,
    ) -> None:
        for p in (default_node_policy, default_gpu_policy):
            if p is not None:
                policy(p)  # (a ValueError naming the policies there are)
        self.fleet = fleet
        self.default_node_policy = default_node_policy
        self.default_gpu_policy = default_gpu_policy or default_node_policy
        self.mix = mix if mix is not None else WorkloadMix()
        self.learn = learn
        # Count host memory's gradual stranding of GPUs in the fragmentation (`_fluid`): packs better
        # and costs decision time (both measured in bench/placement_sim.md); the service turns it on.
        self.fluid_memory = fluid_memory
        # The compiled fragmentation-aware core where built (None: if built; False: the Python one).
        if compiled and _core is None:
            raise RuntimeError("the compiled placement core (tessera.placement._fgdcore) is not built here")
        self._core = _core if compiled is not False else None
        if self._core is not None:
            # (what _fragb and _fluid call, compiled: the instance's attribute shadows the method)
            self._gvec = partial(self._core.gvec, self)  # type: ignore[method-assign]
        self.rng = _random.Random(seed)
        self.typical = typical
        if paper_ties not in ("name", "random"):
            raise ValueError(f"paper_ties is {paper_ties!r}: 'name' (first node by name) or 'random'")
        self.paper_ties = paper_ties
        self._paper: PaperFGD | None = None
        self._token = next(_tokens)
        self._epoch = -1
        self._demands: dict[tuple, Demand] = {}
        self._recent: set[str] = set()
        self._recent_q: deque[str] = deque()
        # The fragmentation model's thresholds, kind groups and memos for the current mix, in one
        # object the compiled core reads too (`fragtables`); rebuilt on a republished mix.
        self.tables = FragTables()
        # Per claim shape, the heap of the node classes it fits (`shapeindex`).
        self.index = ShapeIndex(fleet, self._entries)
        self._memo: dict[tuple, tuple | None] = {}
        self._roster: tuple[int, list[Node]] = (-1, [])
        self._explainer = Explainer(fleet, self._mask)
        self._trash: list = []  # retired memo tables, freed piecemeal (`_sweep`)
        # With `staged_mix`, a republished mix is taken up once the indexes of the shapes asked for
        # lately are built under it (`warm` between decisions, _STAGE_STEP classes in each decision);
        # until then decisions use the indexes of the mix before. Without it (the benchmarks'
        # simulators), the next decision takes it up and each shape's next claim builds its index.
        self.staged_mix = staged_mix
        self._next: tuple[int, FragTables, ShapeIndex] | None = None  # (mix version, tables, index)

    # --- public ---------------------------------------------------------------------------------

    def demand(self, spec: ClaimSpec) -> Demand:
        key = (spec.gpus, spec.memory_mib, spec.memory_percent, spec.cores, tuple(spec.use_types),
               tuple(spec.nouse_types), tuple(spec.use_uuids), tuple(spec.nouse_uuids),
               spec.cpu_millis, spec.host_memory_mib, spec.node, spec.node_policy, spec.gpu_policy)
        d = self._demands.get(key)
        if d is None:
            if len(self._demands) > 4096:
                self._demands.clear()
            d = self._demands[key] = demand_of(spec)
        return d

    def place(self, claim_id: str, tenant: str, spec: ClaimSpec,
              exclude_nodes=()) -> Placement | Rejection:
        if spec.requests:
            return self._place_together(claim_id, spec, frozenset(exclude_nodes))
        d = self.demand(spec)
        if self.learn and claim_id not in self._recent:
            self._recent.add(claim_id)
            self._recent_q.append(claim_id)
            if len(self._recent_q) > 8192:
                self._recent.discard(self._recent_q.popleft())
            self.mix.observe(d)
        return self.place_demand(d, exclude_nodes)

    def place_demand(self, d: Demand, exclude_nodes=(), *, explain: bool = True) -> Placement | Rejection:
        """Place an already-reduced claim (the simulator uses this for CPU-only tasks too).

        With `explain` false a rejection carries no reason or counts (the packing benchmark does not
        read them, and counting is the only part of a rejection that costs a fleet scan).
        """
        if self._epoch != self.mix.version:
            self._mix_moved()
        if self._next is not None:
            self._stage(_STAGE_STEP)
        if self._trash:
            self._sweep()
        node_policy = d.node_policy or self.default_node_policy
        gpu_policy = d.gpu_policy or self.default_gpu_policy
        if node_policy == PAPER_FGD:
            return self._place_paper(d, frozenset(exclude_nodes), explain)
        if d.node is not None or d.use_uuids or d.nouse_uuids or (exclude_nodes and node_policy == RANDOM):
            return self._place_each(d, node_policy, gpu_policy, frozenset(exclude_nodes))
        ck = d._ckey
        if ck is None or ck[1] != self._epoch:
            ck = d._ckey = (self._token, self._epoch, d.shape, node_policy, gpu_policy)
        if node_policy == RANDOM:
            return self._place_random(d, ck, gpu_policy, explain)
        heap = self.index.get(ck, d, node_policy, gpu_policy)
        if exclude_nodes:
            return self._place_allowed(heap, d, frozenset(exclude_nodes), gpu_policy, explain)
        if not heap:
            if not explain:
                return UNEXPLAINED
            return self._reject(d, ck, {}, None)
        e = heap[0]
        return self._placement(e[-2].first(), d, e[0], e[-1], gpu_policy)

    def _cached(self, cls: NodeClass, ck: tuple, d: Demand, node_policy: str, gpu_policy: str):
        cache = cls.cache
        r = cache.get(ck, _MISS)
        if r is _MISS:
            if len(cache) >= _CACHE_CAP:
                cache.clear()
            if gpu_policy == RANDOM or node_policy == RANDOM:
                r = self._evaluate(cls.devs, cls.cpu_free, cls.mem_free, cls.cpu_total, cls.mem_total,
                                   d, node_policy, gpu_policy, None)
            else:
                r = self._gpu_memo(cls, ck, d, node_policy, gpu_policy)
            cache[ck] = r
        return r

    def _gpu_memo(self, cls: NodeClass, ck: tuple, d: Demand, node_policy: str, gpu_policy: str):
        """Baseline policies: the GPU part of the answer depends on the GPU states alone; CPU and
        memory enter as feasibility and as linear terms added here."""
        c, m = cls.cpu_free, cls.mem_free
        if d.cpu > c or d.hostmem > m:
            return None
        key = (ck, cls.devs)
        g: Any = self._memo.get(key, _MISS)
        if g is _MISS:
            if len(self._memo) >= _FCACHE_CAP:
                self._memo.clear()
            g = self._memo[key] = self._gpu_part(cls.devs, d, node_policy, gpu_policy)
        if g is None:
            return None
        term, positions = g
        node_score = POLICY[node_policy].node_score
        assert node_score is not None  # a baseline policy (the only ones that come here) has its scorer
        return (node_score(term, c, m, cls.cpu_total or 1, cls.mem_total or 1, d), positions)

    def _gpu_part(self, devs: tuple, d: Demand, node_policy: str, gpu_policy: str):
        states = self.fleet.states.states
        k = d.gpus
        if k:
            fits = d.fits
            fitting = [i for i, s in enumerate(devs) if fits(states[s])]
            if len(fitting) < k:
                return None
            positions, after = self._choose_gpus(devs, fitting, d, gpu_policy, bisect_right(self.tables.cpu_steps, 0),
                                                 bisect_right(self.tables.mem_steps, 0))
        else:
            positions, after = (), devs
        node_term = POLICY[node_policy].node_term
        assert node_term is not None  # a baseline policy (the only ones that come here) has its GPU term
        return (node_term(states, devs, after, positions, d), positions)

    def _fgd_entry(self, cls: NodeClass, d: Demand, gpu_policy: str):
        """FGD's index entry for a class. The GPU choice and the change in fragmentation depend on
        the claim's GPU part, the GPU states, and CPU/memory free only through which kinds'
        thresholds they reach before and after the claim: claims alike in that (whatever their
        exact CPU and memory) and nodes alike in that share one evaluation."""
        c = cls.cpu_free
        m = cls.mem_free
        cpu = d.cpu
        hm = d.hostmem
        if cpu > c or hm > m:
            return None
        devs = cls.devs
        # What depends on the class alone is kept on it: its buckets and its own host-memory term.
        t = self.tables
        own = cls.cache.get(t.own_key)
        if own is None:
            own = self._fgd_own(cls)
        bc, bm, before = own
        bc2 = bisect_right(t.cpu_steps, c - cpu)
        bm2 = bisect_right(t.mem_steps, m - hm)
        key = (d.gshape, gpu_policy, devs, bc, bc2, bm, bm2)
        r: Any = t.entry_memo.get(key, _MISS)
        if r is _MISS:
            r = self._fgd_memo(key, devs, bc, bc2, bm, bm2, d, gpu_policy)
        if r is None:
            return None
        # The host-memory part of the change is exact in the node's memory, not bucketed: added here.
        delta = r[0]
        if t.hungry:
            delta += self._fluid(r[3], bc2, bm2, m - hm) - before
        return (_tied(delta), r[1], (c - cpu) / (cls.cpu_total or 1), cls.id, cls, r[2])

    def _fgd_own(self, cls: NodeClass) -> tuple:
        """(CPU bucket, memory bucket, own host-memory term) of a class, kept in its cache."""
        cache = cls.cache
        if len(cache) >= _CACHE_CAP:
            cache.clear()
        bc, bm = bisect_right(self.tables.cpu_steps, cls.cpu_free), bisect_right(self.tables.mem_steps, cls.mem_free)
        own = cache[self.tables.own_key] = (bc, bm, self._fluid(cls.devs, bc, bm, cls.mem_free))
        return own

    def _fgd_memo(self, key: tuple, devs: tuple, bc: int, bc2: int, bm: int, bm2: int, d: Demand,
                  gpu_policy: str):
        """`_fgd_eval`, remembered under `key` (the compiled core calls this on a miss too)."""
        memo = self.tables.entry_memo
        if len(memo) >= _FCACHE_CAP:
            memo.clear()
        r = memo[key] = self._fgd_eval(devs, bc, bc2, bm, bm2, d, gpu_policy)
        return r

    def _gpu_probe(self, gk: tuple, devs: tuple, bc2: int, bm2: int, d: Demand, gpu_policy: str):
        """`_gpu_choice` probed, remembered under `gk` (the compiled core calls this on a miss too)."""
        g = self._gpu_choice(devs, bc2, bm2, d, gpu_policy, True)
        memo = self.tables.gpu_memo
        if len(memo) >= _FCACHE_CAP:
            memo.clear()
        memo[gk] = g
        return g

    def _fgd_eval(self, devs: tuple, bc: int, bc2: int, bm: int, bm2: int, d: Demand, gpu_policy: str):
        """(increase in fragmentation, GPU capacity left, positions) or None when it does not fit."""
        gk = (d.gshape, gpu_policy, devs)
        g: Any = self.tables.gpu_memo.get(gk)
        if g is None:
            g = self._gpu_probe(gk, devs, bc2, bm2, d, gpu_policy)
        if g is _BY_BUCKET:
            g = self._gpu_choice(devs, bc2, bm2, d, gpu_policy, False)
        if g is _NO_FIT:
            return None
        positions, after, left = g
        delta = self._fragb(after, bc2, bm2) - self._fragb(devs, bc, bm)
        # Ties (common: many nodes where the claim changes nothing a typical task could use) go to
        # the tighter fit: less GPU left, then (added per class) less CPU left.
        return (_q9(delta), left, positions, after)

    def _gpu_choice(self, devs: tuple, bc2: int, bm2: int, d: Demand, gpu_policy: str, probe: bool):
        """(positions, GPU states after, GPU capacity left), `_NO_FIT`, or with `probe`
        `_BY_BUCKET` when the choice depends on CPU/memory left (several distinct candidate GPUs
        under the fragmentation-aware GPU policy); otherwise it depends on the GPU states alone."""
        states = self.fleet.states.states
        k = d.gpus
        if k:
            fitting = d.fitting(devs, states)
            if len(fitting) < k:
                return _NO_FIT
            if probe and gpu_policy == FRAGMENTATION_AWARE and len({devs[i] for i in fitting}) > 1:
                return _BY_BUCKET
            positions, after = self._choose_gpus(devs, fitting, d, gpu_policy, bc2, bm2)
        else:
            positions, after = (), devs
        left = 0.0
        for s in after:
            left += states[s].free
        return (positions, after, left)

    def _entry(self, cls: NodeClass, ck: tuple, d: Demand, node_policy: str, gpu_policy: str):
        """A class's entry in a shape's index: (score..., class id, class, positions) or None."""
        if node_policy == FRAGMENTATION_AWARE and gpu_policy != RANDOM:
            return self._fgd_entry(cls, d, gpu_policy)
        r = self._cached(cls, ck, d, node_policy, gpu_policy)
        if r is None:
            return None
        return r[0] + (cls.id, cls, r[1])

    def _entries(self, classes, ck: tuple, d: Demand, node_policy: str, gpu_policy: str) -> list:
        """The index entries of `classes` (alive) for one shape, unordered."""
        out: list = []
        if node_policy == FRAGMENTATION_AWARE and gpu_policy != RANDOM and self._core is not None:
            self._core.entries(self, classes, d, gpu_policy, out)
        else:
            entry = self._entry
            for cls in classes:
                e = entry(cls, ck, d, node_policy, gpu_policy)
                if e is not None:
                    out.append(e)
        return out

    def warm(self, budget: int = _WARM_STEP) -> int:
        """Spend up to `budget` class evaluations building, ahead of their next claim, the index of
        shapes asked for under the previous mix (a republished mix voids every index, and a shape's
        first index scores the whole fleet, all of them at once after a republish). Meant for
        idle moments (the service calls it between decisions); a claim that comes first finishes
        the index itself. The result is the same index either way. With `staged_mix` it builds the
        staged mix's indexes, and the mix is taken up when they are done. Once nothing is left to
        build, it frees a step of what the last republish retired. Returns the work done (class
        evaluations, or entries freed; 0: nothing was left to do).
        """
        if self._epoch != self.mix.version:
            self._mix_moved()
        if self._next is not None:
            return self._stage(budget)
        spent = self.index.warm(budget, self._shape_key)
        if not spent and self._trash:  # then what a republish retired, a step at a time
            return self._sweep()
        return spent

    def _shape_key(self, d: Demand, node_policy: str, gpu_policy: str) -> tuple:
        """The key of `d`'s shape in the index and the class caches under this mix (kept on `d`)."""
        ck = d._ckey
        if ck is None or ck[1] != self._epoch:
            ck = d._ckey = (self._token, self._epoch, d.shape, node_policy, gpu_policy)
        return ck

    # --- mix ------------------------------------------------------------------------------------

    def _mix_moved(self) -> None:
        """The mix was republished: take it up now, or (`staged_mix`) stage it."""
        version = self.mix.version
        if not self.staged_mix or self._epoch < 0:
            self._new_epoch()
            return
        if self._next is not None:
            if self._next[0] == version:
                return
            _, tables, index = self._next  # republished again while staged: that one is void too
            self._retire(tables, index.heaps, {})
        index = ShapeIndex(self.fleet, self._entries)
        index.to_warm = self.index.recent(_made_ahead, _WARM_SHAPES)
        self._next = (version, self._tables_of(version), index)

    def _stage(self, budget: int) -> int:
        """Spend up to `budget` class evaluations on the staged mix's indexes (the engine acts as
        under that mix meanwhile: the compiled core reads `tables`); take the mix up once they are
        built. Returns the evaluations spent."""
        assert self._next is not None
        version, tables, index = self._next
        held = self._epoch, self.tables, self.index
        self._epoch, self.tables, self.index = version, tables, index
        try:
            spent = index.warm(budget, self._shape_key)
        finally:
            self._epoch, self.tables, self.index = held
        if not index.to_warm:
            self._next = None
            self._retire(self.tables, self.index.heaps, self._memo)
            self._epoch, self.tables, self.index, self._memo = version, tables, index, {}
        return spent

    def _new_epoch(self) -> None:
        self._epoch = self.mix.version
        old = self.tables
        self.tables = self._tables_of(self._epoch)
        # The shapes asked for lately are indexed again ahead of their claims (`warm`), the most
        # recent first.
        self._retire(old, self.index.retire(_made_ahead, _WARM_SHAPES), self._memo)
        self._memo = {}

    def _tables_of(self, version: int) -> FragTables:
        return FragTables.of_mix(self.mix.kinds(), (self._token, version, "own"), self.fluid_memory)

    def _retire(self, tables: FragTables, heaps: dict, memo: dict) -> None:
        """Every score of a mix is void. Its tables can hold a few hundred thousand entries, whose
        freeing was the slowest decision on openb (bench/placement_sim.md): they are freed a little
        at a time by the decisions that follow (`_sweep`)."""
        self._trash += [(t, False) for t in (memo, *tables.memos())]
        self._trash.append((heaps, True))

    def _sweep(self, budget: int = _SWEEP) -> int:
        """Free up to `budget` entries of retired tables (a shape's index a part of its heap at a
        time). Returns the entries freed."""
        trash = self._trash
        left = budget
        while trash and left > 0:
            table, indexes = trash[-1]
            if not table:
                trash.pop()
                continue
            if not indexes:
                while table and left > 0:
                    table.popitem()
                    left -= 1
                continue
            while table and left > 0:  # (an index is [heap, last class, demand])
                key = next(reversed(table))
                heap = table[key][0]
                if len(heap) > left:
                    del heap[-left:]
                    left = 0
                else:
                    left -= len(heap) + 1
                    del table[key]
        return budget - left

    def _frag(self, G: tuple, c: int, m: int) -> float:
        """Expected unusable free GPU capacity (GPU units) of a node with GPUs `G`, CPU/mem free c/m."""
        t = self.tables
        bc = bisect_right(t.cpu_steps, c)
        bm = bisect_right(t.mem_steps, m)
        return self._fragb(G, bc, bm) + self._fluid(G, bc, bm, m)

    def _fluid(self, G: tuple, bc: int, bm: int, m: int) -> float:
        """What host memory strands beyond the kinds' thresholds (part of `_frag`, in GPU units).

        Memory strands GPUs gradually, not only where a kind stops fitting: a kind that needs `beta`
        MiB of host memory per GPU unit can use at most m / beta of the capacity `fs` it fits on
        GPUs `G` (a fluid bound), so it loses fs - m / beta more where m < fs * beta. Only kinds
        hungrier than m / U can lose anything: per bucket pair, the kinds that fit come hungriest
        first. (CPU treated the same way packs worse on openb: see bench/placement_sim.md.)
        """
        t = self.tables
        if not t.hungry:
            return 0.0
        gi = t.capacity.get(G)
        if gi is None:
            gi = self._gvec(G)
        fsv = gi[1]
        frag = 0.0
        if fsv is not None:
            mf = t.hungry_at.get((bc, bm))
            if mf is None:
                mf = self._mf(bc, bm)
            lim = m / gi[0]
            for beta, j, p, pb in mf:
                if beta <= lim:
                    break
                fs = fsv[j]
                if fs * beta > m:
                    frag += p * fs - m * pb
        return frag

    def _fragb(self, G: tuple, bc: int, bm: int) -> float:
        """`_frag` with CPU and memory given as buckets: how many kinds' thresholds they reach.

        Kinds are grouped by their GPU part. A group's usable capacity on GPUs `G` (free capacity of
        the GPUs it fits, if enough of them) depends on `G` alone, the weight of its members whose
        CPU and memory fit on (bc, bm) alone, so fragmentation = U - their dot product.
        """
        t = self.tables
        gi = t.capacity.get(G)
        if gi is None:
            gi = self._gvec(G)
        fsv = gi[1]
        if fsv is None:
            return gi[0]
        sv = t.group_weights.get((bc, bm))
        if sv is None:
            sv = self._sv(bc, bm)
        dot = 0.0  # (a plain loop: the compiled core adds in this order too, whatever sum() does)
        for f, w in zip(fsv, sv):
            dot += f * w
        return gi[0] - dot

    def _mf(self, bc: int, bm: int) -> list:
        """The kinds `_fluid` counts at buckets (bc, bm): (beta, group, weight, weight / beta),
        hungriest first."""
        t = self.tables
        mf = t.hungry_at[(bc, bm)] = [(beta, j, p, p / beta) for beta, j, ic, im, p in t.hungry
                                      if bc > ic and bm > im]
        return mf

    def _sv(self, bc: int, bm: int) -> tuple:
        """Per kind group, the weight of its members whose CPU and memory fit at buckets (bc, bm)."""
        out = []
        for _, members in self.tables.groups:
            acc = 0.0  # (plain additions in order: the compiled core's sums, on every Python)
            for ic, im, p in members:
                if bc > ic and bm > im:
                    acc += p
            out.append(acc)
        sv = self.tables.group_weights[(bc, bm)] = tuple(out)
        return sv

    def _gvec(self, G: tuple) -> tuple:
        """(free GPU capacity U, per kind group the capacity it can use, or None if none can)."""
        t = self.tables
        stv = t.state_vectors
        vs = []
        for s in G:
            v = stv.get(s)
            if v is None:
                v = self._state_vec(s)
            vs.append(v)
        if vs:
            # Sums in the order of G, GPU by GPU (plain additions, as the compiled core does them:
            # sum() of floats rounds differently from Python 3.12 on).
            U, fs, ns = vs[0]
            for v in vs[1:]:
                U += v[0]
                fs = [a + b for a, b in zip(fs, v[1])]
                ns = [a + b for a, b in zip(ns, v[2])]
        else:
            U, fs, ns = 0.0, t.group_zero, t.group_zero
        # A group needs as many fitting GPUs as the kind asks for (a CPU-only kind needs none: where
        # CPU or memory is short for it, the node's free GPUs are stranded from its point of view).
        fsv = tuple([f if n >= g else 0.0 for f, n, g in zip(fs, ns, t.group_gpus)])
        if len(t.capacity) >= _FCACHE_CAP:
            t.capacity.clear()
        gi = t.capacity[G] = (U, fsv if any(fsv) else None)
        return gi

    def _state_vec(self, s: int) -> tuple:
        """One GPU state's part of `_gvec`: (free, per kind group the free capacity it can use there,
        per group 1 if it fits). Per mix epoch, as the groups are."""
        st = self.fleet.states.states[s]
        free = st.free
        fv, cv = [], []
        for kd, _ in self.tables.groups:
            if not kd.gpus:
                fv.append(free)
                cv.append(0)
            elif kd.fits(st):
                fv.append(free)
                cv.append(1)
            else:
                fv.append(0.0)
                cv.append(0)
        v = self.tables.state_vectors[s] = (free, tuple(fv), tuple(cv))
        return v

    # --- evaluation -----------------------------------------------------------------------------

    def _evaluate(self, devs: tuple, cpu_free: int, mem_free: int, cpu_total: int, mem_total: int,
                  d: Demand, node_policy: str, gpu_policy: str, mask) -> tuple | None:
        """Score one node shape for `d`: ((score...), positions) or None when it does not fit.

        Positions index `devs` (the class's sorted device order). Lower scores are better.
        """
        if d.cpu > cpu_free or d.hostmem > mem_free:
            return None
        states = self.fleet.states.states
        k = d.gpus
        cpu_after = cpu_free - d.cpu
        mem_after = mem_free - d.hostmem
        if k:
            fits = d.fits
            fitting = [i for i, s in enumerate(devs) if fits(states[s]) and (mask is None or mask[i])]
            if len(fitting) < k:
                return None
            t = self.tables
            positions, after = self._choose_gpus(devs, fitting, d, gpu_policy, bisect_right(t.cpu_steps, cpu_after),
                                                 bisect_right(t.mem_steps, mem_after))
        else:
            positions, after = (), devs
        pol = POLICY[node_policy]
        if pol.scoring == "fragmentation":
            delta = self._frag(after, cpu_after, mem_after) - self._frag(devs, cpu_free, mem_free)
            left = 0.0
            for s in after:
                left += states[s].free
            # Ties (common: many nodes where the claim changes nothing a typical task could use)
            # go to the tighter fit: less GPU left, then less CPU left.
            score: tuple = (_tied(delta), left, cpu_after / (cpu_total or 1))
        elif pol.node_term is not None:
            assert pol.node_score is not None  # (a baseline policy has both: `policies`)
            score = pol.node_score(pol.node_term(states, devs, after, positions, d), cpu_free, mem_free,
                                   cpu_total or 1, mem_total or 1, d)
        else:  # random: feasibility only
            score = (0,)
        return (score, positions)

    def _choose_gpus(self, devs: tuple, fitting: list[int], d: Demand, gpu_policy: str,
                     bc: int, bm: int) -> tuple[tuple, tuple]:
        """GPU positions for the claim and the node's sorted GPU states after it; (bc, bm) are the
        CPU/memory buckets after the claim (used by the fragmentation-aware choice only)."""
        k = d.gpus
        states = self.fleet.states.states
        after_of = self.fleet.states.after
        if gpu_policy == FRAGMENTATION_AWARE and len({devs[i] for i in fitting}) > 1:
            cur = list(devs)
            avail = list(fitting)
            chosen = []
            for _ in range(k):
                best: Any = None
                seen = set()
                for i in avail:
                    s = cur[i]
                    if s in seen:
                        continue
                    seen.add(s)
                    st = states[s]
                    ns = after_of(s, d.mem_req(st.memory_mib), d.cores)
                    trial = cur.copy()
                    trial[i] = ns
                    G = tuple(sorted(trial))
                    # Not on raw floats or positions: G's sums run in the order of the states'
                    # ids, and ids follow the order states were first met in (which differs with
                    # the work done ahead): to 1e-9, then ties on the state itself.
                    key = (_q9(self._fragb(G, bc, bm)), states[ns].free, states[ns].canon)
                    if best is None or key < best[0]:
                        best = (key, i, ns)
                _, i, ns = best
                cur[i] = ns
                avail.remove(i)
                chosen.append(i)
            positions = tuple(chosen)
        else:
            gpu_key = POLICY[gpu_policy].gpu_key
            if gpu_key is None:  # (random: all fitting, sampled at placement time)
                positions = tuple(fitting)
            else:
                positions = tuple(sorted(fitting, key=gpu_key(states, devs, d))[:k])
            cur = list(devs)
            for i in positions[:k]:
                s = cur[i]
                cur[i] = after_of(s, d.mem_req(states[s].memory_mib), d.cores)
        return positions, tuple(sorted(cur))

    def _placement(self, node: Node, d: Demand, score: float, positions: tuple, gpu_policy: str) -> Placement:
        if gpu_policy == RANDOM and len(positions) > d.gpus:
            positions = tuple(self.rng.sample(positions, d.gpus))
        shares = []
        devices = node.devices
        order = node.order
        for pos in positions:
            dev = devices[order[pos]]
            shares.append(DeviceShare(uuid=dev.uuid, index=dev.index,
                                       memory_mib=d.mem_req(dev.memory_mib), cores=d.cores))
        shares.sort(key=lambda s: s.index)
        return Placement(node=node.name, shares=shares, score=float(score))

    def _place_random(self, d: Demand, ck: tuple, gpu_policy: str, explain: bool) -> Placement | Rejection:
        """A node drawn uniformly among those that fit: draw from all live nodes and redraw on a
        misfit (uniform over the feasible ones); scan the fleet only when draws keep missing."""
        fleet = self.fleet
        if self._roster[0] != fleet.roster_generation:
            self._roster = (fleet.roster_generation, [n for n in fleet.nodes.values() if not n.lost])
        nodes = self._roster[1]
        rng = self.rng
        for _ in range(64 if nodes else 0):
            n = nodes[rng.randrange(len(nodes))]
            assert n.cls is not None  # not lost: classified
            r = self._cached(n.cls, ck, d, RANDOM, gpu_policy)
            if r is not None:
                return self._placement(n, d, r[0][0], r[1], gpu_policy)
        # Near full most draws miss: pick from the per-shape index of feasible classes instead.
        heap = self.index.get(ck, d, RANDOM, gpu_policy)
        live = [e for e in heap if e[-2].alive]
        total = sum(len(e[-2].members) for e in live)
        if not total:
            return self._reject(d, ck, {}, None) if explain else UNEXPLAINED
        pick = rng.randrange(total)
        for e in live:
            cls = e[-2]
            if pick < len(cls.members):
                node = list(cls.members.values())[pick]
                return self._placement(node, d, e[0], e[-1], gpu_policy)
            pick -= len(cls.members)
        raise AssertionError("unreachable")

    def _place_paper(self, d: Demand, exclude: frozenset, explain: bool) -> Placement | Rejection:
        """The paper's FGD: the highest integer score, the first node by name among equal ones;
        GPUs by lowest index among the best (`paperfgd`)."""
        paper = self._paper
        if paper is None:
            typical = self.typical
            if typical is None:
                typical = TypicalPods([(_kind_demand(k), n) for k, n in self.mix.counts().items()])
            paper = self._paper = PaperFGD(typical, self.fleet.states)
        best = -1
        cands: list[tuple[Any, tuple]] = []  # (class or node, positions)
        if d.node is None and not d.use_uuids and not d.nouse_uuids and not exclude:
            for cls in self.fleet.classes.values():
                r = paper.score(cls.devs, cls.cpu_free, cls.mem_free, d)
                if r is None or r[0] < best:
                    continue
                if r[0] > best:
                    best = r[0]
                    cands = []
                cands.append((cls, r[1]))
        else:
            for n in self.fleet.nodes.values():
                if n.lost or n.name in exclude or (d.node is not None and n.name != d.node):
                    continue
                node_cls = n.cls
                assert node_cls is not None  # live nodes are classified
                r = paper.score(node_cls.devs, node_cls.cpu_free, node_cls.mem_free, d, self._mask(n, d))
                if r is None or r[0] < best:
                    continue
                if r[0] > best:
                    best = r[0]
                    cands = []
                cands.append((n, r[1]))
        if not cands:
            if not explain:
                return UNEXPLAINED
            if d.node is None and not d.use_uuids and not d.nouse_uuids and not exclude:
                return self._reject(d, None, {}, None)
            return self._place_each(d, FRAGMENTATION_AWARE, FRAGMENTATION_AWARE, exclude)
        if self.paper_ties == "random":  # (the Kubernetes scheduler's rule: see `paperfgd`)
            sizes = [len(w.members) if isinstance(w, NodeClass) else 1 for w, _ in cands]
            pick = self.rng.randrange(sum(sizes))
            for (where, positions), size in zip(cands, sizes):  # noqa: B007 (read after the break)
                if pick < size:
                    node = list(where.members.values())[pick] if isinstance(where, NodeClass) else where
                    break
                pick -= size
            order = node.order
            positions = tuple(sorted(positions, key=lambda p: order[p])[: d.gpus])
            return self._placement(node, d, float(best), positions, PAPER_FGD)
        # Among equal scores, the node first by name (see `paperfgd` on why not a random one).
        node = min((min(where.members.values(), key=_node_name) if isinstance(where, NodeClass) else where
                    for where, _ in cands), key=_node_name)
        positions = next(p for where, p in cands if where is node or where is node.cls)
        order = node.order
        positions = tuple(sorted(positions, key=lambda p: order[p])[: d.gpus])
        return self._placement(node, d, float(best), positions, PAPER_FGD)

    def _place_allowed(self, heap: list, d: Demand, exclude: frozenset, gpu_policy: str,
                       explain: bool) -> Placement | Rejection:
        """The shape's index, best first, down to the first class with a member not excluded: the
        choice the index makes with those nodes gone from the fleet, at the cost of the classes
        passed over (a walk of the heap in order, not a sort of it). A rejection explains the nodes
        not excluded and counts the others as ``excluded`` (the caller knows why they are out)."""
        if heap:
            todo = [(heap[0], 0)]
            while todo:
                e, i = heappop(todo)
                cls = e[-2]
                if cls.alive:
                    for name, node in cls.members.items():
                        if name not in exclude:
                            return self._placement(node, d, e[0], e[-1], gpu_policy)
                for j in (2 * i + 1, 2 * i + 2):
                    if j < len(heap):
                        heappush(todo, (heap[j], j))
        if not explain:
            return UNEXPLAINED
        live = [n for n in self.fleet.nodes.values() if not n.lost and n.name not in exclude]
        filtered = {"lost": len(self.fleet.lost)} if self.fleet.lost else {}
        out = len(self.fleet.nodes) - len(self.fleet.lost) - len(live)
        if out:
            filtered["excluded"] = out
        return self._reject(d, None, filtered, live)

    # --- the per-node path: pins, uuid selectors, excluded nodes --------------------------------

    def _mask(self, node: Node, d: Demand) -> list[bool] | None:
        if not d.use_uuids and not d.nouse_uuids:
            return None
        mask = []
        for pos in range(len(node.order)):
            mask.append(d.uuid_ok(node.devices[node.order[pos]].uuid))
        return mask

    def _place_each(self, d: Demand, node_policy: str, gpu_policy: str,
                    exclude: frozenset) -> Placement | Rejection:
        fleet = self.fleet
        filtered: dict[str, int] = {}
        if d.node is not None:
            n = fleet.nodes.get(d.node)
            others = len(fleet.nodes) - (n is not None)
            if others:
                filtered["node-pin"] = others
            candidates = [n] if n is not None else []
        else:
            candidates = list(fleet.nodes.values())
        live = []
        for n in candidates:
            if n.lost:
                filtered["lost"] = filtered.get("lost", 0) + 1
            elif n.name in exclude:
                filtered["excluded"] = filtered.get("excluded", 0) + 1
            else:
                live.append(n)
        best: Any = None
        bestnode: Node | None = None
        pol = FRAGMENTATION_AWARE if node_policy == RANDOM else node_policy
        for n in live:
            cls = n.cls
            assert cls is not None  # live nodes are classified
            r = self._evaluate(cls.devs, cls.cpu_free, cls.mem_free, cls.cpu_total, cls.mem_total, d,
                               pol, gpu_policy, self._mask(n, d))
            if r is None:
                continue
            if node_policy == RANDOM:
                r = ((self.rng.random(),), r[1])
            if best is None or r[0] < best[0]:
                best = r
                bestnode = n
        if best is None or bestnode is None:
            return self._reject(d, None, filtered, live)
        return self._placement(bestnode, d, best[0][0], best[1], gpu_policy)

    # --- a claim of several requests: all on one node, or none -----------------------------------

    def _place_together(self, claim_id: str, spec: ClaimSpec, exclude: frozenset) -> Placement | Rejection:
        """Place every request of ``spec`` on one node (a pod's GPU containers), or none of them.

        Node by node, the requests are placed one after another on the node's GPUs as each leaves
        them (two requests may share a GPU, as two containers may), by the claim's GPU policy; the
        node's score is the change the whole claim makes (the sum of each step's change in
        fragmentation; the baselines score the node as the last request leaves it). One
        `Placement` comes out, its shares named by request, so the ledger takes the claim in one
        compare-and-set: there is no half-placed claim to crash in."""
        if self._epoch != self.mix.version:
            self._mix_moved()
        parts = [(name, self.demand(part)) for name, part in request_specs(spec)]
        if self.learn and claim_id not in self._recent:
            self._recent.add(claim_id)
            self._recent_q.append(claim_id)
            if len(self._recent_q) > 8192:
                self._recent.discard(self._recent_q.popleft())
            for _, d in parts:
                self.mix.observe(d)
        node_policy = spec.node_policy or self.default_node_policy
        gpu_policy = spec.gpu_policy or self.default_gpu_policy
        scoring = FRAGMENTATION_AWARE if node_policy in (RANDOM, PAPER_FGD) else node_policy
        best: Any = None
        for n in self.fleet.nodes.values():
            if n.lost or n.name in exclude or (spec.node is not None and n.name != spec.node):
                continue
            r = self._together_on(n, parts, scoring, gpu_policy)
            if r is None:
                continue
            score = (self.rng.random(),) if node_policy == RANDOM else r[0]
            if best is None or score < best[0]:
                best = (score, n.name, r[1])
        if best is None:
            return self._reject_together(parts, scoring, gpu_policy, exclude)
        return Placement(node=best[1], shares=best[2], score=float(best[0][0]))

    def _together_on(self, n: Node, parts: list[tuple[str, Demand]], node_policy: str,
                     gpu_policy: str) -> tuple[tuple, list[DeviceShare]] | None:
        """(score, shares) of the requests placed one after another on node ``n``; None if one does not fit."""
        cls = n.cls
        assert cls is not None  # live nodes are classified
        after_of = self.fleet.states.after
        pairs = list(zip(cls.devs, n.order))  # (GPU state, its device in n.devices), sorted by state
        cpu, mem = cls.cpu_free, cls.mem_free
        delta = 0.0
        score: tuple = ()
        shares: list[DeviceShare] = []
        for name, d in parts:
            mask = None
            if d.use_uuids or d.nouse_uuids:
                mask = [d.uuid_ok(n.devices[i].uuid) for _, i in pairs]
            r = self._evaluate(tuple(s for s, _ in pairs), cpu, mem, cls.cpu_total, cls.mem_total, d, node_policy,
                               gpu_policy, mask)
            if r is None:
                return None
            score, positions = r
            if gpu_policy == RANDOM and len(positions) > d.gpus:
                positions = tuple(self.rng.sample(positions, d.gpus))
            chosen = []
            for p in positions[: d.gpus]:
                state, i = pairs[p]
                dev = n.devices[i]
                chosen.append(DeviceShare(uuid=dev.uuid, index=dev.index, memory_mib=d.mem_req(dev.memory_mib),
                                          cores=d.cores, request=name))
                pairs[p] = (after_of(state, chosen[-1].memory_mib, d.cores), i)
            shares += sorted(chosen, key=lambda s: s.index)
            pairs.sort()
            cpu -= d.cpu
            mem -= d.hostmem
            delta += score[0]
        if POLICY[node_policy].scoring == "fragmentation":
            score = (_tied(delta),) + score[1:]
        return score, shares

    def _reject_together(self, parts: list[tuple[str, Demand]], node_policy: str, gpu_policy: str,
                         exclude: frozenset) -> Rejection:
        """Why no node takes all the requests: the first request that fits nowhere even alone, with
        its own rejection; else that no node has room for all of them at once."""
        for name, d in parts:
            alone = self._place_each(d, node_policy, gpu_policy, exclude)
            if isinstance(alone, Rejection):
                return Rejection(reason=f"request {name!r}: {alone.reason}", filtered=alone.filtered)
        names = ", ".join(repr(name) for name, _ in parts)
        live = sum(1 for n in self.fleet.nodes.values() if not n.lost and n.name not in exclude)
        return Rejection(reason=f"no node has room for all {len(parts)} requests ({names}) at once, which must be "
                                f"placed together on one node; each fits somewhere alone",
                         filtered={"together": live})

    # --- rejection (`explain`) -------------------------------------------------------------------

    def _reject(self, d: Demand, ck: tuple | None, filtered: dict[str, int], nodes: list[Node] | None,
                exclude=frozenset()) -> Rejection:
        return self._explainer.reject(d, ck, filtered, nodes, exclude)
