"""Two (and three) placement processes race for a small fleet: no GPU is ever over-committed.

Every revision of every node's ledger record is checked as it is written (a KV watch), not only the
final state; at the end the ledger must equal the sum of the live claims, each claim on one node.
"""

from __future__ import annotations

import asyncio
import random
import re

import msgspec
import pytest

from tessera.shared import api, subjects
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.events import GpuQuota, NodeInventory
from tessera.shared.ledger import decode_node_ledger, device_totals

from tessera.cli.client import Client

from kit import eventually

LIVE = {"allocated", "prepared", "running"}


async def watch_ledger(client: Client, inventories: dict[str, NodeInventory], violations: list, seen: list):
    kv = await client.bus.kv(subjects.KV_LEDGER)
    watcher = await kv.watch("node.>")
    try:
        async for entry in watcher:
            if entry is None or not entry.value:
                continue
            ledger = decode_node_ledger(entry.value)
            seen.append(entry.revision)
            caps = {d.uuid: d for d in inventories[ledger.node].devices}
            for uuid, t in device_totals(ledger).items():
                d = caps[uuid]
                if t.memory_mib > d.memory_mib or t.cores > 100 or t.shares > d.max_shares:
                    violations.append((entry.revision, ledger.node, uuid, t))
    finally:
        await watcher.stop()


async def settle(client: Client, claims: list[str], timeout: float = 60) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    stable = 0
    while True:
        state = await client.fleet()
        moving = [c for c in claims if c not in state.claims or state.claims[c].state in ("requested", "allocated")]
        stable = stable + 1 if not moving else 0
        if stable >= 3:
            return state
        assert asyncio.get_running_loop().time() < deadline, f"still moving: {moving[:5]}"
        await asyncio.sleep(0.3)


@pytest.mark.parametrize("replicas", [2, 3])
async def test_placers_racing_never_overcommit(start_cluster, replicas):
    # Small fetches, so that the claims spread over the replicas instead of one taking them all.
    cluster = await start_cluster("race.yaml", placement_replicas=replicas,
                                  extra_env={"TESSERA_PLACEMENT_BATCH": "2"})
    client = await Client.connect(cluster.url)
    watch = None
    try:
        await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name="race", quota=GpuQuota()), timeout=30)
        inventories = (await client.fleet()).inventories
        violations: list = []
        seen: list = []
        watch = asyncio.create_task(watch_ledger(client, inventories, violations, seen))

        rng = random.Random(7)
        requests = []
        for _ in range(70):
            resources = {"nvidia.com/gpu": rng.choice([1, 1, 1, 2]),
                         "nvidia.com/gpumem": rng.randrange(500, 5000, 250),
                         "nvidia.com/gpucores": rng.choice([0, 10, 25, 40, 60])}
            requests.append(api.SubmitRequest(tenant="race", resources=resources))
        results = await asyncio.gather(*(client.submit(r) for r in requests))
        claims = [r["claim"] for r in results]
        state = await settle(client, claims)
        placed = [c for c in claims if state.claims[c].state in LIVE]
        waiting = [c for c in claims if state.claims[c].state == "unschedulable"]
        assert placed and waiting, "the fleet should be over-subscribed: some claims placed, some waiting"

        # Release a third of the placed claims at once: waiting claims must be retried into the space.
        gone = placed[::3]
        await asyncio.gather(*(client.release(c) for c in gone))
        for c in gone:
            await client.wait_for(c, {"released"}, timeout=30)
        state = await settle(client, claims)
        assert any(state.claims[c].state in LIVE for c in waiting), "no waiting claim was retried after releases"

        assert seen, "the watch saw no ledger writes"
        assert violations == [], f"over-commit: {violations[:3]}"
        in_ledger: dict[str, str] = {}
        for node, ledger in state.ledgers.items():
            for claim, entry in ledger.entries.items():
                assert claim not in in_ledger, f"{claim} is on {in_ledger[claim]} and {node}"
                in_ledger[claim] = node
                record = state.claims[claim]
                assert record.node == node and msgspec.to_builtins(record.devices) == msgspec.to_builtins(entry.shares)
        live = {c for c, r in state.claims.items() if r.state in LIVE}
        assert set(in_ledger) == live

        # Both replicas took part (each logs what it allocated every few seconds; its only report of it).
        def allocated(name: str) -> int:
            text = cluster.find(name).log_path.read_text()
            return sum(int(n) for n in re.findall(r"last 5s: allocated (\d+)", text))

        for name in [f"placement-{i}" for i in range(replicas)]:
            await eventually(lambda name=name: allocated(name) > 0, timeout=30,
                             what=f"{name} to log an allocation (else the race was not a race)")
    finally:
        if watch is not None:
            await cancel_and_wait([watch])
        await client.close()
