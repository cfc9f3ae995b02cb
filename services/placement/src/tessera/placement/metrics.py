"""Placement's Prometheus series: how fast it decides, what it decided, what waits, how fragmented the
fleet is, and HAMi's scheduler-side series so that existing HAMi dashboards work unchanged.

The decision path pays one histogram observation per claim (`decided`) and one per allocation
(`allocated`); counts it keeps anyway (`PlacementService.counts`) and the sizes of its tables are
read when scraped. Fragmentation and HAMi's per-GPU series are derived from the fleet view once per
metrics refresh (TESSERA_METRICS_INTERVAL), off the decision path, with each node recomputed only when
its inventory, its ledger or the workload mix changed since the last refresh.

Fragmentation is `tessera.shared.fragmentation` over the node's inventory and ledger with the mix the
engine learned, i.e. the number the fragmentation-aware policy minimises (in GPU units: the expected
free capacity a claim drawn from the mix could not use). Every replica reports the fleet as it sees
it: aggregate with ``max by (node)``, not ``sum``.

HAMi's names and labels follow its scheduler's metrics (v2.x ``cmd/scheduler/metrics.go``): current
series ``hami_gpu_*`` / ``hami_node_gpu_*`` / ``hami_vgpu_*_allocated_*`` / ``hami_resource_quota_used``
with ``node, device_uuid, device_index, device_type``; with legacy metrics on (the default, as HAMi)
the older ``GPUDeviceMemoryLimit``, ``GPUDeviceSharedNum``, ``vGPUMemoryAllocated``, ``QuotaUsed``, ...
with ``nodeid, deviceuuid, deviceidx, devicetype``; every one with ``zone="vGPU"``. A claim is a pod:
namespace = tenant, pod = claim, container index 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

import msgspec

from tessera.shared import fragmentation
from tessera.shared.events import TenantUsage
from tessera.shared.ledger import tenant_totals
from tessera.shared.metrics import MIB, ZONE, ServiceMetrics

_usage = msgspec.json.Decoder(TenantUsage)

DEVICE = ["node", "device_uuid", "device_index", "device_type", "zone"]
LEGACY_DEVICE = ["nodeid", "deviceuuid", "deviceidx", "devicetype", "zone"]
CONTAINER = ["namespace", "node", "pod", "container_index", "device_uuid", "zone"]
LEGACY_CONTAINER = ["podnamespace", "nodename", "podname", "containeridx", "deviceuuid", "zone"]


@dataclass(frozen=True)
class NodeFigures:
    """What one refresh derived for one node (reused until its inputs change)."""

    key: tuple
    fragmentation: float  # GPU units
    free: float  # GPU units
    devices: tuple  # (uuid, index, type, memory_mib, mem_used, cores_used, shares)


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
        metrics.add(self)
        metrics.every(self.refresh)

    # --- the refresh: fragmentation and per-GPU figures, off the decision path --------------------

    async def refresh(self) -> None:
        view = self.svc.view
        mix = self.svc.placer.mix
        kinds = None
        figures: dict[str, NodeFigures] = {}
        for node, inventory in list(view.inventories.items()):
            ledger, revision = view.ledger_of(node)
            key = (mix.version, id(inventory), id(ledger), revision)
            known = self.nodes.get(node)
            if known is not None and known.key == key:
                figures[node] = known
                continue
            if kinds is None:
                kinds = [(d.kind, p) for d, p in mix.kinds()]
            states = fragmentation.gpu_states(inventory, ledger)
            cpu_free, mem_free = fragmentation.host_free(inventory, ledger)
            devices = tuple(
                (d.uuid, d.index, f"NVIDIA-{d.model}", d.memory_mib, states[d.uuid].mem_used,
                 states[d.uuid].cores_used, states[d.uuid].shares)
                for d in sorted(inventory.devices, key=lambda d: d.index))
            figures[node] = NodeFigures(
                key=key,
                fragmentation=fragmentation.node_fragmentation(list(states.values()), cpu_free, mem_free, kinds),
                free=sum(s.free for s in states.values()),
                devices=devices)
        self.nodes = figures

    # --- the scrape ---------------------------------------------------------------------------

    def collect(self):
        svc = self.svc
        counts = svc.counts
        outcomes = CounterMetricFamily("tessera_placement_claims",
                                       "claims this replica decided, by outcome", labels=["outcome"])
        outcomes.add_metric(["allocated"], counts["allocated"])
        outcomes.add_metric(["unschedulable"], counts["unschedulable"])
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
        yield from self._fragmentation()
        yield from self._hami()

    def _fragmentation(self):
        per_node = GaugeMetricFamily("tessera_fragmentation_gpu_units",
                                     "expected free GPU capacity a claim drawn from the workload mix could not "
                                     "use on the node (FGD; tessera.shared.fragmentation)", labels=["node"])
        free = GaugeMetricFamily("tessera_free_gpu_units", "free GPU capacity of the node (GPU units)",
                                 labels=["node"])
        ratio = GaugeMetricFamily("tessera_fragmentation_ratio",
                                  "fragmentation over free capacity (0: all usable, 1: none)", labels=["node"])
        total_frag = total_free = 0.0
        for node, f in sorted(self.nodes.items()):
            per_node.add_metric([node], f.fragmentation)
            free.add_metric([node], f.free)
            ratio.add_metric([node], f.fragmentation / f.free if f.free else 0.0)
            total_frag += f.fragmentation
            total_free += f.free
        fleet = GaugeMetricFamily("tessera_fleet_fragmentation_gpu_units",
                                  "the fleet's fragmentation: the sum over its nodes (GPU units)")
        fleet.add_metric([], total_frag)
        fleet_free = GaugeMetricFamily("tessera_fleet_free_gpu_units", "the fleet's free GPU capacity (GPU units)")
        fleet_free.add_metric([], total_free)
        fleet_ratio = GaugeMetricFamily("tessera_fleet_fragmentation_ratio",
                                        "the fleet's fragmentation over its free capacity")
        fleet_ratio.add_metric([], total_frag / total_free if total_free else 0.0)
        yield from (per_node, free, ratio, fleet, fleet_free, fleet_ratio)

    def _hami(self):
        legacy = self.legacy
        mem_limit = GaugeMetricFamily("hami_gpu_memory_limit_bytes", "Device memory limit for a certain GPU",
                                      labels=DEVICE)
        core_limit = GaugeMetricFamily("hami_gpu_core_limit_ratio", "Device core limit for a certain GPU",
                                       labels=DEVICE)
        mem_alloc = GaugeMetricFamily("hami_gpu_memory_allocated_bytes", "Device memory allocated for a certain GPU",
                                      labels=["node", "device_uuid", "device_index", "device_cores", "device_type",
                                              "zone"])
        shared = GaugeMetricFamily("hami_gpu_shared_count", "Number of containers sharing this GPU", labels=DEVICE)
        core_alloc = GaugeMetricFamily("hami_gpu_core_allocated_ratio", "Device core allocated for a certain GPU",
                                       labels=DEVICE)
        mem_ratio = GaugeMetricFamily("hami_node_gpu_memory_allocated_ratio",
                                      "GPU Memory Allocated Percentage on a certain GPU",
                                      labels=["node", "device_uuid", "device_index", "zone"])
        families = [mem_limit, core_limit, mem_alloc, shared, core_alloc, mem_ratio]
        if legacy:
            l_mem_limit = GaugeMetricFamily("GPUDeviceMemoryLimit", "Device memory limit for a certain GPU",
                                            labels=LEGACY_DEVICE)
            l_core_limit = GaugeMetricFamily("GPUDeviceCoreLimit", "Device memory core limit for a certain GPU",
                                             labels=LEGACY_DEVICE)
            l_mem_alloc = GaugeMetricFamily("GPUDeviceMemoryAllocated", "Device memory allocated for a certain GPU",
                                            labels=["nodeid", "deviceuuid", "deviceidx", "devicecores", "devicetype",
                                                    "zone"])
            l_shared = GaugeMetricFamily("GPUDeviceSharedNum", "Number of containers sharing this GPU",
                                         labels=LEGACY_DEVICE)
            l_core_alloc = GaugeMetricFamily("GPUDeviceCoreAllocated", "Device core allocated for a certain GPU",
                                             labels=LEGACY_DEVICE)
            l_mem_ratio = GaugeMetricFamily("nodeGPUMemoryPercentage", "GPU Memory Allocated Percentage on a certain GPU",
                                            labels=["nodeid", "deviceuuid", "deviceidx", "zone"])
            families += [l_mem_limit, l_core_limit, l_mem_alloc, l_shared, l_core_alloc, l_mem_ratio]
        for node, f in sorted(self.nodes.items()):
            for uuid, index, dtype, memory, mem_used, cores_used, shares in f.devices:
                labels = [node, uuid, str(index), dtype, ZONE]
                mem_limit.add_metric(labels, memory * MIB)
                core_limit.add_metric(labels, 100)
                mem_alloc.add_metric([node, uuid, str(index), "100", dtype, ZONE], mem_used * MIB)
                shared.add_metric(labels, shares)
                core_alloc.add_metric(labels, cores_used)
                mem_ratio.add_metric([node, uuid, str(index), ZONE], mem_used / memory)
                if legacy:
                    l_mem_limit.add_metric(labels, memory * MIB)
                    l_core_limit.add_metric(labels, 100)
                    l_mem_alloc.add_metric([node, uuid, str(index), "100", dtype, ZONE], mem_used * MIB)
                    l_shared.add_metric(labels, shares)
                    l_core_alloc.add_metric(labels, cores_used)
                    l_mem_ratio.add_metric([node, uuid, str(index), ZONE], mem_used / memory)
        yield from families
        yield from self._hami_claims()
        yield from self._hami_quota()

    def _hami_claims(self):
        """Per claim and GPU (HAMi: per container and device): what the ledger gives it."""
        mem = GaugeMetricFamily("hami_vgpu_memory_allocated_bytes", "vGPU memory allocated from a container",
                                labels=CONTAINER)
        cores = GaugeMetricFamily("hami_vgpu_core_allocated_ratio", "vGPU core allocated from a container",
                                  labels=CONTAINER)
        families = [mem, cores]
        if self.legacy:
            l_mem = GaugeMetricFamily("vGPUMemoryAllocated", "vGPU memory allocated from a container",
                                      labels=LEGACY_CONTAINER)
            l_cores = GaugeMetricFamily("vGPUCoreAllocated", "vGPU core allocated from a container",
                                        labels=LEGACY_CONTAINER)
            families += [l_mem, l_cores]
        for node, (ledger, _) in sorted(self.svc.view.node_ledgers.items()):
            for entry in ledger.entries.values():
                for share in entry.shares:
                    labels = [entry.tenant, node, entry.claim, "0", share.uuid, ZONE]
                    mem.add_metric(labels, share.memory_mib * MIB)
                    cores.add_metric(labels, share.cores)
                    if self.legacy:
                        l_mem.add_metric(labels, share.memory_mib * MIB)
                        l_cores.add_metric(labels, share.cores)
        yield from families

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
