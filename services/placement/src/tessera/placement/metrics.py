"""Placement's Prometheus series: how fast it decides, what it decided, what waits, how fragmented the
fleet is, and HAMi's scheduler-side series so that existing HAMi dashboards work unchanged.

The decision path pays one histogram observation per claim (`decided`) and one per allocation
(`allocated`); counts it keeps anyway (`PlacementService.counts`) and the sizes of its tables are
read when scraped. Fragmentation and HAMi's per-GPU and per-claim series are derived from the fleet
view once per metrics refresh (TESSERA_METRICS_INTERVAL), off the decision path, each node only when
its inventory, its ledger or the workload mix (taken up at most once a minute) changed since, and
kept as ready Prometheus text (`tessera.shared.metrics.Exposition`): at a thousand nodes they are
over a hundred thousand samples, which a scrape must not rebuild in the loop that decides claims.

Fragmentation is `tessera.shared.fragmentation` over the node's inventory and ledger with the mix the
engine learned (up to a minute old), i.e. the number the fragmentation-aware policy minimises (in
GPU units: the expected free capacity a claim drawn from the mix could not use). Every replica reports the fleet as it sees
it: aggregate with ``max by (node)``, not ``sum``.

HAMi's names and labels follow its scheduler's metrics (v2.x ``cmd/scheduler/metrics.go``): current
series ``hami_gpu_*`` / ``hami_node_gpu_*`` / ``hami_vgpu_*_allocated_*`` / ``hami_resource_quota_used``
with ``node, device_uuid, device_index, device_type``; with legacy metrics on (the default, as HAMi)
the older ``GPUDeviceMemoryLimit``, ``GPUDeviceSharedNum``, ``vGPUMemoryAllocated``, ``QuotaUsed``, ...
with ``nodeid, deviceuuid, deviceidx, devicetype``; every one with ``zone="vGPU"``. A claim is a pod:
namespace = tenant, pod = claim, container index 0.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

import msgspec

from tessera.shared import fragmentation
from tessera.shared.events import TenantUsage
from tessera.shared.ledger import tenant_totals
from tessera.shared.metrics import MIB, ZONE, Exposition, ServiceMetrics, labelset, line

_usage = msgspec.json.Decoder(TenantUsage)

DEVICE = ["node", "device_uuid", "device_index", "device_type", "zone"]
LEGACY_DEVICE = ["nodeid", "deviceuuid", "deviceidx", "devicetype", "zone"]
CONTAINER = ["namespace", "node", "pod", "container_index", "device_uuid", "zone"]
LEGACY_CONTAINER = ["podnamespace", "nodename", "podname", "containeridx", "deviceuuid", "zone"]


# Nodes rebuilt between two yields to the event loop (few enough, at eight GPUs a node, that the
# decisions waiting on the loop are not held up long).
YIELD_EVERY = 50
# The figures take up a republished workload mix at most this often (seconds).
MIX_SECONDS = 60.0
# Distinct node states whose fragmentation is remembered (for one workload mix).
MEMO_LIMIT = 100_000


def _order(gpu) -> tuple:
    # (GPU order does not change a node's fragmentation: states that differ only in it share a value)
    return (gpu.memory_mib, gpu.mem_used, gpu.cores_used, gpu.shares, gpu.exclusive, gpu.healthy, gpu.max_shares)

# The per-node families, in the order they are served: (name, help).
FRAGMENTATION = (
    ("tessera_fragmentation_gpu_units", "expected free GPU capacity a claim drawn from the workload mix could not "
                                        "use on the node (FGD; tessera.shared.fragmentation)"),
    ("tessera_free_gpu_units", "free GPU capacity of the node (GPU units)"),
    ("tessera_fragmentation_ratio", "fragmentation over free capacity (0: all usable, 1: none)"),
)
HAMI_DEVICE = (
    ("hami_gpu_memory_limit_bytes", "Device memory limit for a certain GPU"),
    ("hami_gpu_core_limit_ratio", "Device core limit for a certain GPU"),
    ("hami_gpu_memory_allocated_bytes", "Device memory allocated for a certain GPU"),
    ("hami_gpu_shared_count", "Number of containers sharing this GPU"),
    ("hami_gpu_core_allocated_ratio", "Device core allocated for a certain GPU"),
    ("hami_node_gpu_memory_allocated_ratio", "GPU Memory Allocated Percentage on a certain GPU"),
    ("hami_vgpu_memory_allocated_bytes", "vGPU memory allocated from a container"),
    ("hami_vgpu_core_allocated_ratio", "vGPU core allocated from a container"),
)
HAMI_LEGACY = (
    ("GPUDeviceMemoryLimit", "Device memory limit for a certain GPU"),
    ("GPUDeviceCoreLimit", "Device memory core limit for a certain GPU"),
    ("GPUDeviceMemoryAllocated", "Device memory allocated for a certain GPU"),
    ("GPUDeviceSharedNum", "Number of containers sharing this GPU"),
    ("GPUDeviceCoreAllocated", "Device core allocated for a certain GPU"),
    ("nodeGPUMemoryPercentage", "GPU Memory Allocated Percentage on a certain GPU"),
    ("vGPUMemoryAllocated", "vGPU memory allocated from a container"),
    ("vGPUCoreAllocated", "vGPU core allocated from a container"),
)
WITH_CORES = ["node", "device_uuid", "device_index", "device_cores", "device_type", "zone"]
LEGACY_WITH_CORES = ["nodeid", "deviceuuid", "deviceidx", "devicecores", "devicetype", "zone"]
RATIO = ["node", "device_uuid", "device_index", "zone"]
LEGACY_RATIO = ["nodeid", "deviceuuid", "deviceidx", "zone"]


@dataclass(frozen=True)
class NodeFigures:
    """What one refresh derived for one node (reused until its inputs change)."""

    key: tuple
    fragmentation: float  # GPU units
    free: float  # GPU units


class PlacementMetrics:
    def __init__(self, svc, metrics: ServiceMetrics, legacy: bool) -> None:
        self.svc = svc
        self.legacy = legacy
        decision = metrics.histogram(
            "tessera_placement_decision_seconds",
            "time the engine took to decide one claim (node and GPUs, or a refusal), in memory",
            ["path"])
        # Bound once: the hot path observes on a child, no label lookup per claim.
        self.decided_batch = decision.labels("batch")
        self.decided_single = decision.labels("single")
        self.allocated = metrics.histogram(
            "tessera_placement_claim_latency_seconds",
            "from the claim's request (its requested event's ts) to its allocation being recorded")
        self.nodes: dict[str, NodeFigures] = {}
        self._memo: dict[tuple, float] = {}  # node state -> fragmentation, for one mix version
        self._memo_version = -1
        self._mix_version, self._mix_adopted = -1, float("-inf")  # the mix the figures use
        self._kinds: list[tuple[tuple, float]] = []
        # node -> (uuid -> (GPU state, its lines), claim -> (ledger entry, its lines)): `_lines`' cache
        self._pieces: dict[str, tuple[dict, dict]] = {}
        self.text = Exposition(FRAGMENTATION + HAMI_DEVICE + (HAMI_LEGACY if legacy else ()))
        metrics.add(self)
        metrics.text(self.text)
        metrics.every(self.refresh)

    # --- the refresh: fragmentation and per-GPU figures, off the decision path --------------------

    async def refresh(self) -> None:
        view = self.svc.view
        mix = self.svc.placer.mix
        now = time.monotonic()
        if mix.version != self._mix_version and now - self._mix_adopted >= MIX_SECONDS:
            # A new mix changes every node's figure: adopted at most every MIX_SECONDS, since while
            # the engine learns it republishes often, and each adoption recomputes the whole fleet.
            self._mix_version, self._mix_adopted = mix.version, now
            self._kinds = [(d.kind, p) for d, p in mix.kinds()]
        kinds = self._kinds
        figures: dict[str, NodeFigures] = {}
        rebuilt = 0
        for node, inventory in list(view.inventories.items()):
            if rebuilt == YIELD_EVERY:  # let decisions run between slices of a big rebuild
                rebuilt = 0
                await asyncio.sleep(0)
            ledger, revision = view.node_ledgers.get(node, (None, None))
            key = (self._mix_version, id(inventory), id(ledger), revision)
            known = self.nodes.get(node)
            if known is not None and known.key == key:
                figures[node] = known
                continue
            rebuilt += 1
            states = fragmentation.gpu_states(inventory, ledger)
            cpu_free, mem_free = fragmentation.host_free(inventory, ledger)
            f = figures[node] = NodeFigures(key=key, fragmentation=self._fragmentation(self._mix_version, kinds, states,
                                                                                       cpu_free, mem_free),
                                            free=sum(s.free for s in states.values()))
            self.text.set(node, self._lines(node, inventory, ledger, states, f))
        self.nodes = figures
        self.text.keep_only(figures)
        for gone in [n for n in self._pieces if n not in figures]:
            del self._pieces[gone]

    def _fragmentation(self, version: int, kinds: list, states: dict, cpu_free: int, mem_free: int) -> float:
        """The shared arithmetic, once per distinct node state: nodes of one type holding the same
        shares are many (the engine groups them into classes for the same reason), and a node's
        state comes back as claims come and go."""
        if version != self._memo_version or len(self._memo) > MEMO_LIMIT:
            self._memo, self._memo_version = {}, version
        key = (tuple(sorted(states.values(), key=_order)), cpu_free, mem_free)
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = fragmentation.node_fragmentation(list(states.values()), cpu_free, mem_free,
                                                                       kinds)
        return value

    def _lines(self, node, inventory, ledger, states, f: NodeFigures) -> dict[str, list[str]]:
        """The node's text: its fragmentation, and each GPU's and each claim's HAMi lines, these
        two kept from the last rebuild where that GPU's state or that claim did not change (a
        claim's arrival changes one GPU of the node, not eight)."""
        lines: dict[str, list[str]] = {name: [] for name in self.text.families}
        n = labelset(["node"], [node])
        lines["tessera_fragmentation_gpu_units"].append(line("tessera_fragmentation_gpu_units", n, f.fragmentation))
        lines["tessera_free_gpu_units"].append(line("tessera_free_gpu_units", n, f.free))
        lines["tessera_fragmentation_ratio"].append(line("tessera_fragmentation_ratio", n,
                                                          f.fragmentation / f.free if f.free else 0.0))
        cached_gpus, cached_claims = self._pieces.get(node, ({}, {}))
        gpus: dict[str, tuple] = {}
        for d in sorted(inventory.devices, key=lambda d: d.index):
            st = states[d.uuid]
            key = (d.index, d.model, d.memory_mib, st.mem_used, st.cores_used, st.shares)
            known = cached_gpus.get(d.uuid)
            piece = known[1] if known is not None and known[0] == key else self._gpu_lines(node, d, st)
            gpus[d.uuid] = (key, piece)
            for name, text in piece:
                lines[name].append(text)
        claims: dict[str, tuple] = {}
        for entry in (ledger.entries.values() if ledger is not None else ()):
            known = cached_claims.get(entry.claim)
            piece = known[1] if known is not None and known[0] == entry else self._claim_lines(node, entry)
            claims[entry.claim] = (entry, piece)
            for name, text in piece:
                lines[name].append(text)
        self._pieces[node] = (gpus, claims)
        return lines

    def _gpu_lines(self, node: str, d, st) -> list[tuple[str, str]]:
        index, dtype = str(d.index), f"NVIDIA-{d.model}"
        device = [node, d.uuid, index, dtype, ZONE]
        with_cores = [node, d.uuid, index, "100", dtype, ZONE]
        ratio = [node, d.uuid, index, ZONE]
        sets = {  # label set -> (current, legacy) text, escaped once per GPU
            "device": (labelset(DEVICE, device), labelset(LEGACY_DEVICE, device)),
            "cores": (labelset(WITH_CORES, with_cores), labelset(LEGACY_WITH_CORES, with_cores)),
            "ratio": (labelset(RATIO, ratio), labelset(LEGACY_RATIO, ratio)),
        }
        out = []
        for name, old, which, value in (
            ("hami_gpu_memory_limit_bytes", "GPUDeviceMemoryLimit", "device", d.memory_mib * MIB),
            ("hami_gpu_core_limit_ratio", "GPUDeviceCoreLimit", "device", 100),
            ("hami_gpu_memory_allocated_bytes", "GPUDeviceMemoryAllocated", "cores", st.mem_used * MIB),
            ("hami_gpu_shared_count", "GPUDeviceSharedNum", "device", st.shares),
            ("hami_gpu_core_allocated_ratio", "GPUDeviceCoreAllocated", "device", st.cores_used),
            ("hami_node_gpu_memory_allocated_ratio", "nodeGPUMemoryPercentage", "ratio", st.mem_used / d.memory_mib),
        ):
            current, before = sets[which]
            out.append((name, line(name, current, value)))
            if self.legacy:
                out.append((old, line(old, before, value)))
        return out

    def _claim_lines(self, node: str, entry) -> list[tuple[str, str]]:
        """Per claim and GPU (HAMi: per container and device): what the ledger gives it."""
        out = []
        for share in entry.shares:
            vals = [entry.tenant, node, entry.claim, "0", share.uuid, ZONE]
            current = labelset(CONTAINER, vals)
            out.append(("hami_vgpu_memory_allocated_bytes",
                        line("hami_vgpu_memory_allocated_bytes", current, share.memory_mib * MIB)))
            out.append(("hami_vgpu_core_allocated_ratio", line("hami_vgpu_core_allocated_ratio", current, share.cores)))
            if self.legacy:
                before = labelset(LEGACY_CONTAINER, vals)
                out.append(("vGPUMemoryAllocated", line("vGPUMemoryAllocated", before, share.memory_mib * MIB)))
                out.append(("vGPUCoreAllocated", line("vGPUCoreAllocated", before, share.cores)))
        return out

    # --- the scrape ---------------------------------------------------------------------------

    def collect(self):
        svc = self.svc
        counts = svc.counts
        outcomes = CounterMetricFamily("tessera_placement_claims",
                                       "claims this replica decided, by outcome (withdrawn: taken off a node "
                                       "kube-scheduler took the allocation back from, to be placed again; "
                                       "adopted: allocated by another allocator, taken into the ledger)",
                                       labels=["outcome"])
        outcomes.add_metric(["allocated"], counts["allocated"])
        outcomes.add_metric(["unschedulable"], counts["unschedulable"])
        outcomes.add_metric(["withdrawn"], counts["withdrawn"])
        outcomes.add_metric(["adopted"], counts["adopted"])
        yield outcomes
        conflicts = CounterMetricFamily("tessera_placement_cas_conflicts",
                                        "ledger compare-and-set writes lost to a concurrent writer (a peer replica)")
        conflicts.add_metric([], counts["conflicts"])
        yield conflicts
        retries = CounterMetricFamily("tessera_placement_retries",
                                      "claims decided again: after a lost race (lost_race) or because "
                                      "something changed while they waited (unschedulable)", labels=["reason"])
        retries.add_metric(["lost_race"], counts["lost_races"])
        retries.add_metric(["unschedulable"], counts["retried"])
        yield retries
        waiting = GaugeMetricFamily("tessera_placement_claims_waiting",
                                    "unschedulable claims waiting for capacity or quota (retried on a change)")
        waiting.add_metric([], len(svc.pending))
        yield waiting
        placed = GaugeMetricFamily("tessera_placement_claims_placed",
                                   "claims holding a ledger entry (allocated, prepared or running)")
        placed.add_metric([], len(svc.claim_nodes))
        yield placed
        total_frag = sum(f.fragmentation for f in self.nodes.values())
        total_free = sum(f.free for f in self.nodes.values())
        fleet = GaugeMetricFamily("tessera_fleet_fragmentation_gpu_units",
                                  "the fleet's fragmentation: the sum over its nodes (GPU units)")
        fleet.add_metric([], total_frag)
        fleet_free = GaugeMetricFamily("tessera_fleet_free_gpu_units", "the fleet's free GPU capacity (GPU units)")
        fleet_free.add_metric([], total_free)
        fleet_ratio = GaugeMetricFamily("tessera_fleet_fragmentation_ratio",
                                        "the fleet's fragmentation over its free capacity")
        fleet_ratio.add_metric([], total_frag / total_free if total_free else 0.0)
        yield from (fleet, fleet_free, fleet_ratio)
        yield from self._hami_quota()

    def _hami_quota(self):
        """HAMi's quota series per tenant (namespace) and resource, from the quotas placement enforces
        and the usage it keeps in the ledger (``tenant.<tenant>``). Tenants without a limit on a
        resource have no series for it, as a namespace without a ResourceQuota has none in HAMi."""
        used = GaugeMetricFamily("hami_resource_quota_used", "resourcequota usage for a certain device",
                                 labels=["namespace", "quota_name", "limit", "zone"])
        legacy = GaugeMetricFamily("QuotaUsed", "resourcequota usage for a certain device",
                                   labels=["quotanamespace", "quotaName", "limit", "zone"])
        usage = self.svc.view.tenant_usage
        for tenant, quota in sorted(self.svc.quotas.items()):
            try:
                held = _usage.decode(usage[tenant]) if tenant in usage else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                held = None  # (the view logs and skips bad values where it uses them)
            totals = tenant_totals(held) if held is not None else None
            for name, limit, value in (
                ("nvidia.com/gpu", quota.gpus, totals.gpus if totals else 0),
                ("nvidia.com/gpumem", quota.memory_mib, totals.memory_mib if totals else 0),
                ("nvidia.com/gpucores", quota.cores, totals.cores if totals else 0),
            ):
                if limit is None:
                    continue
                used.add_metric([tenant, name, str(limit), ZONE], value)
                if self.legacy:
                    legacy.add_metric([tenant, name, str(limit), ZONE], value)
        yield used
        if self.legacy:
            yield legacy
