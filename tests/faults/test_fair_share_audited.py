"""Fair share on a real local cluster (nats-server, translator, placement, enforcers as processes),
with the auditor over every ledger revision (issue 26): a tenant with a borrowing limit takes the
idle fleet beyond its guarantee up to its limit and no further; another tenant asking within its own
guarantee then takes the idle room left and reclaims borrowed claims, of higher priority than its
own, for the rest; the
borrower's claims within its guarantee are never touched; at no revision is a GPU over-committed
or a tenant past its guarantee plus borrowing limit, and no claim is lost or placed twice."""

from __future__ import annotations

from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota

from tessera.cli.client import Client

from auditor import Accepted, Auditor

PREEMPTION = {"TESSERA_PLACEMENT_PREEMPTION": "true", "TESSERA_RECLAIM_SECONDS": "2",
              "TESSERA_USAGE_SECONDS": "0.2", "TESSERA_USAGE_HEARTBEAT_SECONDS": "2"}
HALF = 40000  # MiB: two fill one 81,559 MiB GPU of tiny.yaml, whose four GPUs hold eight
PLACED = {"allocated", "prepared", "running"}


async def test_the_owner_reclaims_borrowed_capacity_never_over_committing(start_cluster):
    cluster = await start_cluster("tiny.yaml", extra_env=PREEMPTION, stop_timeout=2)
    client = await Client.connect(cluster.url)
    try:
        for request in (api.TenantRequest(name="alpha", quota=GpuQuota(gpus=4)),
                        api.TenantRequest(name="beta", quota=GpuQuota(gpus=2),
                                          spec={"quota": {"borrowingLimit": {"gpus": 5}}})):
            await client.call(f"{subjects.API_TENANTS}.create", request, timeout=30)
        auditor = await Auditor.start(cluster.url)
        try:
            accepted: dict[str, Accepted] = {}

            async def submit(tenant: str, priority: int = 0) -> str:
                claim = (await client.submit(api.SubmitRequest(tenant=tenant, resources={"nvidia.com/gpumem": HALF},
                                                               scheduling_priority=priority)))["claim"]
                accepted[claim] = Accepted(claim, tenant, priority=priority)
                return claim

            # beta takes the idle fleet: two claims within its guarantee, five borrowed; not an eighth,
            # though one GPU's half is still free.
            lent = []
            for _ in range(7):
                lent.append(await submit("beta", priority=100))
                await client.wait_for(lent[-1], PLACED, timeout=60)
            beyond = await submit("beta", priority=100)
            refused = await client.wait_for(beyond, {"unschedulable"}, timeout=60)
            assert refused.reason == "tenant quota and borrowing limit exceeded: gpus 8 > 7 GPUs", refused.reason
            await client.release(beyond)
            accepted[beyond].release_requested = True
            await client.wait_for(beyond, {"released"}, timeout=60)

            # alpha asks for its guarantee, at priority 0: the idle half first, then three of beta's
            # borrowed claims are reclaimed for it.
            owned = [await submit("alpha") for _ in range(4)]
            for claim in owned:
                await client.wait_for(claim, {"prepared", "running"}, timeout=120)
            records = {c: await client.claim(c) for c in lent}
            victims = sorted(c for c, r in records.items() if r.release_requested)
            assert len(victims) == 3, {c: (r.state, r.reason) for c, r in records.items()}
            assert not set(victims) & set(lent[:2]), victims  # never a claim within beta's guarantee
            for victim in victims:
                record = await client.wait_for(victim, {"released"}, timeout=60)
                assert "reclaimed by tenant alpha for its guarantee" in record.reason, record.reason
                accepted[victim].release_requested = True
            for claim in (c for c in lent if c not in victims):
                await client.wait_for(claim, {"prepared", "running"}, timeout=60)

            findings, settled = await auditor.until_clean(accepted, timeout=60)  # (the last acks in flight)
            assert settled is not None and findings.clean, findings.lines()
            assert sorted(p.split(":")[0] for p in findings.preempted) == victims, findings.preempted
            assert auditor.ledger.revisions >= 14  # seven placed, three removed, four placed at least
            print(f"ledger revisions audited: {auditor.ledger.revisions}")
        finally:
            await auditor.close()
    finally:
        await client.close()
