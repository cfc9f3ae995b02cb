"""The capacity publisher announces its nodes and notices a node whose heartbeats stop.

Two publishers serve one node each, as they would on two real machines; when one is killed, the
other marks that node lost (inventory label and a `lost` event), and restarting it restores the node.
A peer that announced itself while this publisher was starting its watch is watched as well.
"""

from __future__ import annotations

import asyncio

import msgspec

from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.runner import ServiceContext
from tessera.shared.settings import BusSettings, ServiceSettings
from tessera.shared.events import GpuDevice, NodeInventory, NodeLost, encode, inventory_decoder
from tessera.shared.telemetry import Telemetry

from tessera.capacity import service as capacity_service
from tessera.capacity.service import CapacityService
from tessera.capacity.settings import CapacitySettings

from tessera.cli.client import Client
from tessera.cli.cluster import LocalCluster

from kit import eventually

_inventory = msgspec.json.Decoder(NodeInventory)


async def labels_of(client: Client, node: str) -> dict:
    kv = await client.bus.kv(subjects.KV_INVENTORY)
    return _inventory.decode((await kv.get(node)).value).labels


async def test_a_silent_node_is_marked_lost_and_restored_when_it_speaks_again(nats_server, tmp_path, profiles_dir):
    cluster = LocalCluster(workdir=tmp_path, profile=profiles_dir / "tiny.yaml", nats_url=nats_server.url,
                           heartbeat_seconds=0.5, lost_after_seconds=2.0)
    # Only capacity runs here: lay out the rest of the topology as the other services would (the
    # CLI reads the fleet and never creates buckets).
    tool = await Bus.connect(BusSettings(url=nats_server.url), "cli")
    await tool.ensure_topology()
    await tool.close()
    first = cluster.spawn("capacity", instance="capacity-gpu-0", env={"TESSERA_CAPACITY_NODES": "gpu-0"})
    second = cluster.spawn("capacity", instance="capacity-gpu-1", env={"TESSERA_CAPACITY_NODES": "gpu-1"})
    client = await Client.connect(nats_server.url)
    lost_events: list[NodeLost] = []

    async def on_msg(msg):
        event = inventory_decoder.decode(msg.data)
        if isinstance(event, NodeLost):
            lost_events.append(event)

    sub = await client.bus.listen(f"{subjects.INVENTORY}.>", on_msg)
    try:
        await asyncio.to_thread(cluster.wait_ready, 60)
        state = await client.fleet()
        assert set(state.inventories) == {"gpu-0", "gpu-1"}
        assert all(len(inv.devices) == 2 for inv in state.inventories.values())

        second.proc.kill()
        second.proc.wait()

        async def gpu1_lost():
            return (await labels_of(client, "gpu-1")).get("tessera.dev/lost") == "true"

        await eventually(gpu1_lost)
        assert [e.node for e in lost_events] == ["gpu-1"]
        assert "tessera.dev/lost" not in await labels_of(client, "gpu-0")

        cluster.spawn("capacity", instance="capacity-gpu-1b", env={"TESSERA_CAPACITY_NODES": "gpu-1"})

        async def gpu1_back():
            return "tessera.dev/lost" not in await labels_of(client, "gpu-1")

        await eventually(gpu1_back)
        assert first.alive()
    finally:
        await sub.unsubscribe()
        await client.close()
        cluster.stop()


def node(name: str) -> NodeInventory:
    return NodeInventory(node=name, devices=[GpuDevice(uuid=f"GPU-{name}-0", index=0, model="sim", memory_mib=16000)])


async def test_a_peer_announced_while_the_watch_starts_is_marked_lost_when_it_never_beats(nats_url, monkeypatch):
    """Issue 27: the publisher reads the nodes already announced and subscribes to the heartbeats.
    A peer that announces itself in between and dies before its first heartbeat must still be
    marked lost. The ordering is forced, not waited for: the peer announces at the very moment the
    read of the inventory bucket returns (read first, subscribe after, and it is never heard of)."""
    bus = await Bus.connect(BusSettings(url=nats_url), "capacity")
    peer = await Bus.connect(BusSettings(url=nats_url), "capacity")
    await bus.ensure_topology()
    ctx = ServiceContext(settings=ServiceSettings(service="capacity", bus=BusSettings(url=nats_url)),
                         bus=bus, telemetry=Telemetry("capacity", None))
    service = CapacityService(ctx, CapacitySettings(heartbeat_seconds=0.2, lost_after_seconds=1.0), [node("gpu-0")])
    peer_kv = await peer.kv(subjects.KV_INVENTORY)
    read = capacity_service.live_keys

    async def read_then_the_peer_announces(kv):
        keys = await read(kv)
        await peer_kv.put("gpu-1", encode(node("gpu-1")))  # what CapacityService.announce does, once
        await peer.publish(subjects.inventory("gpu-1"), node("gpu-1"))
        return keys

    monkeypatch.setattr(capacity_service, "live_keys", read_then_the_peer_announces)
    kv = await bus.kv(subjects.KV_INVENTORY)
    tasks = [asyncio.create_task(coro, name=f"capacity-{name}") for name, coro in (await service.start()).items()]
    try:
        async def gpu1_lost():
            return _inventory.decode((await kv.get("gpu-1")).value).labels.get("tessera.dev/lost") == "true"

        await eventually(gpu1_lost, what="gpu-1, announced once and silent since, labelled lost")
        assert "tessera.dev/lost" not in _inventory.decode((await kv.get("gpu-0")).value).labels
        assert ctx.ready
    finally:
        await cancel_and_wait(tasks)
        await peer.close()
        await bus.close()
