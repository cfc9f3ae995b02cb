"""The capacity publisher and the enforcer meet only on the bus: a node's slice follows what the
enforcer says of its registration, on the real kube-apiserver, with the test in the kubelet's place
(its registration calls, and its wipe: a collection delete of the node's slices of the driver).
The real kubelet does the same in test_real_plugin_slices.py; this one needs no node, so it is the
quick check of the bus path (the enforcer's ``kubelet-plugin`` reports, the publisher's rules).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import grpc

from tessera.shared.kubeclaims import DRIVER

from tessera.enforcer.kubelet.api import pluginregistration_v1_pb2 as reg_pb2
from tessera.enforcer.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc

from kit import eventually
from kubetessera import KubeletDirs
from pluginslices import capacity_and_plugin

NODE = "slices-follow-0"
HEARTBEATS = 3  # the publisher's passes over its slices that a slice must stay absent through


async def register(registry: Path) -> None:
    """The kubelet's plugin watcher: GetInfo on the registration socket, then the verdict."""
    [socket] = [p for p in registry.iterdir() if p.is_socket()]
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        await stub.GetInfo(reg_pb2.InfoRequest(), timeout=10)
        await stub.NotifyRegistrationStatus(reg_pb2.RegistrationStatus(plugin_registered=True), timeout=10)


async def test_the_slice_waits_for_the_registration_and_stays_wiped_while_the_plugin_is_gone(kube_cluster, nats_url,
                                                                                                tmp_path):
    root = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))  # (unix socket paths are short)
    dirs = KubeletDirs.of(root, NODE)
    try:
        async with capacity_and_plugin(kube_cluster, nats_url, tmp_path, NODE, dirs) as setup:
            await setup.heartbeats(HEARTBEATS)
            assert await setup.gone(), "a slice with no plugin registered"
            assert setup.logged(f"ResourceSlice of {NODE} not written")

            await register(dirs.registry)
            [written] = await eventually(setup.slices, timeout=30, what="the slice, once the plugin is registered")
            generation = written["spec"]["pool"]["generation"]

            setup.cluster.stop_process(setup.cluster.find(f"enforcer-{NODE}"))  # SIGTERM: it says it stopped
            await eventually(lambda: setup.logged("is not registered (the plugin stopped)"), timeout=30,
                             what="the publisher hearing that the plugin stopped")
            # the kubelet's "driver is down": every slice of the driver on the node goes
            await asyncio.to_thread(kube_cluster.kubectl, "delete", "resourceslices",
                                    f"--field-selector=spec.nodeName={NODE},spec.driver={DRIVER}")
            await setup.heartbeats(HEARTBEATS)
            assert await setup.gone(), "the wiped slice written back while the plugin is gone"
            assert setup.logged(f"ResourceSlice of {NODE} not written: its kubelet plugin is not registered")

            setup.start_enforcer()
            await asyncio.to_thread(setup.cluster.wait_ready, 60)
            await register(dirs.registry)
            [back] = await eventually(setup.slices, timeout=30, what="the slice back with the plugin")
            assert back["spec"]["pool"]["generation"] == generation  # the same devices: the same pool generation
    finally:
        shutil.rmtree(root, ignore_errors=True)
