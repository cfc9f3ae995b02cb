"""The node's Prometheus endpoint: HAMi's monitor metrics, so existing dashboards keep working, plus
Tessera's own (allocated versus used per GPU, fragmentation per node, claims by state, reclaims).

HAMi names and labels follow its vGPU monitor (v2.9): container series carry ``namespace, pod,
container, vdevice_index, device_uuid`` (a claim maps to namespace = tenant, pod = claim, container =
"workload"), host series ``node, device_index, device_uuid, device_type``, all with ``zone="vGPU"``.
With legacy metrics on, the pre-2.9 names (``vGPU_device_memory_usage_in_bytes`` with
``podnamespace, podname, ctrname, vdeviceid, deviceuuid``, ...) are emitted too, as HAMi-DRA does by
default. Scrapes render the last observation; they never touch files or the bus.

Who may read it: these series name every claim of the node and its tenant, so they are served, like
every service's, on the metrics listener of `tessera.shared.metrics` (``TESSERA_METRICS_HOST``/
``TESSERA_METRICS_PORT``), never on the probe port that the kubelet (and so anything on the pod
network) reaches; deploy/k8s admits only the monitoring namespace to that port (NetworkPolicy
``enforcer-metrics``). No tenant reads another's claim ids here.

Fragmentation: the share of a node's free GPU memory that sits on GPUs already partly allocated,
i.e. memory a whole-GPU request cannot use (0 = every free byte is on an untouched GPU or nothing is
free; 1 = every free byte is stranded next to someone's slice).
"""

from __future__ import annotations

import logging
from collections import Counter

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tessera.shared.events import ClaimUsage
from tessera.shared.ledger import device_totals

from tessera.enforcer.gpustats import DeviceStats
from tessera.enforcer.observe import NodeView

log = logging.getLogger("tessera.enforcer.metrics")

MIB = 1 << 20
ZONE = "vGPU"
CONTAINER = "workload"
C_LABELS = ["namespace", "pod", "container", "vdevice_index", "device_uuid", "zone"]
H_LABELS = ["node", "device_index", "device_uuid", "device_type", "zone"]
LEGACY_C = ["podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid", "zone"]
LEGACY_H = ["deviceidx", "deviceuuid", "devicetype", "zone"]
T_LABELS = ["node", "device_index", "device_uuid", "device_type"]


def fragmentation(view: NodeView) -> float:
    totals = device_totals(view.ledger) if view.ledger else {}
    free_total = stranded = 0
    for uuid, device in view.devices.items():
        t = totals.get(uuid)
        used = t.memory_mib if t else 0
        free = 0 if (t and (t.exclusive or t.cores >= 100 or t.shares >= device.max_shares)) else max(0, device.memory_mib - used)
        free_total += free
        if t and t.shares:
            stranded += free
    return stranded / free_total if free_total else 0.0


class EnforcerMetrics:
    """A prometheus_client collector over the enforcer's last observation (the service adds it to its
    `ServiceMetrics`)."""

    def __init__(self, node: str, legacy: bool) -> None:
        self.node = node
        self.legacy = legacy
        self.view: NodeView | None = None
        self.usage: list[ClaimUsage] = []
        self.gpu: dict[str, DeviceStats] = {}
        self.reclaimed: Counter[str] = Counter()
        self.escapees: Counter[str] = Counter()  # processes the watchdog killed, by kind

    def update(self, view: NodeView, usage: list[ClaimUsage], gpu: dict[str, DeviceStats]) -> None:
        self.view, self.usage, self.gpu = view, usage, gpu

    def collect(self):
        view = self.view
        if view is None:
            return
        used_mem = GaugeMetricFamily("hami_vgpu_memory_used_bytes", "vGPU device memory usage in bytes", labels=C_LABELS)
        limit_mem = GaugeMetricFamily("hami_vgpu_memory_limit_bytes", "vGPU device memory limit in bytes", labels=C_LABELS)
        ctr_util = GaugeMetricFamily("hami_container_device_utilization_ratio",
                                     "Container device SM utilization ratio (0-100, NVML; absent when not measured)",
                                     labels=C_LABELS)
        host_mem = GaugeMetricFamily("hami_host_gpu_memory_used_bytes", "GPU device memory usage in bytes", labels=H_LABELS)
        host_util = GaugeMetricFamily("hami_host_gpu_utilization_ratio", "GPU core utilization ratio (0-100)", labels=H_LABELS)
        l_used = GaugeMetricFamily("vGPU_device_memory_usage_in_bytes", "vGPU device usage", labels=LEGACY_C)
        l_limit = GaugeMetricFamily("vGPU_device_memory_limit_in_bytes", "vGPU device limit", labels=LEGACY_C)
        l_util = GaugeMetricFamily("Device_utilization_desc_of_container", "Container device utilization description", labels=LEGACY_C)
        l_host_mem = GaugeMetricFamily("HostGPUMemoryUsage", "GPU device memory usage", labels=LEGACY_H)
        l_host_util = GaugeMetricFamily("HostCoreUtilization", "GPU core utilization", labels=LEGACY_H)

        accounted: Counter[str] = Counter()
        for usage in self.usage:
            pids = {p.pid for p in view.claims[usage.claim].processes} if usage.claim in view.claims else set()
            for i, d in enumerate(usage.devices):
                accounted[d.uuid] += d.used_bytes
                labels = [usage.tenant, usage.claim, CONTAINER, str(i), d.uuid, ZONE]
                used_mem.add_metric(labels, d.used_bytes)
                limit_mem.add_metric(labels, d.limit_bytes)
                if self.legacy:
                    l_used.add_metric(labels, d.used_bytes)
                    l_limit.add_metric(labels, d.limit_bytes)
                stats = self.gpu.get(d.uuid)
                if stats is not None:
                    util = sum(v for pid, v in stats.process_sm.items() if pid in pids)
                    ctr_util.add_metric(labels, util)
                    if self.legacy:
                        l_util.add_metric(labels, util)

        totals = device_totals(view.ledger) if view.ledger else {}
        t_total = GaugeMetricFamily("tessera_gpu_memory_total_bytes", "GPU memory of the card", labels=T_LABELS)
        t_alloc = GaugeMetricFamily("tessera_gpu_memory_allocated_bytes", "GPU memory allocated to claims (ledger)", labels=T_LABELS)
        t_used = GaugeMetricFamily("tessera_gpu_memory_used_bytes", "GPU memory the claims' processes hold (accounting files)", labels=T_LABELS)
        t_cores = GaugeMetricFamily("tessera_gpu_cores_allocated_ratio", "SM share allocated to claims (0-100)", labels=T_LABELS)
        t_shares = GaugeMetricFamily("tessera_gpu_shares", "claims sharing the GPU", labels=T_LABELS)
        for uuid, device in sorted(view.devices.items(), key=lambda kv: kv[1].index):
            host = [self.node, str(device.index), uuid, f"NVIDIA-{device.model}"]
            t = totals.get(uuid)
            t_total.add_metric(host, device.memory_mib * MIB)
            t_alloc.add_metric(host, (t.memory_mib if t else 0) * MIB)
            t_used.add_metric(host, accounted[uuid])
            t_cores.add_metric(host, t.cores if t else 0)
            t_shares.add_metric(host, t.shares if t else 0)
            stats = self.gpu.get(uuid)
            mem = stats.memory_used_bytes if stats is not None else accounted[uuid]
            host_mem.add_metric(host + [ZONE], mem)
            if self.legacy:
                l_host_mem.add_metric([str(device.index), uuid, f"NVIDIA-{device.model}", ZONE], mem)
            if stats is not None:
                host_util.add_metric(host + [ZONE], stats.utilization)
                if self.legacy:
                    l_host_util.add_metric([str(device.index), uuid, f"NVIDIA-{device.model}", ZONE], stats.utilization)

        frag = GaugeMetricFamily("tessera_node_fragmentation_ratio",
                                 "share of free GPU memory on partly allocated GPUs (0-1)", labels=["node"])
        frag.add_metric([self.node], fragmentation(view))
        states = Counter(cv.record.state for cv in view.claims.values()
                         if cv.live and cv.record is not None and cv.record.node == self.node)
        claims = GaugeMetricFamily("tessera_claims", "claims on this node by state", labels=["node", "state"])
        for state in ("allocated", "prepared", "running"):
            claims.add_metric([self.node, state], states.get(state, 0))
        procs = GaugeMetricFamily("tessera_claim_processes", "live processes in a claim's accounting file",
                                  labels=["node", "tenant", "claim"])
        for usage in self.usage:
            procs.add_metric([self.node, usage.tenant, usage.claim], usage.processes)
        reclaimed = CounterMetricFamily("tessera_reclaimed_claims", "claims released by leak reclaim",
                                        labels=["node", "reason"])
        for reason, n in sorted(self.reclaimed.items()):
            reclaimed.add_metric([self.node, reason], n)
        fresh = GaugeMetricFamily("tessera_usage_observed_timestamp_seconds",
                                  "when the accounting files were last read", labels=["node"])
        fresh.add_metric([self.node], view.ts)

        yield from (used_mem, limit_mem, ctr_util, host_mem, host_util)
        if self.legacy:
            yield from (l_used, l_limit, l_util, l_host_mem, l_host_util)
        escapees = CounterMetricFamily("tessera_escapees_killed", "processes of a claim killed for using the GPU "
                                       "without libvgpu in force", labels=["node", "kind"])
        for kind, n in sorted(self.escapees.items()):
            escapees.add_metric([self.node, kind], n)
        yield from (t_total, t_alloc, t_used, t_cores, t_shares, frag, claims, procs, reclaimed, escapees, fresh)
