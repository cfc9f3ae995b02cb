"""The placement policies by name: what each scores, and where each is offered.

One entry per policy, so that adding one is one place: the engine dispatches on an entry's
`scoring` and, for the baseline scorers, calls its functions; the service's setting, the packing
benchmark's columns and every "unknown policy" message read their lists from here.

A baseline scorer is written once, in two parts, because the engine remembers the GPU part of a
node's score (it depends on the GPU states alone) and adds the CPU/memory part per node class:

- `node_term(states, devs, after, positions, d)`: the GPU part, from the node's GPU states before
  (`devs`) and after (`after`) the claim and the chosen GPU positions;
- `node_score(term, cpu_free, mem_free, cpu_total, mem_total, d)`: the node's score tuple (lower is
  better) from that term and the node's CPU/memory before the claim (totals never 0);
- `gpu_key(states, devs, d)`: the sort key over fitting GPU positions (the first `d.gpus` are
  taken), or None where the GPUs are drawn at random when placing.

Fragmentation-aware and the paper's FGD have engines of their own (`engine`'s fragmentation maths,
`paperfgd`); their entries name that and carry the GPU key used where their own choice is not made.
The wire contract (`tessera.shared.events.Policy`) lists what a claim may ask for; it cannot import
this module (services never import each other), so tests/placement/test_policies.py keeps the two
in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .paperfgd import POLICY as PAPER_FGD

__all__ = ["Policy", "POLICY", "NAMES", "SERVICE_NAMES", "BENCH_COLUMNS", "FRAGMENTATION_AWARE",
           "RANDOM", "PAPER_FGD", "policy"]

FRAGMENTATION_AWARE = "fragmentation-aware"
RANDOM = "random"


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    # "baseline" (the functions below), "fragmentation" (the engine's fragmentation maths),
    # "random" (a uniformly random feasible node) or "paper" (`paperfgd`).
    scoring: str
    # Offered by the service (TESSERA_PLACEMENT_POLICY and a claim's policy), not only by benchmarks.
    service: bool
    # Column in the packing benchmark's tables: baselines first, ours last.
    column: int
    gpu_key: Callable | None = None
    node_term: Callable | None = None
    node_score: Callable | None = None


def _used(states, devs: tuple) -> float:
    """HAMi's node score: used/total over the node's GPUs, of shares, cores and memory."""
    if not devs:
        return 0.0
    sh = mx = cu = mu = mt = 0
    for s in devs:
        st = states[s]
        sh += st.shares
        mx += st.max_shares
        cu += st.cores_used
        mu += st.mem_used
        mt += st.memory_mib
    return sh / mx + cu / (100 * len(devs)) + mu / mt


def _used_term(states, devs, after, positions, d) -> float:
    return _used(states, devs)


def _left_term(states, devs, after, positions, d) -> float:
    """GPU capacity left after the claim, per GPU of the node."""
    left = 0.0
    for s in after:
        left += states[s].free
    return left / (len(devs) or 1)


def _alignment_term(states, devs, after, positions, d) -> float:
    """The GPU part of the dot product of the claim's demand with the node's free vector."""
    ng = len(devs) or 1
    u = 0.0
    for s in devs:
        u += states[s].free
    return sum(d.units(states[devs[i]]) for i in positions) / ng * (u / ng)


def _most_used(term, c, m, ct, mt, d) -> tuple:
    return (-term,)


def _least_used(term, c, m, ct, mt, d) -> tuple:
    return (term,)


def _least_left(term, c, m, ct, mt, d) -> tuple:
    return (term + (c - d.cpu) / ct + (m - d.hostmem) / mt,)


def _best_aligned(term, c, m, ct, mt, d) -> tuple:
    return (-(term + (d.cpu / ct) * (c / ct) + (d.hostmem / mt) * (m / mt)),)


def _gpu_most_used(states, devs, d):
    return lambda i: (-states[devs[i]].used_score, i)


def _gpu_least_used(states, devs, d):
    return lambda i: (states[devs[i]].used_score, i)


def _gpu_tightest(states, devs, d):
    return lambda i: (states[devs[i]].free - d.units(states[devs[i]]), i)


_ALL = (
    Policy("binpack", "baseline", True, 3, _gpu_most_used, _used_term, _most_used),
    Policy("spread", "baseline", True, 2, _gpu_least_used, _used_term, _least_used),
    # (its GPU key: where the candidate GPUs are all alike, the fragmentation choice is the tightest)
    Policy(FRAGMENTATION_AWARE, "fragmentation", True, 6, _gpu_tightest),
    Policy("best-fit", "baseline", True, 4, _gpu_tightest, _left_term, _least_left),
    Policy("dot-product", "baseline", False, 1, _gpu_tightest, _alignment_term, _best_aligned),
    Policy(RANDOM, "random", False, 0),
    Policy(PAPER_FGD, "paper", False, 5, _gpu_tightest),
)

POLICY: dict[str, Policy] = {p.name: p for p in _ALL}
NAMES = tuple(POLICY)
SERVICE_NAMES = tuple(p.name for p in _ALL if p.service)
BENCH_COLUMNS = tuple(p.name for p in sorted(_ALL, key=lambda p: p.column))


def policy(name: str) -> Policy:
    """The policy called `name`, or a ValueError naming the ones there are."""
    p = POLICY.get(name)
    if p is None:
        raise ValueError(f"unknown policy {name!r} (one of: {', '.join(NAMES)})")
    return p
