"""The capacity publisher announces its nodes and notices a node whose heartbeats stop.

Two publishers serve one node each, as they would on two real machines; when one is killed, the
other marks that node lost (inventory label and a `lost` event), and restarting it restores the node.
"""

from __future__ import annotations

import asyncio

import msgspec

from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.settings import BusSettings
from tessera.shared.events import NodeInventory, NodeLost, inventory_decoder

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
