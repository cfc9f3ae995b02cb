"""A node's ResourceSlices exist only while its kubelet plugin is registered (defect 9 of issue 22),
with the real kubelet: it deletes a driver's slices of its node 30 s after the driver's plugin goes
(the "driver is down" signal), and Tessera's capacity publisher must not write them back until the
plugin is registered again. Before the change it put them back within a heartbeat.

The node is tests/kit/kubenode.py's real kubelet and containerd; the enforcer (the plugin) and the
capacity publisher run as processes acting as their deploy/k8s identities (the capacity publisher's
that of its DaemonSet pod on the node, as tessera-node-slices requires). The plugin goes twice:
stopped (SIGTERM: it says so on its way out) and killed (SIGKILL: it says nothing, its silence
counts). Each time the slice must stay gone through several of the publisher's heartbeats (each one
lists the slices and re-applies what it would write), and come back once the plugin is back.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import yaml

from tessera.shared import subjects
from tessera.shared.events import NodeHeartbeat, inventory_decoder
from tessera.shared.kubeclaims import DRIVER

from tessera.cli.client import Client

from kit import eventually
from kit.kubecluster import node_bound_identity, service_identity
from kubetessera import KubeletDirs, start_services

GPU = {"model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}
WHY = {signal.SIGTERM: "is not registered (the plugin stopped)", signal.SIGKILL: "has been silent for"}
HEARTBEATS = 3  # the publisher's passes over its slices that a wiped slice must stay gone through


def _log_has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


async def test_the_slices_go_with_the_plugin_and_come_back_with_it(kube_cluster, kube_node, nats_url, tmp_path):
    node = kube_node.name

    async def slices() -> list[dict]:
        out = await asyncio.to_thread(kube_cluster.kubectl, "get", "resourceslices", "-o", "json",
                                      f"--field-selector=spec.nodeName={node},spec.driver={DRIVER}")
        return json.loads(out.stdout)["items"]

    profile = tmp_path / "fleet.yaml"
    profile.write_text(yaml.safe_dump({"nodes": [{"name": node, "gpus": [GPU]}]}))
    dirs = KubeletDirs(registry=kube_node.plugins_registry, plugin=kube_node.plugins_dir / DRIVER,
                       cdi=kube_node.cdi_dir)
    identities = {"capacity": node_bound_identity(kube_cluster, "capacity.yaml", node),
                  "enforcer": service_identity(kube_cluster, "enforcer.yaml")}
    cluster = await start_services(tmp_path / "tessera", nats_url, None, profile=profile, services=("capacity",),
                                   kubeconfigs=identities, kubelets={node: dirs})
    client = await Client.connect(nats_url)
    beats = 0

    async def beat(msg) -> None:
        nonlocal beats
        if isinstance(inventory_decoder.decode(msg.data), NodeHeartbeat):
            beats += 1

    listening = await client.bus.listen(subjects.inventory(node), beat)
    enforcer = cluster.find(f"enforcer-{node}")
    capacity_log = cluster.find("capacity").log_path
    try:
        for stop in (signal.SIGTERM, signal.SIGKILL):
            [written] = await eventually(slices, timeout=60, what=f"the slice of {node} with its plugin registered")
            assert [d["name"] for d in written["spec"]["devices"]] == ["gpu-0"]

            enforcer.proc.send_signal(stop)  # the plugin goes: its registration socket with it, or not
            await asyncio.to_thread(enforcer.proc.wait, 30)
            # the kubelet's wipe, 30 s after it lost the plugin
            await eventually(lambda: _gone(slices), timeout=120,
                             what=f"the kubelet deleting the slice of {node} ({stop.name})")
            seen = beats
            await eventually(lambda seen=seen: beats >= seen + HEARTBEATS, timeout=60, what="the publisher's heartbeats")
            assert await slices() == [], f"the slice of {node} was written back while its plugin is gone ({stop.name})"
            # why: the plugin said it stopped, or (killed) fell silent
            assert _log_has(capacity_log, f"ResourceSlice of {node} not written: its kubelet plugin {WHY[stop]}"), \
                capacity_log.read_text()[-3000:]

            enforcer = cluster.spawn("enforcer", instance=f"enforcer-{node}", env={
                "TESSERA_NODE": node, **dirs.env(), "KUBECONFIG": str(identities["enforcer"])})
            await asyncio.to_thread(cluster.wait_ready, 60)
        [back] = await eventually(slices, timeout=60, what=f"the slice of {node} back with its plugin")
        assert [d["name"] for d in back["spec"]["devices"]] == ["gpu-0"]
    finally:
        await listening.unsubscribe()
        await client.close()
        await asyncio.to_thread(cluster.stop)


async def _gone(slices) -> bool:
    return await slices() == []
