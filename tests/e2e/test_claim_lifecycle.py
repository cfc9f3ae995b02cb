"""A claim travels through all five services, as separate processes, and back, in one trace.

The services run as their own console scripts against a real nats-server; their OTLP exporters send
spans over the real OTLP/HTTP protocol to a receiver in the test.
"""

from __future__ import annotations

import asyncio

from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota

from tessera.cli.client import Client

from kit import eventually


async def ledger_empty(client: Client) -> bool:
    state = await client.fleet()
    return not any(lg.entries for lg in state.ledgers.values())


async def test_claim_goes_requested_allocated_prepared_released_in_one_trace(start_cluster, otlp_collector):
    cluster = await start_cluster("tiny.yaml", otlp_endpoint=otlp_collector.endpoint)
    client = await Client.connect(cluster.url)
    try:
        await client.call(f"{subjects.API_TENANTS}.create",
                          api.TenantRequest(name="alpha", quota=GpuQuota(gpus=4)), timeout=30)
        result = await client.submit(api.SubmitRequest(
            tenant="alpha", resources={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 20000, "nvidia.com/gpucores": 30}
        ))
        claim = result["claim"]
        prepared = await client.wait_for(claim, {"prepared"}, timeout=30)
        assert prepared.node.startswith("gpu-")
        assert prepared.devices[0].memory_mib == 20000 and prepared.devices[0].cores == 30

        state = await client.fleet()
        assert [e for lg in state.ledgers.values() for e in lg.entries] == [claim]

        await client.release(claim)
        released = await client.wait_for(claim, {"released"}, timeout=30)
        assert released.state == "released"
        # The ledger entry goes last, a moment after the record (it marks an unfinished release).
        await eventually(lambda: ledger_empty(client), timeout=10, what="the released claim off every node's ledger")
    finally:
        await client.close()

    # Stopping flushes every service's pending spans.
    codes = await asyncio.to_thread(cluster.stop)
    assert all(code == 0 for code in codes.values()), codes

    claim_spans = [s for s in otlp_collector.spans
                   if claim in s["attributes"].get("messaging.destination", "")
                   or s["attributes"].get("tessera.claim") == claim]
    assert claim_spans, "no span mentions the claim"
    traces = {s["trace_id"] for s in claim_spans}
    assert len(traces) == 1, f"the claim's spans are in {len(traces)} traces"
    trace_id = traces.pop()
    in_trace = [s for s in otlp_collector.spans if s["trace_id"] == trace_id]
    services = {s["service"] for s in in_trace}
    assert {"tessera-translator", "tessera-placement", "tessera-enforcer"} <= services, services
    handled = {s["name"] for s in in_trace}
    for step in ("placement handle requested", "enforcer handle allocated", "enforcer handle release"):
        assert step in handled, f"{step!r} missing from {sorted(handled)}"
