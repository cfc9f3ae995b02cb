"""The capacity publisher and the enforcer meet only on the bus: a node's slice follows what the
enforcer says of its registration, on the real kube-apiserver, with the test in the kubelet's place
(its registration calls, and its wipe: a collection delete of the node's slices of the driver).
The real kubelet does the same in test_real_plugin_slices.py; this one needs no node, so it is the
quick check of the bus path (the enforcer's ``kubelet-plugin`` reports, the publisher's rules).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import grpc
import yaml

from tessera.shared import subjects
from tessera.shared.events import NodeHeartbeat, inventory_decoder
from tessera.shared.kubeclaims import DRIVER

from tessera.cli.client import Client

from tessera.enforcer.kubelet.api import pluginregistration_v1_pb2 as reg_pb2
from tessera.enforcer.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc

from kit import eventually
from kit.kubecluster import node_bound_identity, service_identity
from kubetessera import KubeletDirs, start_services

GPU = {"model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}
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
    async def slices() -> list[dict]:
        out = await asyncio.to_thread(kube_cluster.kubectl, "get", "resourceslices", "-o", "json",
                                      f"--field-selector=spec.nodeName={NODE},spec.driver={DRIVER}")
        return json.loads(out.stdout)["items"]

    async def wipe() -> None:  # the kubelet's "driver is down"
        await asyncio.to_thread(kube_cluster.kubectl, "delete", "resourceslices",
                                f"--field-selector=spec.nodeName={NODE},spec.driver={DRIVER}")

    profile = tmp_path / "fleet.yaml"
    profile.write_text(yaml.safe_dump({"nodes": [{"name": NODE, "gpus": [GPU]}]}))
    dirs = KubeletDirs.of(Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp")), NODE)
    identities = {"capacity": node_bound_identity(kube_cluster, "capacity.yaml", NODE),
                  "enforcer": service_identity(kube_cluster, "enforcer.yaml")}
    cluster = await start_services(tmp_path / "tessera", nats_url, None, profile=profile, services=("capacity",),
                                   kubeconfigs=identities, kubelets={NODE: dirs})
    capacity_log = cluster.find("capacity").log_path
    client = await Client.connect(nats_url)
    beats = 0

    async def beat(msg) -> None:
        nonlocal beats
        if isinstance(inventory_decoder.decode(msg.data), NodeHeartbeat):
            beats += 1

    async def heartbeats(n: int) -> None:
        """Until the publisher has gone over its slices ``n`` more times (each heartbeat does, first)."""
        seen = beats
        await eventually(lambda: beats >= seen + n, timeout=30, what=f"{n} heartbeats")

    listening = await client.bus.listen(subjects.inventory(NODE), beat)
    try:
        await heartbeats(HEARTBEATS)
        assert await slices() == [], "a slice with no plugin registered"
        assert "ResourceSlice of slices-follow-0 not written" in capacity_log.read_text()

        await register(dirs.registry)
        [written] = await eventually(slices, timeout=30, what="the slice, once the plugin is registered")
        generation = written["spec"]["pool"]["generation"]

        enforcer = cluster.find(f"enforcer-{NODE}")
        cluster.stop_process(enforcer)  # SIGTERM: the plugin says it stopped
        await eventually(lambda: "is not registered (the plugin stopped)" in capacity_log.read_text(), timeout=30,
                         what="the publisher hearing that the plugin stopped")
        await wipe()
        await heartbeats(HEARTBEATS)
        assert await slices() == [], "the wiped slice written back while the plugin is gone"
        assert "ResourceSlice of slices-follow-0 not written: its kubelet plugin is not registered" \
            in capacity_log.read_text()

        cluster.spawn("enforcer", instance=f"enforcer-{NODE}", env={
            "TESSERA_NODE": NODE, **dirs.env(), "KUBECONFIG": str(identities["enforcer"])})
        await asyncio.to_thread(cluster.wait_ready, 60)
        await register(dirs.registry)
        [back] = await eventually(slices, timeout=30, what="the slice back with the plugin")
        assert back["spec"]["pool"]["generation"] == generation  # the same devices: the same pool generation
    finally:
        await listening.unsubscribe()
        await client.close()
        await asyncio.to_thread(cluster.stop)
        shutil.rmtree(dirs.registry.parent.parent, ignore_errors=True)
