"""The services outlive a NATS restart: claims submitted after the server came back still go through.

The server is SIGKILLed (a crash, not a clean stop) and restarted on the same port and store; the
services' clients reconnect on their own (reconnect attempts are unlimited on purpose) and their
durable consumers pick up where they were.
"""

from __future__ import annotations

import asyncio

from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota

from tessera.cli.client import Client

from kit import eventually


async def test_claims_flow_again_after_nats_is_killed_and_restarted(start_cluster):
    cluster = await start_cluster("tiny.yaml")
    client = await Client.connect(cluster.url)
    try:
        await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name="alpha", quota=GpuQuota()), timeout=30)
        first = await client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": 1000}))
        await client.wait_for(first["claim"], {"prepared"}, timeout=30)
    finally:
        await client.close()

    cluster.nats.kill()
    await asyncio.sleep(1.0)
    await asyncio.to_thread(cluster.nats.start)

    client = await Client.connect(cluster.url)
    try:
        # the translator may still be reconnecting: a submit fails until it answers
        second = await eventually(
            lambda: client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": 2000})),
            timeout=20, every=0.2, what="the translator answering a submit after the restart")
        record = await client.wait_for(second["claim"], {"prepared"}, timeout=60)
        assert record.devices[0].memory_mib == 2000
        state = await client.fleet()
        assert {c for lg in state.ledgers.values() for c in lg.entries} == {first["claim"], second["claim"]}
        assert cluster.dead() == []
    finally:
        await client.close()
