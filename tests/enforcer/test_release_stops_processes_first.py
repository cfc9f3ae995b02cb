"""A released claim keeps its ledger entry until its processes are gone.

A claim's GPU memory is in use for as long as a process of the claim lives, whatever its record
says: the ledger entry that stands for it must outlive the process, or the GPU is sold again while
it is still occupied (the over-commit preemption must never cause). On a release request the
enforcer sends the claim's processes SIGTERM, waits the grace period, SIGKILLs what is left, and
only once the kernel says they are gone removes the entry and publishes ``released``.

Watched from outside, as any tool could: every revision of the node's ledger key (a core
subscription to the bucket's subject) is checked against the process's liveness when it arrives.
A process alive when a revision without its entry is seen was alive at that revision.
"""

from __future__ import annotations

import asyncio

from tessera.shared import api

from tessera.cli.client import Client

from runkit import LedgerRevisions, start_workload

NODE = "gpu-1"


async def reserved(client: Client) -> str:
    claim = (await client.submit(api.SubmitRequest(tenant="alpha", resources={"nvidia.com/gpumem": 500},
                                                   node=NODE)))["claim"]
    await client.wait_for(claim, {"prepared"}, timeout=60)
    return claim


async def test_a_released_claim_keeps_its_ledger_entry_until_its_process_is_killed(cluster, tmp_path):
    client = await Client.connect(cluster.url)
    try:
        workload = await start_workload(client, await reserved(client), tmp_path, on_term="ignore")
        claim = workload.claim
        async with LedgerRevisions(client, NODE, [workload]) as revisions:
            await client.release(claim, reason="test: stop it")
            record = await client.wait_for(claim, {"released"}, timeout=60)
            code = await asyncio.wait_for(workload.proc.wait(), 60)
            removal = await revisions.removal(claim)
        assert claim not in removal.alive, f"the ledger gave {claim}'s GPU memory back while its process lived: " \
                                           f"{revisions.seen}"
        assert claim in removal.termed  # SIGTERM first ...
        assert code == -9  # ... ignored, so SIGKILL once the grace period was over
        assert record.reason == "test: stop it"
    finally:
        await client.close()


async def test_a_process_that_stops_on_sigterm_is_given_its_grace_period(cluster, tmp_path):
    client = await Client.connect(cluster.url)
    try:
        workload = await start_workload(client, await reserved(client), tmp_path, on_term="exit")
        claim = workload.claim
        async with LedgerRevisions(client, NODE, [workload]) as revisions:
            await client.release(claim)
            await client.wait_for(claim, {"released"}, timeout=60)
            code = await asyncio.wait_for(workload.proc.wait(), 60)
            removal = await revisions.removal(claim)
        assert claim not in removal.alive and claim in removal.termed, revisions.seen
        assert code == 0  # it stopped by itself on SIGTERM: never SIGKILLed
    finally:
        await client.close()
