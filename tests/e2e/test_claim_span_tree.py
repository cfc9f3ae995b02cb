"""One claim's trace, as a tracing backend receives it from the real services: a tree.

The five services run as their own processes against a real nats-server and export over real
OTLP/HTTP to a receiver in the test. One claim is submitted, prepared on a node, and released by
deleting its tenant (the control-plane manager's drain sends the release). Its spans form one tree
whose parents link across services (translator → placement → enforcer; translator → manager →
enforcer), each span names its service, every claim span carries the claim attributes of
docs/observability.md, nothing failed ends with ERROR, and the log lines written while handling
the claim carry the ids of the span they were written in.
"""

from __future__ import annotations

import asyncio
import re

import msgspec

from tessera.cli.client import Client
from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota
from tessera.shared.telemetry import CLAIM, DECISION, DECISION_REASON, DEVICES, NODE, POLICY, TENANT

SERVICES = {f"tessera-{s}" for s in ("translator", "placement", "enforcer", "controlplane", "capacity")}
SUBMIT = f"translator serve {subjects.API_SUBMIT}"


async def run_one_claim(cluster) -> str:
    client = await Client.connect(cluster.url)
    try:
        await client.call(f"{subjects.API_TENANTS}.create",
                          api.TenantRequest(name="alpha", quota=GpuQuota(gpus=4)), timeout=30)
        result = await client.submit(api.SubmitRequest(
            tenant="alpha", resources={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 20000, "nvidia.com/gpucores": 30}))
        claim = result["claim"]
        await client.wait_for(claim, {"prepared"}, timeout=30)
        reply = api.decode_reply(await client.bus.request(
            f"{subjects.API_TENANTS}.delete", msgspec.json.encode(api.TenantRequest(name="alpha")), timeout=60))
        assert reply.ok, reply.error  # answered once the tenant's claims are released
        return claim
    finally:
        await client.close()


def one(spans: list[dict], name: str) -> dict:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, f"{len(found)} spans named {name!r} in {sorted(s['name'] for s in spans)}"
    return found[0]


async def test_one_claim_is_one_span_tree_across_the_services_with_its_attributes(start_cluster, otlp_collector):
    cluster = await start_cluster("tiny.yaml", otlp_endpoint=otlp_collector.endpoint)
    claim = await run_one_claim(cluster)
    codes = await asyncio.to_thread(cluster.stop)  # stopping flushes every service's pending spans
    assert all(code == 0 for code in codes.values()), codes

    with otlp_collector.lock:
        everything = list(otlp_collector.spans)
    assert {s["service"] for s in everything} == SERVICES  # each span names its own service

    root = one([s for s in everything if s["attributes"].get(CLAIM) == claim], SUBMIT)
    tree = [s for s in everything if s["trace_id"] == root["trace_id"]]
    by_id = {s["span_id"]: s for s in tree}
    assert len(by_id) == len(tree), "a span id appears twice in the trace"
    roots = [s for s in tree if not s["parent_span_id"]]
    assert roots == [root], f"the trace has {len(roots)} roots: {[s['name'] for s in roots]}"
    dangling = [s["name"] for s in tree if s["parent_span_id"] and s["parent_span_id"] not in by_id]
    assert not dangling, f"spans whose parent never arrived: {dangling}"

    placed = one(tree, "placement handle requested")
    prepared = one(tree, "enforcer handle allocated")
    drained = one(tree, "controlplane drain claim")
    released = one(tree, "enforcer handle release")
    # The edges, across four processes.
    assert placed["parent_span_id"] == root["span_id"] and root["service"] == "tessera-translator"
    assert prepared["parent_span_id"] == placed["span_id"] and placed["service"] == "tessera-placement"
    assert drained["parent_span_id"] == root["span_id"] and drained["service"] == "tessera-controlplane"
    assert released["parent_span_id"] == drained["span_id"] and released["service"] == "tessera-enforcer"
    assert prepared["service"] == "tessera-enforcer"
    # Every span of the tree is about this claim, and nothing in it failed.
    assert all(s["attributes"].get(CLAIM) == claim for s in tree), [s["name"] for s in tree]
    assert all(s["attributes"].get(TENANT) == "alpha" for s in tree)
    assert [s["name"] for s in tree if s["status"] == "STATUS_CODE_ERROR"] == []

    node = prepared["attributes"][NODE]
    assert node.startswith("gpu-")
    assert placed["attributes"][NODE] == node and released["attributes"][NODE] == node
    [device] = placed["attributes"][DEVICES]
    index, uuid, memory, cores = device.split(":")
    assert (memory, cores) == ("20000MiB", "30%") and uuid and int(index) >= 0
    assert prepared["attributes"][DEVICES] == [device] == released["attributes"][DEVICES]
    assert placed["attributes"][POLICY] == "fragmentation-aware/fragmentation-aware"  # the service's default
    decisions = {s["name"]: (s["attributes"][DECISION], s["attributes"][DECISION_REASON])
                 for s in (root, placed, prepared, drained, released)}
    assert decisions == {
        SUBMIT: ("requested", ""),
        "placement handle requested": ("allocated", ""),
        "enforcer handle allocated": ("prepared", ""),
        "controlplane drain claim": ("release", f"tenant deleted: sent to {node}"),
        "enforcer handle release": ("released", "tenant deleted"),
    }

    # The log lines written while handling the claim name the span they were written in.
    def lines(instance: str, text: str) -> list[tuple[str, str]]:
        log = cluster.find(instance).log_path.read_text()
        return re.findall(rf"trace=(\S+) span=(\S+): .*{re.escape(text)}", log)

    assert lines("translator", f"claim {claim} for tenant alpha requested") == [(root["trace_id"], root["span_id"])]
    assert lines(f"enforcer-{node}", f"prepared {claim} ") == [(prepared["trace_id"], prepared["span_id"])]
    assert lines(f"enforcer-{node}", f"released {claim} on") == [(released["trace_id"], released["span_id"])]
