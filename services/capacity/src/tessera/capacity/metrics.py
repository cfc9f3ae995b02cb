"""The capacity publisher's Prometheus series: the GPUs it publishes per node and which nodes it holds
lost, so a dashboard can tell "no capacity" from "capacity not announced". Read from the service's
own tables when scraped (`tessera.shared.metrics` serves them); nothing is computed on its paths.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from tessera.shared.metrics import MIB


class CapacityMetrics:
    def __init__(self, svc) -> None:
        self.svc = svc

    def collect(self):
        svc = self.svc
        gpus = GaugeMetricFamily("tessera_capacity_gpus", "GPUs the publisher announces for the node (healthy ones)",
                                 labels=["node"])
        memory = GaugeMetricFamily("tessera_capacity_memory_bytes", "GPU memory it announces for the node",
                                   labels=["node"])
        lost = GaugeMetricFamily("tessera_capacity_node_lost",
                                 "1 while the publisher holds the node lost (no sign of life in time)",
                                 labels=["node"])
        for inv in sorted(svc.nodes, key=lambda n: n.node):
            healthy = [d for d in inv.devices if d.healthy]
            gpus.add_metric([inv.node], len(healthy))
            memory.add_metric([inv.node], sum(d.memory_mib for d in healthy) * MIB)
            lost.add_metric([inv.node], 1 if inv.node in svc.lost else 0)
        yield from (gpus, memory, lost)
