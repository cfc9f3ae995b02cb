"""Preemption stops the victim's processes before the preemptor holds its GPU.

Four claims of priority 0 fill gpu-0, each with a workload that ignores SIGTERM; a claim of
priority 100 that fits nowhere preempts one of them. Every revision of gpu-0's ledger is checked
against the workloads' liveness as it arrives: no revision holds the preemptor while the victim's
workload lives, the victim was sent SIGTERM first and SIGKILLed only after its grace period (it
ignores SIGTERM, so it is killed, never stopped), and the other workloads are left alone.
"""

from __future__ import annotations

import asyncio

from tessera.shared import api
from tessera.shared.events import ClaimSpec

from tessera.cli.client import Client

from runkit import LedgerRevisions, start_workload

NODE = "gpu-0"
HALF = 40000  # MiB: two fill one 81,559 MiB GPU of tiny.yaml, four fill gpu-0


async def test_the_preemptor_is_allocated_only_once_the_victims_processes_are_gone(fresh_cluster, tmp_path):
    cluster = await fresh_cluster(extra_env={"TESSERA_PLACEMENT_PREEMPTION": "true"})
    client = await Client.connect(cluster.url)
    try:
        workloads = []
        for _ in range(4):
            claim = (await client.submit(api.SubmitRequest(tenant="alpha", spec=ClaimSpec(memory_mib=HALF),
                                                           node=NODE)))["claim"]
            await client.wait_for(claim, {"prepared"}, timeout=60)
            workloads.append(await start_workload(client, claim, tmp_path, on_term="ignore"))
        async with LedgerRevisions(client, NODE, workloads) as revisions:
            high = (await client.submit(api.SubmitRequest(
                tenant="alpha", spec=ClaimSpec(memory_mib=HALF, priority=100), node=NODE)))["claim"]
            await client.wait_for(high, {"prepared"}, timeout=90)
            records = {w.claim: await client.claim(w.claim) for w in workloads}
            victims = [w for w in workloads if records[w.claim].release_requested]
            assert len(victims) == 1, {c: (r.state, r.reason) for c, r in records.items()}
            victim = victims[0]
            code = await asyncio.wait_for(victim.proc.wait(), 60)
            removal = await revisions.removal(victim.claim)

        holding = [r for r in revisions.seen if high in r.claims]
        assert holding, revisions.seen
        assert not [r for r in holding if victim.claim in r.alive], \
            f"{high} was allocated while the process of its victim {victim.claim} lived: {revisions.seen}"
        assert victim.claim not in removal.alive and victim.claim in removal.termed  # SIGTERM first ...
        assert code == -9  # ... ignored: SIGKILLed once its grace period was over
        record = await client.wait_for(victim.claim, {"released"}, timeout=30)
        assert f"preempted by {high}" in record.reason, record.reason
        for survivor in (w for w in workloads if w is not victim):
            assert survivor.proc.returncode is None and not survivor.termed
            assert (await client.claim(survivor.claim)).state == "prepared"
    finally:
        for w in workloads:
            if w.proc.returncode is None:
                w.proc.kill()
                await w.proc.wait()
        await client.close()
