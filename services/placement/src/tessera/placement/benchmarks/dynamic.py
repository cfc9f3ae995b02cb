"""The dynamic placement benchmark: the trace replayed with pods that arrive and leave.

The FGD paper's method (packing.py) only ever adds tasks. Here each pod of the list arrives at its own
creation time and, once placed, runs for its own lifetime (deletion - creation) and leaves. A pod
that does not fit waits; whenever pods leave, every waiting pod is retried in arrival order, as the
placement service retries its unschedulable claims on every change (a shape that failed in a pass
is not tried again in that pass: capacity only shrinks within it, so it would fail again).

The openb list is a sample of a larger cluster's pods over ~150 days: replayed as it is, its peak
demand is about 1% of the fleet, and 95% of its pods arrive in the last fifth of the span. So the
replay takes the window from the 5% quantile of arrivals on, compresses its arrival times by the
factor that offers `load` times the fleet's GPUs (`compression`: the GPUs all pods would hold if
each ran on arrival, time mean over the measured passes), keeps the lifetimes, and runs the window `PASSES` times back to back (one pass
of the list asks for about the fleet's GPUs in all: without repeating it, nothing would need to
wait). The first pass fills the fleet and is not measured. Pods still waiting at the end never ran.

Reported per policy: the GPU allocation ratio over time (at tenths of the measured time, and its
time mean), the share of time-weighted GPU demand served (integral of allocated GPUs over the integral
of allocated + waiting GPUs), waiting time p50/p99 of the pods that ran (in units of the median pod
lifetime, as the absolute times depend on the compression), and how many pods never ran.

With a priority mix (`high`: that share of the arrivals, drawn with the seed, has priority `HIGH`,
the rest 0) the high pods' waits are reported apart; with `preemption` a high pod that fits nowhere
(on arrival or on a retry) takes the place of low ones as the placement service does: on each node
the victims `tessera.placement.preemption.choose_victims` chooses (the service's rule and order), the
node whose victims come first in that order, then the node name. Beyond the service (which does not
preempt for a claim asking host CPU or memory, and every trace pod does): the node must also have
the pod's CPU and host memory once its victims are gone. A victim goes back to waiting (its pod
recreated, as a Job's would be) and starts its lifetime over; the GPU-seconds it had run are the
work lost. A pod's wait is counted at its first start. Fragmentation: the fleet's expected unusable
free GPUs under the trace's mix (`frag_of`, the packing benchmark's measure), as a share of the
unallocated GPUs, time mean over the tenths of the measured time.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable
from dataclasses import dataclass

from tessera.shared.events import GpuDevice, LedgerEntry

from ..engine import Placement, Placer
from ..fleet import Fleet
from ..mix import WorkloadMix
from ..paperfgd import POLICY as PAPER_FGD, TypicalPods
from ..preemption import Need, Victims, choose_victims
from .trace import TraceNode, TracePod, pod_demand

__all__ = ["replay", "compression", "window", "ReplayResult"]

WINDOW_SKIP = 0.05  # the sparse start of the trace: its first 79% of time holds 5% of the pods
PASSES = 3  # passes over the window; the first fills the fleet and is not measured
HIGH = 100  # the priority of the high share of a priority mix (the others have 0)


@dataclass
class ReplayResult:
    policy: str
    load: float
    alloc_series: list[float]  # allocated % of GPUs at 10%, 20%, ... 100% of the horizon
    alloc_mean: float  # time-mean allocated % of GPUs
    served_pct: float  # time-weighted GPU demand served, %
    wait_p50: float  # in median lifetimes
    wait_p99: float
    waited: int  # pods that ran after waiting
    never_ran: int
    pods: int
    retries: int
    high: float = 0.0  # the share of arrivals with priority HIGH
    preemption: bool = False
    high_wait_p50: float = 0.0  # the high pods' waits, in median lifetimes
    high_wait_p99: float = 0.0
    high_never_ran: int = 0
    preemptions_per_1000: float = 0.0  # victims per 1,000 measured arrivals
    lost_gpu_seconds: float = 0.0  # GPU-seconds (trace time) the victims had run, measured time
    lost_pct: float = 0.0  # the same, % of the GPU-seconds allocated in the measured time
    frag_pct: float = 0.0  # expected unusable free GPUs, % of unallocated (time mean at tenths)


def _timed(pods: list[TracePod]) -> list[TracePod]:
    timed = [p for p in pods if p.creation_time is not None and p.deletion_time is not None]
    if not timed:
        raise ValueError("the pod list has no creation_time/deletion_time columns: the dynamic replay "
                         "needs them (the openb lists have them)")
    return timed


def _born(p: TracePod) -> int:
    """A timed pod's creation time (the replay sees only pods `_timed` kept: both times set)."""
    assert p.creation_time is not None
    return p.creation_time


def _lifetime(p: TracePod) -> int:
    """A timed pod's lifetime in trace seconds, at least 1."""
    assert p.creation_time is not None and p.deletion_time is not None
    return max(1, p.deletion_time - p.creation_time)


def window(pods: list[TracePod], skip: float = WINDOW_SKIP) -> tuple[list[TracePod], int, int]:
    """The pods of the replayed window (arrival order), its start and its length in trace seconds."""
    timed = sorted(_timed(pods), key=lambda p: (p.creation_time, p.name))
    start = _born(timed[int(skip * len(timed))])
    kept = [p for p in timed if _born(p) >= start]
    length = _born(kept[-1]) - start
    if length <= 0:
        raise ValueError("the pod list's arrivals all fall at one instant: nothing to replay")
    return kept, start, length


def compression(pods: list[TracePod], capacity: int, load: float) -> float:
    """The factor dividing arrival times that makes the offered demand `load` x `capacity`: the
    time mean, over the measured passes, of the GPUs every pod would hold if it ran on arrival for
    its lifetime. Found by bisection (more compression, more pods alive at once)."""
    kept, t0, length = window(pods)
    work = [(p.gpu_units, _born(p) - t0, _lifetime(p)) for p in kept]

    def offered(k: float) -> float:
        period = length / k
        lo, hi = period, PASSES * period
        total = 0.0
        for r in range(PASSES):
            for g, a, life in work:
                t = a / k + r * period
                total += g * max(0.0, min(hi, t + life) - max(lo, t))
        return total / (hi - lo)

    target = load * capacity
    lo, hi = 1e-3, 1e9
    if offered(hi) < target:
        raise ValueError(f"--load {load:g} cannot be offered: with every pod alive at once the replay "
                         f"asks for {offered(hi) / capacity:.2f} x the fleet's GPUs")
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        if offered(mid) < target:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.001:
            break
    return hi


def _quantile(values: list[float], x: float) -> float:
    return values[min(len(values) - 1, int(x * len(values)))] if values else 0.0


def _may_free(need: Need, devices: list[GpuDevice], entries: Iterable[LedgerEntry], priority: int) -> bool:
    """Whether releasing every claim of lower priority could make room on enough of ``devices``
    (a quick necessary condition, before the victim search proper)."""
    memory = {x.index: 0 for x in devices}
    cores = dict(memory)
    shares = dict(memory)
    for e in entries:
        if e.preemptible and e.priority < priority:
            continue
        for s in e.shares:
            if s.index in memory:
                memory[s.index] += s.memory_mib
                cores[s.index] += s.cores
                shares[s.index] += 1
    free = 0
    for x in devices:
        want = x.memory_mib if need.memory_mib is None else need.memory_mib
        if x.memory_mib - memory[x.index] >= want and 100 - cores[x.index] >= need.cores \
                and shares[x.index] < x.max_shares and not (need.cores >= 100 and shares[x.index]) \
                and cores[x.index] < 100:
            free += 1
    return free >= need.gpus


def replay(nodes: list[TraceNode], pods: list[TracePod], policy: str, load: float, seed: int = 42,
           fleet_of=None, high: float = 0.0, preemption: bool = False, frag_of=None) -> ReplayResult:
    timed, t0, length = window(pods)
    capacity = sum(n.gpus for n in nodes)
    k = compression(timed, capacity, load)
    fleet: Fleet = fleet_of(nodes)
    demands = {p: pod_demand(p) for p in timed}
    mix = WorkloadMix()
    mix.observe_all(demands[p] for p in timed)
    typical = TypicalPods(demands[p] for p in timed) if policy == PAPER_FGD else None
    placer = Placer(fleet, policy, mix=mix, learn=False, seed=seed, fluid_memory=True, typical=typical)
    lives = sorted(_lifetime(p) for p in timed)
    unit = float(lives[len(lives) // 2])
    n = len(timed)
    period = length / k
    arrivals = [((_born(p) - t0) / k + r * period, r * n + i, p)
                for r in range(PASSES) for i, p in enumerate(timed)]
    arrivals.sort(key=lambda a: a[:2])
    draw = random.Random(seed)
    priority = {a[1]: HIGH if draw.random() < high else 0 for a in arrivals}
    horizon = PASSES * period
    warm = period  # metrics from the second pass on
    departures: list[tuple[float, int, str]] = []  # (time, pod index, node)
    waiting: dict[int, tuple[float, TracePod]] = {}  # pod index -> (arrival, pod), arrival order
    allocated = waiting_gpu = 0.0
    area_alloc = area_demand = 0.0
    last = 0.0
    marks = [warm + (horizon - warm) * j / 10 for j in range(1, 10)] + [horizon]
    series: list[float] = []
    frags: list[float] = []
    waits: list[float] = []
    high_waits: list[float] = []
    retries = 0
    running: dict[int, tuple[float, float, str]] = {}  # pod index -> (started, leaves, node)
    victims = measured_arrivals = 0
    lost = 0.0

    def advance(t: float) -> None:
        nonlocal last, area_alloc, area_demand
        t = min(t, horizon)
        if t <= warm:
            last = t
            return
        last = max(last, warm)
        while marks and marks[0] <= t:
            m = marks.pop(0)
            area_alloc += allocated * (m - last)
            area_demand += (allocated + waiting_gpu) * (m - last)
            last = m
            series.append(100 * allocated / capacity)
            if frag_of is not None and capacity > allocated:
                frags.append(100 * frag_of(placer) / (capacity - allocated))
        if t > last:
            area_alloc += allocated * (t - last)
            area_demand += (allocated + waiting_gpu) * (t - last)
            last = t

    def start(i: int, p: TracePod, now: float) -> bool:
        nonlocal allocated
        d = demands[p]
        r = placer.place_demand(d, explain=False)
        if type(r) is not Placement:
            return False
        fleet.commit(r.node, LedgerEntry(claim=f"p{i}", tenant="bench", shares=r.shares, cpu_millis=d.cpu,
                                         host_memory_mib=d.hostmem, ts=now, priority=priority[i]))
        allocated += p.gpu_units
        running[i] = (now, now + _lifetime(p), r.node)
        heapq.heappush(departures, (now + _lifetime(p), i, r.node))
        return True

    def waited(i: int, t_arr: float, now: float) -> None:
        if t_arr >= warm:
            waits.append((now - t_arr) / unit)
            if priority[i] == HIGH:
                high_waits.append((now - t_arr) / unit)

    gpus: dict[str, list[GpuDevice]] = {}

    def gpus_of(name: str, node) -> list[GpuDevice]:
        """The node's GPUs as the service's victim choice reads them (an inventory's devices)."""
        if name not in gpus:
            gpus[name] = [GpuDevice(uuid=x.uuid, index=x.index, model=x.model, memory_mib=x.memory_mib,
                                    max_shares=x.max_shares, healthy=x.healthy) for x in node.devices]
        return gpus[name]

    def preempt(i: int, p: TracePod, now: float) -> bool:
        """Release the victims the service would choose for this pod; whether there were any."""
        nonlocal allocated, waiting_gpu, victims, lost
        d = demands[p]
        if not preemption or priority[i] == 0 or d.gpus == 0:
            return False
        best: tuple[tuple, str, Victims] | None = None
        for name, node in fleet.nodes.items():
            allowed = [e for e in node.entries.values() if e.preemptible and e.priority < priority[i]]
            if not allowed or node.cpu_free + sum(e.cpu_millis for e in allowed) < d.cpu \
                    or node.mem_free + sum(e.host_memory_mib for e in allowed) < d.hostmem:
                continue
            devices = [x for x in gpus_of(name, node) if d.model_ok(x.model.lower())]
            if len(devices) < d.gpus:
                continue
            need = Need(gpus=d.gpus, memory_mib=None if d.memory_percent is None and d.memory_mib is None
                        else min(d.mem_req(x.memory_mib) for x in devices), cores=d.cores)
            if not _may_free(need, devices, node.entries.values(), priority[i]):
                continue
            got = choose_victims(need, devices, node.entries, priority[i], eligible={x.index for x in devices})
            if not isinstance(got, Victims) or not got.claims:
                continue
            gone = [node.entries[c] for c in got.claims]
            if node.cpu_free + sum(e.cpu_millis for e in gone) < d.cpu \
                    or node.mem_free + sum(e.host_memory_mib for e in gone) < d.hostmem:
                continue
            if best is None or (got.order, name) < (best[0], best[1]):
                best = (got.order, name, got)
        if best is None:
            return False
        _, name, chosen = best
        for claim in chosen.claims:
            j = int(claim[1:])
            started, _, _ = running.pop(j)
            fleet.release(name, claim)
            q = timed[j % n]
            allocated -= q.gpu_units
            waiting[j] = (now, q)  # recreated: waits again, from now
            waiting_gpu += q.gpu_units
            if now >= warm:
                victims += 1
                lost += q.gpu_units * (now - started)
        return True

    started_once: set[int] = set()
    ai = 0
    while ai < len(arrivals) or departures:
        next_arr = arrivals[ai][0] if ai < len(arrivals) else float("inf")
        next_dep = departures[0][0] if departures else float("inf")
        now = min(next_arr, next_dep)
        if now > horizon:
            break
        advance(now)
        if next_dep <= next_arr:
            while departures and departures[0][0] == now:
                _, i, node = heapq.heappop(departures)
                if running.get(i, (0.0, None, ""))[1] != now:
                    continue  # preempted: it left early
                del running[i]
                fleet.release(node, f"p{i}")
                allocated -= timed[i % n].gpu_units
            failed: set = set()
            for i, (t_arr, p) in list(waiting.items()):
                shape = (demands[p].shape, priority[i])
                if shape in failed:
                    continue
                retries += 1
                if start(i, p, now) or (preempt(i, p, now) and start(i, p, now)):
                    del waiting[i]
                    waiting_gpu -= p.gpu_units
                    if i not in started_once:
                        started_once.add(i)
                        waited(i, t_arr, now)
                else:
                    failed.add(shape)
        else:
            _, i, p = arrivals[ai]
            ai += 1
            if now >= warm:
                measured_arrivals += 1
            if start(i, p, now) or (preempt(i, p, now) and start(i, p, now)):
                started_once.add(i)
                waited(i, now, now)
            else:
                waiting[i] = (now, p)
                waiting_gpu += p.gpu_units
    advance(horizon)
    waits.sort()
    high_waits.sort()
    return ReplayResult(policy=policy, load=load, alloc_series=[round(x, 2) for x in series],
                        alloc_mean=round(100 * area_alloc / (capacity * (horizon - warm)), 2),
                        served_pct=round(100 * area_alloc / area_demand, 2) if area_demand else 100.0,
                        wait_p50=round(_quantile(waits, 0.5), 3), wait_p99=round(_quantile(waits, 0.99), 3),
                        waited=sum(1 for w in waits if w > 0), never_ran=len(waiting), pods=PASSES * n,
                        retries=retries, high=high, preemption=preemption,
                        high_wait_p50=round(_quantile(high_waits, 0.5), 3),
                        high_wait_p99=round(_quantile(high_waits, 0.99), 3),
                        high_never_ran=sum(1 for i in waiting if priority[i] == HIGH),
                        preemptions_per_1000=round(1000 * victims / measured_arrivals, 2) if measured_arrivals else 0.0,
                        lost_gpu_seconds=round(lost), lost_pct=round(100 * lost / area_alloc, 3) if area_alloc else 0.0,
                        frag_pct=round(sum(frags) / len(frags), 2) if frags else 0.0)
