"""What the tests of a node's slices following its kubelet plugin share (test_real_plugin_slices.py
with the real kubelet, test_real_slices_follow_registration.py with the test in its place): the
capacity publisher and the node's enforcer as processes acting as their deploy/k8s identities (the
publisher's that of its DaemonSet pod on the node, as tessera-node-slices requires), the node's
slices as the API server holds them, and the publisher's heartbeats counted: each one goes over the
slices first, so a slice still absent after a few of them was not written back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tessera.shared import subjects
from tessera.shared.events import NodeHeartbeat, inventory_decoder
from tessera.shared.kubeclaims import DRIVER

from tessera.cli.client import Client

from kit import eventually
from kit.kubecluster import KubeControlPlane, node_bound_identity, service_identity
from kubetessera import KubeCluster, KubeletDirs, start_services

GPU = {"model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}


@dataclass
class PluginSlices:
    plane: KubeControlPlane
    node: str
    dirs: KubeletDirs
    cluster: KubeCluster
    identities: dict[str, Path]
    beats: int = 0
    capacity_log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.capacity_log = self.cluster.find("capacity").log_path

    async def slices(self) -> list[dict]:
        out = await asyncio.to_thread(self.plane.kubectl, "get", "resourceslices", "-o", "json",
                                      f"--field-selector=spec.nodeName={self.node},spec.driver={DRIVER}")
        return json.loads(out.stdout)["items"]

    async def gone(self) -> bool:
        return await self.slices() == []

    async def heartbeats(self, n: int) -> None:
        """Until the publisher has gone over its slices ``n`` more times."""
        seen = self.beats
        await eventually(lambda: self.beats >= seen + n, timeout=60, what=f"{n} heartbeats of the publisher")

    def logged(self, text: str) -> bool:
        return text in self.capacity_log.read_text(errors="replace")

    def start_enforcer(self):
        """The node's enforcer again (after it stopped), as start_services started it."""
        return self.cluster.spawn("enforcer", instance=f"enforcer-{self.node}", env={
            "TESSERA_NODE": self.node, **self.dirs.env(), "KUBECONFIG": str(self.identities["enforcer"])})


@contextlib.asynccontextmanager
async def capacity_and_plugin(plane: KubeControlPlane, nats_url: str, workdir: Path, node: str, dirs: KubeletDirs):
    """The node (one GPU) served by a capacity publisher and its enforcer; yields `PluginSlices`."""
    profile = workdir / "fleet.yaml"
    profile.write_text(yaml.safe_dump({"nodes": [{"name": node, "gpus": [GPU]}]}))
    identities = {"capacity": node_bound_identity(plane, "capacity.yaml", node),
                  "enforcer": service_identity(plane, "enforcer.yaml")}
    cluster = await start_services(workdir / "tessera", nats_url, profile=profile, services=("capacity",),
                                   kubeconfigs=identities, kubelets={node: dirs})
    client = await Client.connect(nats_url)
    setup = PluginSlices(plane, node, dirs, cluster, identities)

    async def beat(msg) -> None:
        if isinstance(inventory_decoder.decode(msg.data), NodeHeartbeat):
            setup.beats += 1

    listening = await client.bus.listen(subjects.inventory(node), beat)
    try:
        yield setup
    finally:
        await listening.unsubscribe()
        await client.close()
        await asyncio.to_thread(cluster.stop)
