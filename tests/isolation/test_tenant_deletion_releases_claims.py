"""Deleting a tenant releases its claims and quota before anything else of it goes (issue 13).

The whole local system as processes (manager, translator, placement, enforcers on simulated
hardware, each with its own NATS identity). Before, deleting a tenant removed its quota, account and
datastore and left its claims allocated: the ledger kept their shares and the usage record its
count, GPUs sold to a tenant that no longer exists. Now the deletion waits until none of that is
left, and another tenant's claims are untouched; a deletion whose claims cannot be released in time
stays pending, says what is left, and is finished by the manager's resync once they are.
"""

from __future__ import annotations

import asyncio

import msgspec

from tessera.cli.client import Client
from tessera.shared import api, subjects
from tessera.shared.api import SubmitRequest, TenantRequest
from tessera.shared.claimstore import ClaimStore
from tessera.shared.events import GpuQuota, TenantRecord
from tessera.shared.kvkeys import live_keys
from tessera.shared.ledger import Ledger

from tessera.controlplane.store import KV_CONTROLPLANES, KV_SECRETS
from kit import eventually

GPUMEM = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}


async def delete(client: Client, name: str) -> dict:
    reply = api.decode_reply(await client.bus.request(f"{subjects.API_TENANTS}.delete",
                                                      msgspec.json.encode(TenantRequest(name=name)), timeout=60))
    assert reply.ok, reply.error
    return reply.result


async def tenants_with_claims(client: Client) -> dict[str, list[str]]:
    """alpha: two claims prepared on nodes and one unschedulable (over its quota); beta: one prepared."""
    for name in ("alpha", "beta"):
        await client.call(f"{subjects.API_TENANTS}.create", TenantRequest(name=name, quota=GpuQuota(gpus=3)), timeout=30)
    claims: dict[str, list[str]] = {"alpha": [], "beta": []}
    for tenant, resources in (("alpha", GPUMEM), ("alpha", GPUMEM), ("beta", GPUMEM)):
        claim = (await client.submit(SubmitRequest(tenant=tenant, resources=resources)))["claim"]
        await client.wait_for(claim, {"prepared"})
        claims[tenant].append(claim)
    waiting = (await client.submit(SubmitRequest(tenant="alpha", resources={"nvidia.com/gpu": 2})))["claim"]
    assert "quota" in (await client.wait_for(waiting, {"unschedulable"})).reason
    claims["alpha"].append(waiting)
    return claims


async def state_of(client: Client, tenant: str):
    """Everything of ``tenant`` the platform's buckets still hold, read as the operator."""
    ledger = Ledger(await client.bus.kv(subjects.KV_LEDGER))
    records = {r.claim: r for r in await ClaimStore(await client.bus.kv(subjects.KV_CLAIMS)).all() if r.tenant == tenant}
    entries = {c: node for node, led in (await ledger.all_nodes()).items() for c, e in led.entries.items()
               if e.tenant == tenant}
    usage, _ = await ledger.read_tenant(tenant)
    return records, entries, usage


async def present(client: Client, bucket: str, key: str) -> bool:
    return key in await live_keys(await client.bus.kv(bucket))


async def test_deleting_a_tenant_releases_its_claims_and_quota_first(start_cluster):
    cluster = await start_cluster("tiny.yaml")
    client = await Client.connect(cluster.url)
    try:
        claims = await tenants_with_claims(client)
        records, entries, usage = await state_of(client, "alpha")
        assert len(entries) == 2 and len(usage.claims) == 2  # what a deletion must give back

        result = await delete(client, "alpha")
        assert result == {"name": "alpha", "deleted": True, "existed": True}

        # By the time the manager answers, nothing of alpha holds a GPU or any quota...
        records, entries, usage = await state_of(client, "alpha")
        assert {c: r.state for c, r in records.items()} == {c: "released" for c in claims["alpha"]}
        assert entries == {}, f"the ledger still holds alpha's shares: {entries}"
        assert usage.claims == {}, f"alpha's quota usage still counts {sorted(usage.claims)}"
        # ...and only then did its quota, credentials and record go.
        for bucket in (subjects.KV_TENANTS, KV_CONTROLPLANES, KV_SECRETS):
            assert not await present(client, bucket, "alpha"), bucket
        # beta is untouched: its claim prepared, its share in the ledger, its usage counted.
        records, entries, usage = await state_of(client, "beta")
        (beta_claim,) = claims["beta"]
        assert records[beta_claim].state == "prepared" and beta_claim in entries and beta_claim in usage.claims
        assert await present(client, subjects.KV_TENANTS, "beta")
    finally:
        await client.close()


async def test_a_deletion_whose_claims_are_not_released_stays_pending_and_the_resync_finishes_it(start_cluster):
    cluster = await start_cluster("tiny.yaml", extra_env={"TESSERA_CP_TEARDOWN_WAIT_SECONDS": "2",
                                                          "TESSERA_CP_RESYNC_SECONDS": "1"})
    client = await Client.connect(cluster.url)
    try:
        claims = await tenants_with_claims(client)
        on_node = {r.node for c, r in (await state_of(client, "alpha"))[0].items() if r.state == "prepared"}
        stopped = [cluster.find(f"enforcer-{node}") for node in sorted(on_node)]
        for sp in stopped:  # the enforcers that would release alpha's claims are down
            await asyncio.to_thread(cluster.stop_process, sp)

        result = await delete(client, "alpha")
        assert result["pending"] is True and result["deleted"] is False, result
        assert result["reason"] == "ClaimsNotReleased"
        prepared = [c for c, r in (await state_of(client, "alpha"))[0].items() if r.state == "prepared"]
        assert prepared and all(c in result["message"] for c in prepared), result["message"]
        # Not silently completed: the tenant is there, deleting, and says why...
        view = await client.call(f"{subjects.API_TENANTS}.get", TenantRequest(name="alpha"))
        assert view["phase"] == "Deleting" and view["reason"] == "ClaimsNotReleased"
        assert await present(client, KV_SECRETS, "alpha")  # its credentials are kept meanwhile
        # ...and its quota is closed, so none of its claims is placed meanwhile.
        entry = await (await client.bus.kv(subjects.KV_TENANTS)).get("alpha")
        record = msgspec.json.decode(entry.value, type=TenantRecord)
        assert (record.phase, record.quota) == ("Deleting", GpuQuota(gpus=0, memory_mib=0, cores=0))

        for sp in stopped:  # the enforcers come back; the manager's resync finishes the deletion
            cluster.spawn("enforcer", instance=sp.name, env={"TESSERA_NODE": sp.name.removeprefix("enforcer-")})
        async def deleted() -> bool:
            return not await present(client, KV_CONTROLPLANES, "alpha")

        await eventually(deleted, timeout=60, every=0.2, what="alpha's control plane deleted")
        records, entries, usage = await state_of(client, "alpha")
        assert {r.state for r in records.values()} == {"released"} and entries == {} and usage.claims == {}
        assert not await present(client, subjects.KV_TENANTS, "alpha")
        assert not await present(client, KV_SECRETS, "alpha")
        (beta_claim,) = claims["beta"]
        assert (await client.claim(beta_claim)).state == "prepared"
    finally:
        await client.close()
