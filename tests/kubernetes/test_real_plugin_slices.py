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
import signal

from tessera.shared.kubeclaims import DRIVER

from kit import eventually
from kubetessera import KubeletDirs
from pluginslices import capacity_and_plugin

WHY = {signal.SIGTERM: "is not registered (the plugin stopped)", signal.SIGKILL: "has been silent for"}
HEARTBEATS = 3  # the publisher's passes over its slices that a wiped slice must stay gone through


async def test_the_slices_go_with_the_plugin_and_come_back_with_it(kube_cluster, kube_node, nats_url, tmp_path):
    node = kube_node.name
    dirs = KubeletDirs(registry=kube_node.plugins_registry, plugin=kube_node.plugins_dir / DRIVER,
                       cdi=kube_node.cdi_dir)
    async with capacity_and_plugin(kube_cluster, nats_url, tmp_path, node, dirs) as setup:
        enforcer = setup.cluster.find(f"enforcer-{node}")
        for stop in (signal.SIGTERM, signal.SIGKILL):
            [written] = await eventually(setup.slices, timeout=60, what=f"the slice of {node}, its plugin registered")
            assert [d["name"] for d in written["spec"]["devices"]] == ["gpu-0"]

            enforcer.proc.send_signal(stop)  # the plugin goes: its registration socket with it, or not
            await asyncio.to_thread(enforcer.proc.wait, 30)
            # the kubelet's wipe, 30 s after it lost the plugin
            await eventually(setup.gone, timeout=120, what=f"the kubelet deleting the slice of {node} ({stop.name})")
            await setup.heartbeats(HEARTBEATS)
            assert await setup.gone(), f"the slice of {node} was written back while its plugin is gone ({stop.name})"
            # why: the plugin said it stopped, or (killed) fell silent
            assert setup.logged(f"ResourceSlice of {node} not written: its kubelet plugin {WHY[stop]}"), \
                setup.capacity_log.read_text()[-3000:]

            enforcer = setup.start_enforcer()
            await asyncio.to_thread(setup.cluster.wait_ready, 60)
        [back] = await eventually(setup.slices, timeout=60, what=f"the slice of {node} back with its plugin")
        assert [d["name"] for d in back["spec"]["devices"]] == ["gpu-0"]
