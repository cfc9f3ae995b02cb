"""A node that lost its heartbeat cannot release its claims; a peer enforcer does, after a bound.

The capacity publisher serving both nodes is killed and a new one is started for gpu-0 only, so
gpu-1 falls silent and is labelled lost while its enforcer (and gpu-0's) keep running.
"""

from __future__ import annotations

from tessera.shared import api

from tessera.cli.client import Client

from kit import eventually
from runkit import live_entries


async def test_claims_of_a_lost_node_are_released_by_a_peer(fresh_cluster):
    cluster = await fresh_cluster(heartbeat_seconds=0.5, lost_after_seconds=3)
    client = await Client.connect(cluster.url)
    try:
        kept = (await client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": 1000}, node="gpu-0")))["claim"]
        doomed = (await client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": 1000}, node="gpu-1")))["claim"]
        await client.wait_for(kept, {"prepared"})
        await client.wait_for(doomed, {"prepared"})

        capacity = cluster.find("capacity")
        capacity.proc.kill()
        capacity.proc.wait()
        cluster.spawn("capacity", instance="capacity-gpu-0", env={"TESSERA_CAPACITY_NODES": "gpu-0"})

        record = await client.wait_for(doomed, {"released"}, timeout=60)
        assert record.reason == "node gpu-1 lost"
        # The ledger entry goes last (it marks an unfinished release), a moment after the record.
        await eventually(lambda: _gone(client, doomed), what=f"{doomed} leaving gpu-1's ledger")
        entries = await live_entries(client)
        assert entries.get(kept) == "gpu-0"  # a reservation on a healthy node is never touched
        assert (await client.claim(kept)).state == "prepared"
    finally:
        await client.close()


async def _gone(client: Client, claim: str) -> bool:
    return claim not in await live_entries(client)
