"""A node whose enforcer dies is lost, even though its GPUs are still announced, and what it held is
released by a peer: a SIGKILLed enforcer leaves no allocation behind."""

from __future__ import annotations


import msgspec

from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota, NodeInventory

from tessera.cli.client import Client

from kit import eventually

_inventory = msgspec.json.Decoder(NodeInventory)

FAST = {
    "TESSERA_USAGE_SECONDS": "0.2",
    "TESSERA_USAGE_HEARTBEAT_SECONDS": "0.5",
    "TESSERA_ENFORCER_LOST_AFTER_SECONDS": "3",
    "TESSERA_LOST_RECLAIM_SECONDS": "1",
}


async def test_killed_enforcer_makes_its_node_lost_and_its_claims_released(start_cluster):
    cluster = await start_cluster("tiny.yaml", extra_env=FAST)
    client = await Client.connect(cluster.url)
    try:
        await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name="alpha", quota=GpuQuota()), timeout=30)
        doomed = (await client.submit(api.SubmitRequest(tenant="alpha", node="gpu-1",
                                                        resources={"nvidia.com/gpumem": 1000})))["claim"]
        kept = (await client.submit(api.SubmitRequest(tenant="alpha", node="gpu-0",
                                                      resources={"nvidia.com/gpumem": 1000})))["claim"]
        await client.wait_for(doomed, {"prepared"}, timeout=30)
        await client.wait_for(kept, {"prepared"}, timeout=30)

        async def both_enforcers_reported() -> bool:
            return all([await client.bus.stored(subjects.STREAM_USAGE, subjects.usage(node))
                        for node in ("gpu-0", "gpu-1")])

        await eventually(both_enforcers_reported, what="usage reported by both enforcers")

        victim = cluster.find("enforcer-gpu-1")
        victim.proc.kill()
        victim.proc.wait()

        kv = await client.bus.kv(subjects.KV_INVENTORY)

        async def lost():
            inv = _inventory.decode((await kv.get("gpu-1")).value)
            return inv.labels.get("tessera.dev/lost") == "true"

        await eventually(lost)

        async def released():
            record = await client.claim(doomed)
            return record is not None and record.state == "released"

        await eventually(released)
        state = await client.fleet()
        assert {c for lg in state.ledgers.values() for c in lg.entries} == {kept}
        assert state.claims[kept].state == "prepared"
        gpu0 = _inventory.decode((await kv.get("gpu-0")).value)
        assert "tessera.dev/lost" not in gpu0.labels
    finally:
        await client.close()
