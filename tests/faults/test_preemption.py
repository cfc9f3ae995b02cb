"""Preemption on a real local cluster (nats-server, translator, placement, enforcers as processes),
with the auditor over every ledger revision: a high-priority claim that fits nowhere on its node
has lower-priority claims released by their enforcer, and is allocated only once their ledger
entries are gone; at no revision is a GPU over-committed. A claim of equal priority preempts
nothing and waits, saying why."""

from __future__ import annotations

from tessera.shared import api, subjects
from tessera.shared.events import ClaimSpec, GpuQuota

from tessera.cli.client import Client

import scenarios
from auditor import Accepted, Auditor

PREEMPTION = {"TESSERA_PLACEMENT_PREEMPTION": "true", "TESSERA_RECLAIM_SECONDS": "2",
              "TESSERA_USAGE_SECONDS": "0.2", "TESSERA_USAGE_HEARTBEAT_SECONDS": "2"}
HALF = 40000  # MiB: two fill one 81,559 MiB GPU of tiny.yaml


async def _cluster_of_alpha(start_cluster):
    """A local cluster with preemption on and the tenant ``alpha``, and a client of it."""
    cluster = await start_cluster("tiny.yaml", extra_env=PREEMPTION, stop_timeout=2)
    client = await Client.connect(cluster.url)
    await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name="alpha", quota=GpuQuota(gpus=8)),
                      timeout=30)
    return cluster, client


async def test_a_higher_priority_claim_takes_the_place_of_lower_ones_never_over_committing(start_cluster):
    cluster, client = await _cluster_of_alpha(start_cluster)
    try:
        auditor = await Auditor.start(cluster.url)
        try:
            accepted: dict[str, Accepted] = {}

            async def submit(priority: int | None = None) -> str:
                claim = (await client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": HALF},
                                                               scheduling_priority=priority, node="gpu-0")))["claim"]
                accepted[claim] = Accepted(claim, "alpha")
                return claim

            low = [await submit() for _ in range(4)]  # unset: scheduling priority 0
            for claim in low:
                await client.wait_for(claim, {"allocated", "prepared", "running"}, timeout=60)

            equal = await submit()  # priority 0 as well: fits nowhere, preempts nothing
            waiting = await client.wait_for(equal, {"unschedulable"}, timeout=60)
            assert "nothing to preempt" in waiting.reason, waiting.reason
            assert [c for c in low if (await client.claim(c)).release_requested] == []
            await client.release(equal)
            accepted[equal].release_requested = True
            await client.wait_for(equal, {"released"}, timeout=60)

            high = await submit(priority=100)
            placed = await client.wait_for(high, {"allocated", "prepared", "running"}, timeout=90)
            assert placed.node == "gpu-0"
            records = {c: await client.claim(c) for c in low}
            victims = sorted(c for c, r in records.items() if r.release_requested)
            assert len(victims) == 1, {c: (r.state, r.reason) for c, r in records.items()}
            for victim in victims:
                record = await client.wait_for(victim, {"released"}, timeout=60)
                assert f"preempted by {high}" in record.reason and "priority 100 > 0" in record.reason
                accepted[victim].release_requested = True
            for claim in [high, *(c for c in low if c not in victims)]:  # their enforcer done with them
                await client.wait_for(claim, {"prepared", "running"}, timeout=60)
            # The preemptor's GPU holds it and the survivors only: no share was sold twice.
            findings = await auditor.audit(accepted)
            assert findings.clean, findings.lines()
            assert auditor.ledger.revisions >= 6  # four lows, the high, a victim's removal at least
        finally:
            await auditor.close()
    finally:
        await client.close()


async def test_a_non_preemptible_claim_is_never_preempted_and_the_waiting_claim_says_why(start_cluster):
    cluster, client = await _cluster_of_alpha(start_cluster)
    try:
        guarded = ClaimSpec(gpus=2, memory_mib=81559, cores=100, priority=0, preemptible=False)
        kept = (await client.submit(api.SubmitRequest(tenant="alpha", spec=guarded, node="gpu-0")))["claim"]
        await client.wait_for(kept, {"allocated", "prepared", "running"}, timeout=60)

        high = (await client.submit(api.SubmitRequest(
            tenant="alpha", spec=ClaimSpec(memory_mib=HALF, priority=100), node="gpu-0")))["claim"]
        waiting = await client.wait_for(high, {"unschedulable"}, timeout=60)
        assert "nothing to preempt" in waiting.reason and f"{kept} (non-preemptible)" in waiting.reason, \
            waiting.reason
        assert not (await client.claim(kept)).release_requested
    finally:
        await client.close()


async def test_under_a_priority_mix_and_a_fault_no_claim_is_lost_duplicated_or_overcommitted(tmp_path):
    """The fault suite's audit with preemption on and a fifth of the load at a high priority, one
    placement replica killed meanwhile: claims released for higher-priority ones are preempted,
    not lost, and no ledger revision holds a GPU twice."""
    row = await scenarios.run("kill-placement-replica", tmp_path / "run", scenarios.Form.short(), high=0.2)
    assert row.accepted > 0 and row.revisions > 0, "the load did not reach the system"
    assert row.findings == []
    assert (row.lost, row.duplicated, row.overcommitted) == (0, 0, 0)
    assert row.recover_seconds is not None
    print(f"accepted {row.accepted}, preempted {row.preempted}, ledger revisions {row.revisions}")
