"""Packing and speed benchmarks of the placement engine, runnable on its own.

    python -m tessera.placement.benchmarks.packing placement --nodes FILE --pods FILE [--policy NAME|all]
                                                [--seeds 42-51] [--json OUT] [--jobs N]
    python -m tessera.placement.benchmarks.packing speed --nodes FILE --pods FILE [--sizes 1213,5000] [--json OUT]

`placement` follows the FGD paper's method (Weng et al., USENIX ATC'23, on the Alibaba openb trace):
per seed, sample tasks from the pod list with replacement until their GPU requests reach 130% of the
fleet's GPUs, shuffle, place one at a time through the engine the service runs, never release, skip
a task that does not fit. x is GPU requests arrived as % of capacity (failed tasks included), y the
GPU share allocated as % of capacity; the headline is the unallocated share 100 - y at x = 100.
The fragmentation-aware policy measures against the trace's task mix, fed to it as history before
the run (`--learn online` starts from the default mix and learns claim by claim instead).

`speed` times `Placer.place` alone on the openb fleet and on a fleet synthesised by replicating it,
each in a fresh process so that its peak RSS is the fleet's own.

This module is an entry point of its own: the CLI may not import the placement package (layering), so `tessera bench placement` execs `python -m tessera.placement.benchmarks.packing`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import resource
import statistics
import sys
import time
from typing import Callable, Iterator, TypeVar
from pathlib import Path

from tessera.shared.events import LedgerEntry

from . import dynamic, families
from ..engine import Placement, Placer
from ..fleet import Fleet
from ..mix import WorkloadMix
from ..paperfgd import POLICY as PAPER_FGD, TypicalPods
from ..policies import BENCH_COLUMNS, NAMES as POLICIES
from .trace import TraceError, TraceNode, TracePod, load_nodes, load_pods, node_inventory, pod_demand

BASELINES = BENCH_COLUMNS  # (baselines first, ours last: `policies`)

_nodes: list[TraceNode] = []
_pods: list[TracePod] = []


def _load(nodes_path: str, pods_path: str) -> None:
    global _nodes, _pods
    _nodes = load_nodes(nodes_path)
    _pods = load_pods(pods_path)


def sample_tasks(pods: list[TracePod], capacity: int, seed: int, upto: float = 1.3) -> list[TracePod]:
    rng = random.Random(seed)
    tasks = []
    total = 0.0
    while total < upto * capacity:
        p = rng.choice(pods)
        tasks.append(p)
        total += p.gpu_units
    rng.shuffle(tasks)
    return tasks


def build_fleet(nodes: list[TraceNode]) -> Fleet:
    fleet = Fleet()
    for n in nodes:
        fleet.upsert_node(node_inventory(n))
    return fleet


def cluster_fragmentation(placer: Placer) -> float:
    """Expected unusable free GPU capacity of the whole fleet under the placer's mix (GPU units)."""
    total = 0.0
    for cls in placer.fleet.classes.values():
        total += placer._frag(cls.devs, cls.cpu_free, cls.mem_free) * len(cls.members)
    return total


PAPER_TIES = "name"  # fgd-paper's tie rule (--fgd-paper-ties; set before the workers fork)


def simulate(policy: str, seed: int, learn: str = "history", fluid_memory: bool = False,
             pods: list[TracePod] | None = None) -> dict:
    """One run of the paper's method (on `pods`, by default the loaded list); the curve and timings."""
    nodes = _nodes
    pods = _pods if pods is None else pods
    capacity = sum(n.gpus for n in nodes)
    tasks = sample_tasks(pods, capacity, seed)
    fleet = build_fleet(nodes)
    mix = WorkloadMix()
    demands = {}
    for p in pods:
        demands[p] = pod_demand(p)
    if learn == "history":
        mix.observe_all(demands[p] for p in pods)
    # The paper's FGD measures against the pod list's task types (its target workload).
    typical = TypicalPods(demands[p] for p in pods) if policy == PAPER_FGD else None
    placer = Placer(fleet, policy, mix=mix, learn=False, seed=seed, fluid_memory=fluid_memory,
                    typical=typical, paper_ties=PAPER_TIES)
    arrived = allocated = 0.0
    curve = []
    next_pct = 1
    placed = failed = 0
    spent = 0.0
    clock = time.perf_counter
    for i, p in enumerate(tasks):
        d = demands[p]
        if learn == "online":
            mix.observe(d)
        t0 = clock()
        r = placer.place_demand(d, explain=False)
        spent += clock() - t0
        arrived += p.gpu_units
        if type(r) is Placement:
            fleet.commit(r.node, LedgerEntry(claim=f"t{i}", tenant="bench", shares=r.shares,
                                             cpu_millis=d.cpu, host_memory_mib=d.hostmem, ts=0.0))
            allocated += p.gpu_units
            placed += 1
        else:
            failed += 1
        while next_pct <= 130 and arrived * 100 >= next_pct * capacity - 1e-9:
            unalloc = capacity - allocated
            frag = cluster_fragmentation(placer)
            curve.append({"arrival_pct": next_pct, "allocated_pct": round(100 * allocated / capacity, 4),
                          "frag_rate_pct": round(100 * frag / unalloc, 4) if unalloc > 0 else 0.0})
            next_pct += 1
    at100 = next(c for c in curve if c["arrival_pct"] == 100)
    return {
        "policy": policy, "seed": seed, "tasks": len(tasks), "placed": placed, "failed": failed,
        "unallocated_pct_at_100": round(100 - at100["allocated_pct"], 4),
        "decisions_per_s": len(tasks) / spent if spent else 0.0, "curve": curve,
    }


def _job(args: tuple) -> dict:
    policy, seed, learn, fluid = args[:4]
    if len(args) == 4:
        return simulate(policy, seed, learn, fluid)
    family, level = args[4:]
    r = simulate(policy, seed, learn, fluid, pods=_variant(family, level))
    r["family"], r["level"] = family, level
    return r


_variants: dict[tuple, list[TracePod]] = {}


def _variant(family: str, level: int) -> list[TracePod]:
    """A family's pod list, made once per worker process."""
    key = (family, level)
    v = _variants.get(key)
    if v is None:
        v = _variants[key] = _pods if family == "default" else families.variant(_pods, _nodes, family, level)
    return v


T = TypeVar("T")


def _pool_map(job: Callable[[tuple], T], jobs: list[tuple], n_jobs: int) -> Iterator[T]:
    """`job` over `jobs` in `n_jobs` forked workers (in this process for one), results as they come."""
    if n_jobs == 1:
        yield from map(job, jobs)
        return
    pool = mp.get_context("fork").Pool(n_jobs)
    try:
        yield from pool.imap_unordered(job, jobs)
    finally:
        pool.close()
        pool.join()


def run_families(args: argparse.Namespace) -> int:
    """Ours and the paper's FGD side by side on each workload family and level (`families`)."""
    policies = [p.strip() for p in args.policy.split(",")]
    for p in policies:
        if p not in POLICIES:
            print(f"unknown policy {p!r} (one of: {', '.join(POLICIES)})", file=sys.stderr)
            return 2
    seeds = parse_seeds(args.seeds)
    rows: list[tuple[str, int]] = [("default", 0)]
    for fam in families.FAMILIES:
        rows += [(fam, lv) for lv in families.parse_levels(getattr(args, fam.replace("-", "_")), fam)]
    _load(args.nodes, args.pods)
    for fam, lv in rows:
        _variant(fam, lv)  # (made here once: the forked workers inherit them, and bad levels fail early)
    jobs = [(p, s, args.learn, args.fluid_memory, fam, lv) for fam, lv in rows for p in policies for s in seeds]
    jobs.sort(key=lambda j: j[0] != PAPER_FGD)  # the slowest first, so the pool drains evenly
    t0 = time.perf_counter()
    got: dict[tuple, list[float]] = {}
    n_jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(jobs)))
    for k, r in enumerate(_pool_map(_job, jobs, n_jobs), 1):
        got.setdefault((r["family"], r["level"], r["policy"]), []).append(r["unallocated_pct_at_100"])
        _seed_of.setdefault((r["family"], r["level"], r["policy"]), {})[r["seed"]] = r["unallocated_pct_at_100"]
        print(f"[{k}/{len(jobs)} {time.perf_counter() - t0:6.1f}s] {r['family']} {r['level']} {r['policy']} "
              f"seed {r['seed']}: {r['unallocated_pct_at_100']:.2f}%", file=sys.stderr, flush=True)
    capacity = sum(n.gpus for n in _nodes)
    ours, base = policies[0], policies[-1]
    lines = [f"Workload families (FGD paper's method): {len(_nodes):,} nodes, {capacity:,} GPUs, seeds "
             f"{args.seeds}; unallocated GPU % at 100% arrival, mean ± std over seeds "
             f"({time.perf_counter() - t0:.0f}s)", "",
             "| family | level | pods | " + " | ".join(policies) + f" | {ours} − {base} | ahead on seeds |",
             "|---|---|---|" + "---|" * len(policies) + "---|---|"]
    out: dict = {"seeds": seeds, "policies": policies, "rows": []}
    for fam, lv in rows:
        cells = []
        per = {}
        for p in policies:
            xs = got[(fam, lv, p)]
            per[p] = xs
            cells.append(f"{statistics.mean(xs):.2f} ± {statistics.pstdev(xs) if len(xs) > 1 else 0.0:.2f}")
        # (results arrive out of order: compare seed by seed on sorted keys)
        diff = statistics.mean(per[ours]) - statistics.mean(per[base])
        by_seed = _per_seed(got, fam, lv, ours, base)
        level = "trace as given" if fam == "default" else families.describe(fam, lv)
        lines.append(f"| {fam} | {level} | {len(_variant(fam, lv)):,} | " + " | ".join(cells)
                     + f" | {diff:+.2f} | {by_seed} |")
        out["rows"].append({"family": fam, "level": lv, "pods": len(_variant(fam, lv)),
                            **{p: {"mean": round(statistics.mean(per[p]), 4),
                                   "std": round(statistics.pstdev(per[p]) if len(per[p]) > 1 else 0.0, 4)}
                               for p in policies}})
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(_families_doc(args, text))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


_seed_of: dict[tuple, dict[int, float]] = {}  # (family, level, policy) -> seed -> unallocated %


def _per_seed(got: dict, fam: str, lv: int, ours: str, base: str) -> str:
    a = _seed_of.get((fam, lv, ours))
    b = _seed_of.get((fam, lv, base))
    if a is None or b is None:
        return "–"
    wins = sum(1 for s in a if s in b and a[s] < b[s])
    return f"{wins}/{len(a)}"


def _families_doc(args: argparse.Namespace, table: str) -> str:
    return f"""# Placement on workload families: ours against the FGD paper's algorithm

Generated by `tessera bench placement --families` (`make bench` rewrites this file). Command:

    python -m tessera.placement.benchmarks.packing placement --families --seeds {args.seeds} --policy {args.policy} \\
        --cpu-only {args.cpu_only} --gpu-share {args.gpu_share} --gpu-spec {args.gpu_spec} --multi-gpu {args.multi_gpu}

Method: the FGD paper's (bench/placement_sim.md): per seed, tasks sampled from the family's pod list
to 130% of the fleet's GPUs, placed one at a time, never released; the figure is the unallocated GPU
share at 100% arrival (lower is better). Both policies measure against the family's own task mix.

- `fragmentation-aware` is ours (`tessera.placement.engine`, the service's default).
- `fgd-paper` is the paper's algorithm as published (`tessera.placement.paperfgd`): typical task
  types to 95% popularity (CPU-only included, host memory not a dimension), the node's fragmentation
  as the popularity-weighted unusable GPU capacity, score = int(100 x sigmoid(decrease in GPUs)),
  the best GPU for a share, the lowest-indexed free GPUs otherwise; the same filters as ours. On the
  default trace it should land within ±0.3 of the published 4.77 (the first row).
- Families (`tessera.placement.families`, generator seed 233), made from the default list the way
  the paper made its variants: `cpu-only` adds CPU-only pods sampled from the list's own to the
  given count (the list has 1,088); `gpu-share` turns whole-GPU pods into sharing pods sampled from
  the list's own until the given share of GPU pods shares a GPU (the list: 44%); `gpu-spec`
  constrains the given share of GPU pods to one GPU model, drawn by the fleet's GPUs per model;
  `multi-gpu` adds 2/4/8-GPU pods sampled from the list's own to the given count (the list has 75).
- "ahead on seeds": the seeds on which ours left less unallocated than fgd-paper.

{table}
"""


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-", 1)
            seeds.extend(range(int(a), int(b) + 1))
        elif part:
            seeds.append(int(part))
    if not seeds:
        raise ValueError(f"no seeds in {text!r}")
    return seeds


def parse_policies(text: str) -> list[str] | None:
    """``all`` or a comma list of known policies; None (said on stderr) when one is unknown."""
    policies = list(BASELINES) if text == "all" else [p.strip() for p in text.split(",")]
    for p in policies:
        if p not in POLICIES:
            print(f"unknown policy {p!r} (one of: {', '.join(POLICIES)}, all)", file=sys.stderr)
            return None
    return policies


def run_placement(args: argparse.Namespace) -> int:
    policies = parse_policies(args.policy)
    if policies is None:
        return 2
    seeds = parse_seeds(args.seeds)
    _load(args.nodes, args.pods)
    # The fragmentation-aware runs are the slowest: start them first so the pool drains evenly.
    jobs = [(p, s, args.learn, args.fluid_memory) for p in sorted(policies, key=lambda p: p != "fragmentation-aware")
            for s in seeds]
    t0 = time.perf_counter()
    results: dict[str, list[dict]] = {p: [] for p in policies}
    n_jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(jobs)))
    for k, r in enumerate(_pool_map(_job, jobs, n_jobs), 1):
        results[r["policy"]].append(r)
        print(f"[{k}/{len(jobs)} {time.perf_counter() - t0:6.1f}s] {r['policy']:<20} seed {r['seed']}: "
              f"unallocated {r['unallocated_pct_at_100']:.2f}% at 100% arrival, "
              f"{r['decisions_per_s']:,.0f} decisions/s", file=sys.stderr, flush=True)
    capacity = sum(n.gpus for n in _nodes)
    out = {"nodes": args.nodes, "pods": args.pods, "node_count": len(_nodes), "gpus": capacity,
           "seeds": seeds, "learn": args.learn, "policies": {}}
    rows = []
    for p in policies:
        rs = sorted(results[p], key=lambda r: r["seed"])
        un = [r["unallocated_pct_at_100"] for r in rs]
        dps = statistics.mean(r["decisions_per_s"] for r in rs)
        curve = []
        for j in range(len(rs[0]["curve"])):
            pts = [r["curve"][j] for r in rs]
            curve.append({"arrival_pct": pts[0]["arrival_pct"],
                          "allocated_pct": round(statistics.mean(c["allocated_pct"] for c in pts), 4),
                          "frag_rate_pct": round(statistics.mean(c["frag_rate_pct"] for c in pts), 4)})
        out["policies"][p] = {
            "unallocated_pct_at_100": round(statistics.mean(un), 4),
            "unallocated_pct_at_100_std": round(statistics.pstdev(un), 4) if len(un) > 1 else 0.0,
            "per_seed": {str(r["seed"]): r["unallocated_pct_at_100"] for r in rs},
            "decisions_per_s": round(dps, 1),
            "curve": curve,
        }
        rows.append((p, statistics.mean(un), statistics.pstdev(un) if len(un) > 1 else 0.0, dps))
    print(f"openb packing, FGD method: {len(_nodes):,} nodes, {capacity:,} GPUs, seeds {args.seeds}, "
          f"{time.perf_counter() - t0:.0f}s")
    print(f"{'policy':<22}{'unallocated % at 100% arrival':>32}{'decisions/s':>14}")
    for p, m, s, dps in rows:
        print(f"{p:<22}{m:>24.2f} ± {s:<5.2f}{dps:>14,.0f}")
    print("published (FGD paper, same trace): Random 13.70, DotProduct 9.38, GpuPacking 8.22, "
          "BestFit 7.14, FGD 4.77")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


# --- dynamic ------------------------------------------------------------------------------------


def _dyn_job(args: tuple) -> dynamic.ReplayResult:
    policy, load, seed, high, preemption = args
    return dynamic.replay(_nodes, _pods, policy, load, seed, fleet_of=build_fleet, high=high, preemption=preemption,
                          frag_of=cluster_fragmentation if high else None)


def run_dynamic(args: argparse.Namespace) -> int:
    """Every policy on the trace replayed with arrivals and departures (`dynamic`)."""
    policies = parse_policies(args.policy)
    if policies is None:
        return 2
    try:
        loads = [float(x) for x in args.load.split(",") if x.strip()]
    except ValueError:
        print(f"--load takes numbers separated by commas (offered load x the fleet's GPUs), got {args.load!r}",
              file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.preemption.split(",") if m.strip()]
    if not modes or set(modes) - {"off", "on"} or not 0 <= args.high <= 1:
        print(f"--preemption takes off, on or off,on and --high a share from 0 to 1, got {args.preemption!r} and "
              f"{args.high!r}", file=sys.stderr)
        return 2
    if args.high:
        return _run_priority_mix(args, policies, loads, [m == "on" for m in modes])
    _load(args.nodes, args.pods)
    jobs = [(p, lv, args.seed, 0.0, False) for lv in loads for p in sorted(policies, key=lambda p: p != PAPER_FGD)]
    t0 = time.perf_counter()
    n_jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(jobs)))
    got = {}
    for r in _pool_map(_dyn_job, jobs, n_jobs):
        got[(r.policy, r.load)] = r
        print(f"[{len(got)}/{len(jobs)} {time.perf_counter() - t0:6.1f}s] {r.policy} load {r.load:g}: "
              f"served {r.served_pct:.2f}%", file=sys.stderr, flush=True)
    capacity = sum(n.gpus for n in _nodes)
    arrivals = next(iter(got.values())).pods
    lines = [f"Dynamic replay: {len(_nodes):,} nodes, {capacity:,} GPUs, {arrivals:,} pod arrivals ({dynamic.PASSES} "
             f"passes over the list's window), at their creation times compressed to the offered load, leaving "
             f"after their lifetimes; waiting pods retried on every departure; the first pass not measured "
             f"({time.perf_counter() - t0:.0f}s)", "",
             "| load | policy | GPU allocated % (time mean) | at 10%, 20% … 100% of the measured time | demand served % "
             "| wait p50 | wait p99 | waited | never ran |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lv in loads:
        for p in policies:
            r = got[(p, lv)]
            lines.append(f"| {lv:g} | {p} | {r.alloc_mean:.2f} | {' '.join(f'{x:.0f}' for x in r.alloc_series)} "
                         f"| {r.served_pct:.2f} | {r.wait_p50:.3f} | {r.wait_p99:.3f} | {r.waited:,} "
                         f"| {r.never_ran:,} |")
    lines.append("")
    lines.append("(waits in median pod lifetimes; waited = pods that ran after waiting)")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps([vars(r) for r in got.values()], indent=1))
    return 0


def _run_priority_mix(args: argparse.Namespace, policies: list[str], loads: list[float], modes: list[bool]) -> int:
    """`dynamic --high SHARE`: the replay with a priority mix, each policy with and without preemption."""
    _load(args.nodes, args.pods)
    jobs = [(p, lv, args.seed, args.high, m) for lv in loads for m in modes
            for p in sorted(policies, key=lambda p: p != PAPER_FGD)]
    t0 = time.perf_counter()
    got = {}
    for r in _pool_map(_dyn_job, jobs, max(1, min(args.jobs or os.cpu_count() or 1, len(jobs)))):
        got[(r.policy, r.load, r.preemption)] = r
        print(f"[{len(got)}/{len(jobs)} {time.perf_counter() - t0:6.1f}s] {r.policy} load {r.load:g} preemption "
              f"{'on' if r.preemption else 'off'}: served {r.served_pct:.2f}%", file=sys.stderr, flush=True)
    lines = [f"Dynamic replay with {100 * args.high:g}% of arrivals at priority {dynamic.HIGH} (the rest 0, drawn with "
             f"seed {args.seed}): {len(_nodes):,} nodes, {sum(n.gpus for n in _nodes):,} GPUs, "
             f"{next(iter(got.values())).pods:,} pod arrivals ({time.perf_counter() - t0:.0f}s)", "",
             "| load | policy | preemption | high wait p50 | high wait p99 | high never ran | all wait p99 "
             "| preemptions / 1,000 claims | work lost, GPU-s (% of allocated) | GPU allocated % | demand served % "
             "| fragmentation % of free | never ran |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in loads:
        for p in policies:
            for m in modes:
                r = got[(p, lv, m)]
                lines.append(f"| {lv:g} | {p} | {'on' if m else 'off'} | {r.high_wait_p50:.3f} | {r.high_wait_p99:.3f} "
                             f"| {r.high_never_ran:,} | {r.wait_p99:.3f} | {r.preemptions_per_1000:.2f} "
                             f"| {r.lost_gpu_seconds:,.0f} ({r.lost_pct:.2f}) | {r.alloc_mean:.2f} | {r.served_pct:.2f} "
                             f"| {r.frag_pct:.2f} | {r.never_ran:,} |")
    lines += ["", "(waits in median pod lifetimes, counted at a pod's first start; work lost: the GPU-seconds of "
              "trace time the victims had run)"]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps([vars(r) for r in got.values()], indent=1))
    return 0


# --- speed ---------------------------------------------------------------------------------------


def synth_nodes(nodes: list[TraceNode], size: int) -> list[TraceNode]:
    """A fleet of `size` nodes with the openb mix of shapes: the list replicated, names suffixed."""
    out = []
    for i in range(size):
        n = nodes[i % len(nodes)]
        rep = i // len(nodes)
        out.append(TraceNode(f"{n.name}-r{rep}" if rep else n.name, n.cpu_milli, n.memory_mib, n.gpus,
                             n.model))
    return out


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _speed_one(nodes_path: str, pods_path: str, size: int, policy: str, seed: int, q,
               fluid_memory: bool = False) -> None:
    try:
        base_rss = _rss_mib()
        _load(nodes_path, pods_path)
        nodes = synth_nodes(_nodes, size)
        capacity = sum(n.gpus for n in nodes)
        tasks = sample_tasks(_pods, capacity, seed)
        fleet = build_fleet(nodes)
        mix = WorkloadMix()
        mix.observe_all(pod_demand(p) for p in _pods)
        placer = Placer(fleet, policy, mix=mix, learn=False, seed=seed, fluid_memory=fluid_memory)
        demands = {p: pod_demand(p) for p in _pods}
        lat: list[float] = []
        phase_at: list[int] = []
        arrived = 0.0
        clock = time.perf_counter
        for i, p in enumerate(tasks):
            d = demands[p]
            t0 = clock()
            r = placer.place_demand(d)
            lat.append(clock() - t0)
            arrived += p.gpu_units
            if not phase_at and arrived >= capacity:
                phase_at.append(i + 1)
            if type(r) is Placement:
                fleet.commit(r.node, LedgerEntry(claim=f"t{i}", tenant="bench", shares=r.shares,
                                                 cpu_millis=d.cpu, host_memory_mib=d.hostmem, ts=0.0))
        fill = lat[: phase_at[0] if phase_at else len(lat)]
        over = lat[len(fill):]

        def stats(xs: list[float]) -> dict:
            if not xs:
                return {}
            s = sorted(xs)
            return {"decisions": len(xs), "decisions_per_s": round(len(xs) / sum(xs), 1),
                    "mean_us": round(1e6 * sum(xs) / len(xs), 1),
                    "p50_us": round(1e6 * s[len(s) // 2], 1), "p99_us": round(1e6 * s[int(len(s) * 0.99)], 1)}

        q.put({"nodes": size, "policy": policy, "fill_to_100": stats(fill), "overload_100_to_130": stats(over),
               "all": stats(lat), "classes_at_end": len(fleet.classes),
               "device_states": len(fleet.states), "rss_mib_peak": round(_rss_mib(), 1),
               "rss_mib_interpreter": round(base_rss, 1)})
    except BaseException as e:  # report, don't hang the parent
        q.put({"nodes": size, "error": repr(e)})


def run_speed(args: argparse.Namespace) -> int:
    ctx = mp.get_context("spawn")
    results = []
    for size in [int(s) for s in args.sizes.split(",")]:
        q = ctx.Queue()
        proc = ctx.Process(target=_speed_one, args=(args.nodes, args.pods, size, args.policy, args.seed, q,
                                                         args.fluid_memory))
        proc.start()
        r = q.get()
        proc.join()
        if "error" in r:
            print(f"speed at {size} nodes failed: {r['error']}", file=sys.stderr)
            return 1
        print(f"[{size} nodes done]", file=sys.stderr, flush=True)
        results.append(r)
    print(f"place() speed, policy {args.policy}, openb task mix (seed {args.seed}), one process per fleet")
    print(f"{'nodes':>6} {'phase':<22}{'decisions/s':>12}{'mean µs':>10}{'p50 µs':>9}{'p99 µs':>9}"
          f"{'peak RSS MiB':>14}")
    for r in results:
        for phase in ("fill_to_100", "overload_100_to_130"):
            s = r[phase]
            if s:
                print(f"{r['nodes']:>6} {phase:<22}{s['decisions_per_s']:>12,.0f}{s['mean_us']:>10.0f}"
                      f"{s['p50_us']:>9.0f}{s['p99_us']:>9.0f}{r['rss_mib_peak']:>14.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tessera.placement.benchmarks.packing",
                                 description="Placement packing and speed benchmarks (FGD method, openb trace)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("placement", help="packing quality, the FGD paper's method")
    pl.add_argument("--nodes", required=True)
    pl.add_argument("--pods", required=True)
    pl.add_argument("--policy", default=None, help="a policy, a comma list, or all (default all; with "
                    "--families: fragmentation-aware,fgd-paper, ours first)")
    pl.add_argument("--seeds", default="42-51")
    pl.add_argument("--json")
    pl.add_argument("--jobs", type=int, default=0, help="worker processes (default: CPU count)")
    pl.add_argument("--learn", choices=("history", "online"), default="history")
    pl.add_argument("--families", action="store_true",
                    help="ours and the FGD paper's algorithm side by side on workload families made from "
                         "the pod list (default --policy fragmentation-aware,fgd-paper)")
    for fam in families.FAMILIES:
        pl.add_argument(f"--{fam}", default=",".join(map(str, families.DEFAULT_LEVELS[fam])),
                        help=f"--families: levels of the {fam} family (default %(default)s)")
    pl.add_argument("--md", help="--families: write the table as markdown here")
    pl.add_argument("--fgd-paper-ties", choices=("name", "random"), default="name",
                    help="fgd-paper among equal scores: the first node by name (default: reproduces the "
                         "published figures) or a random one (the Kubernetes scheduler's rule)")
    pl.add_argument("--fluid-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="fragmentation-aware: count host memory's gradual stranding of GPUs, as the "
                         "placement service does by default (--no-fluid-memory: the faster model)")
    dy = sub.add_parser("dynamic", help="the trace replayed with arrivals, departures and retries")
    dy.add_argument("--nodes", required=True)
    dy.add_argument("--pods", required=True)
    dy.add_argument("--policy", default="all", help="a policy, a comma list, or all")
    dy.add_argument("--load", default="0.8,1.1", help="offered loads, x the fleet's GPUs (default %(default)s)")
    dy.add_argument("--seed", type=int, default=42)
    dy.add_argument("--high", type=float, default=0.0,
                    help="a priority mix: this share of the arrivals (0-1) has a high priority (default none)")
    dy.add_argument("--preemption", default="off,on",
                    help="with --high: off, on, or off,on (each policy both ways; default %(default)s)")
    dy.add_argument("--jobs", type=int, default=0, help="worker processes (default: CPU count)")
    dy.add_argument("--json")
    sp = sub.add_parser("speed", help="place() decisions/s and RSS at fleet sizes")
    sp.add_argument("--nodes", required=True)
    sp.add_argument("--pods", required=True)
    sp.add_argument("--sizes", default="1213,5000")
    sp.add_argument("--policy", default="fragmentation-aware")
    sp.add_argument("--seed", type=int, default=42)
    sp.add_argument("--json")
    sp.add_argument("--fluid-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="as for placement (the service's default is on)")
    args = ap.parse_args(argv)
    try:
        global PAPER_TIES
        PAPER_TIES = getattr(args, "fgd_paper_ties", "name")
        if args.cmd == "placement" and args.families:
            args.policy = args.policy or f"fragmentation-aware,{PAPER_FGD}"
            return run_families(args)
        if args.cmd == "placement":
            args.policy = args.policy or "all"
            return run_placement(args)
        if args.cmd == "dynamic":
            return run_dynamic(args)
        return run_speed(args)
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
